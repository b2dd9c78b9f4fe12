"""A TorchTitan-style training loop checkpointed by statereg (docs/integrations/torchtitan.md).

The loop has TorchTitan's shape: a model with FQNs like torchtitan's Llama (tok_embeddings,
layers, norm, output) sharded with FSDP2, AdamW, a per-step LambdaLR, a StatefulDataLoader
over a DistributedSampler, and a train_state; `checkpointer.load()` before training,
`maybe_wait_for_staging()` before `optimizer.step()`, `save(step, last_step)` after it.
Only the import of the CheckpointManager differs from torchtitan's Trainer.

    python examples/torchtitan_style.py --folder /tmp/titan --stop-at 6   # stops after step 6
    python examples/torchtitan_style.py --folder /tmp/titan                # resumes at step 5
    torchrun --nproc-per-node 2 examples/torchtitan_style.py --folder /tmp/titan2  # FSDP2, gloo

Each run prints its losses; a resumed run's equal an uninterrupted run's bit for bit
(`--check` runs both and compares them). `--folder s3://bucket/run` saves to S3 instead.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from statereg.integrations.torchtitan import CheckpointManager

VOCAB, DIM, SEQ = 64, 32, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.wo = nn.Linear(DIM, DIM)
        self.ffn_norm = nn.LayerNorm(DIM)
        self.ffn = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Dropout(0.1),
                                 nn.Linear(4 * DIM, DIM))
        self.drop = nn.Dropout(0.1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.attention_norm(h)).chunk(3, dim=-1)
        h = h + self.drop(self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True)))
        return h + self.ffn(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, n_layers: int = 2) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(n_layers)})
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


class TrainState:
    """What torchtitan saves as train_state: the step (and here the epoch)."""

    def __init__(self) -> None:
        self.step = 0
        self.epoch = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.epoch = state["step"], state["epoch"]


def train(folder: str, steps: int, stop_at: int | None) -> dict[int, float]:
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    torch.manual_seed(0)                      # the same initial weights on every rank
    model = Transformer()
    if world > 1:
        for layer in model.layers.values():
            fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    tokens = torch.randint(0, VOCAB, (256, SEQ + 1), generator=torch.Generator().manual_seed(1))
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=0)
    loader = StatefulDataLoader(data, batch_size=8, sampler=sampler)
    torch.manual_seed(1000 + rank)            # each rank its own dropout stream
    train_state = TrainState()

    checkpointer = CheckpointManager(
        dataloader=loader, model_parts=[model], optimizers=optimizer,
        lr_schedulers=scheduler, states={"train_state": train_state},
        checkpoint_config={"folder": folder, "interval": 4, "keep_latest_k": 3,
                           "async_mode": "async_with_pinned_mem",
                           "last_save_model_only": True, "last_save_in_hf": True,
                           "export_dtype": "bfloat16"})
    if checkpointer.load():                   # before the first iter(loader)
        print(f"rank {rank}: resumed at step {train_state.step}")
    losses: dict[int, float] = {}
    while train_state.step < steps:
        sampler.set_epoch(train_state.epoch)
        for inputs, labels in loader:
            train_state.step += 1
            loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
            loss.backward()
            checkpointer.maybe_wait_for_staging()   # the save's copy is done: step now
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses[train_state.step] = loss.item()
            checkpointer.save(train_state.step, last_step=train_state.step == steps)
            if train_state.step in (steps, stop_at):
                break
        else:
            train_state.epoch += 1
        if train_state.step == stop_at:
            break
    checkpointer.close()
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default=os.path.join(tempfile.gettempdir(), "titan-style"))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--stop-at", type=int, default=None)
    parser.add_argument("--check", action="store_true",
                        help="run uninterrupted, then stopped at step 6 and resumed; compare")
    args = parser.parse_args()
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    if args.check:
        fresh = f"{args.folder}-uninterrupted"
        for path in (fresh, args.folder):
            if os.path.isdir(path) and (not dist.is_initialized() or dist.get_rank() == 0):
                shutil.rmtree(path)
        if dist.is_initialized():
            dist.barrier()
        reference = train(fresh, args.steps, None)
        first = train(args.folder, args.steps, stop_at=6)
        second = train(args.folder, args.steps, None)   # resumes from the save at step 4
        same = {**first, **second} == reference
        print(json.dumps({"resumed_from": min(second) - 1, "bit_identical": same}))
        assert same, "a resumed loss differs from the uninterrupted run's"
    else:
        print(json.dumps(train(args.folder, args.steps, args.stop_at)))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
