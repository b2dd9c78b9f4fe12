"""A plain Accelerate training loop, checkpointed by statereg.

    python examples/accelerate_loop.py --ckpt-dir /tmp/acc-run         # trains 60 steps
    STATEREG_STORAGE__URL=s3://bucket/run python examples/accelerate_loop.py   # to S3
    accelerate launch --cpu --num_processes 4 examples/accelerate_loop.py --ckpt-dir ...  # DDP

Kill it and run the same command again: `load_state` restores the latest committed
checkpoint (weights, AdamW state, the LR schedule, the dataloader's place inside its
shuffled epoch, the registered counter, every rank's random generators) and every later loss
is bit-identical to a run never interrupted (tests/integrations/test_accelerate.py).

It differs from the same loop with Accelerate's own save_state / load_state in the lines
marked `# statereg` (docs/integrations/accelerate.md shows the plain lines beside them).
"""

from __future__ import annotations

import argparse
import math

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from transformers import GPT2Config, GPT2LMHeadModel

from statereg.integrations.accelerate import load_state, save_state  # statereg

VOCAB, SEQ = 64, 32


class MarkovTokens(torch.utils.data.Dataset):
    """Sequences from a fixed random Markov chain: learnable, the same in every process."""

    def __init__(self, n: int = 512, seed: int = 1234) -> None:
        gen = torch.Generator().manual_seed(seed)
        trans = torch.softmax(torch.randn(VOCAB, VOCAB, generator=gen) * 3, dim=-1)
        self.tokens = torch.empty(n, SEQ, dtype=torch.long)
        self.tokens[:, 0] = torch.randint(VOCAB, (n,), generator=gen)
        for t in range(SEQ - 1):
            self.tokens[:, t + 1] = torch.multinomial(trans[self.tokens[:, t]], 1,
                                                      generator=gen)[:, 0]

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


class TokenCounter:
    """Anything with state_dict()/load_state_dict(), registered for checkpointing."""

    def __init__(self) -> None:
        self.tokens = 0

    def state_dict(self) -> dict[str, int]:
        return {"tokens": self.tokens}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.tokens = state["tokens"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt-dir", default="./checkpoints/accelerate-loop")
    parser.add_argument("--max-steps", type=int, default=60)
    options = parser.parse_args()
    total = options.max_steps

    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    # The dataloader says where it is inside its epoch, and orders each epoch by seed + epoch.
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(
        use_stateful_dataloader=True, use_seedable_sampler=True))
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)  # dropout 0.1 in every block
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * s / total)))
    loader = torch.utils.data.DataLoader(MarkovTokens(), batch_size=16, shuffle=True,
                                         drop_last=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader,
                                                              scheduler)
    counter = TokenCounter()
    accelerator.register_for_checkpointing(counter)

    spec = {"storage": {"url": options.ckpt_dir}, "save": {"keep_last": 2}}  # statereg
    restored = load_state(accelerator, spec)  # statereg: latest checkpoint, None if fresh
    step = restored.step if restored is not None else 0  # statereg
    model.train()
    while step < total:
        for batch in loader:  # right after a resume, it continues mid-epoch
            loss = model(**batch).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            counter.tokens += batch["input_ids"].numel()
            if step % 10 == 0:
                accelerator.print(f"step {step} loss {loss.item():.4f}")
            if step % 20 == 0:
                save_state(accelerator, spec, step)  # statereg
            if step == total:
                break
    accelerator.print(f"trained to step {step}, {counter.tokens} tokens")


if __name__ == "__main__":
    main()
