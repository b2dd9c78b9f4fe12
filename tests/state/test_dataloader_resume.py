"""Resuming the data stream in the usual distributed order feeds exactly the batches it would have.

The usual order is `mgr.load()`, then `sampler.set_epoch(e)`, then `iter(loader)`, with
torch's DistributedSampler inside torchdata's StatefulDataLoader. Two real gloo ranks train a
small model (gradients all-reduced, dropout on) for three epochs without a break; a second
job saves mid-epoch 1, stops, and a fresh set of objects resumes in that order. Every rank
must see the same batches and compute the same losses, bit for bit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from harness import run_ranks

import statereg

stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")

EPOCHS = 3
BATCHES_PER_EPOCH = 6  # 48 samples over 2 ranks, 4 per batch
SAVE_AT = 9  # epoch 1, batch 3 of 6


def _objects(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, DistributedSampler, object]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1234)
    data = TensorDataset(torch.randn(48, 8, generator=generator),
                         torch.randn(48, 1, generator=generator))
    sampler = DistributedSampler(data, shuffle=True, seed=7)
    loader = stateful_dataloader.StatefulDataLoader(data, batch_size=4, sampler=sampler)
    return model, optimizer, sampler, loader


def _spec(url: str) -> dict:
    return {"storage": {"url": url},
            "components": {"model": {"kind": "model", "sharing": "replicated"},
                           "optimizer": {"kind": "optimizer", "sharing": "replicated"},
                           "dataloader": {"kind": "dataloader"},
                           "rng": {"kind": "rng"}}}


def _train(rank: int, world: int, url: str, out: str, resume: bool, stop_at: int | None
           ) -> None:
    """Train to the end of EPOCHS (or save at `stop_at` and stop); record batches and losses."""
    model, optimizer, sampler, loader = _objects(seed=0 if not resume else 99)
    torch.manual_seed(100 + rank)  # dropout differs per rank, as it does in a real job
    mgr = statereg.CheckpointManager(_spec(url), model=model, optimizer=optimizer,
                                     dataloader=loader)
    step = 0
    if resume:
        restored = mgr.load()  # 1. load
        assert restored is not None and restored.step == SAVE_AT
        step = restored.step
    record: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for epoch in range(step // BATCHES_PER_EPOCH, EPOCHS):
        sampler.set_epoch(epoch)  # 2. set_epoch
        for x, y in loader:  # 3. iter(loader)
            step += 1
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            optimizer.step()
            record[step] = (x.clone(), loss.detach().clone())
            if step == stop_at:
                mgr.save(step=step)
                mgr.close()
                torch.save(record, f"{out}-rank{rank}.pt")
                return
    mgr.close()
    torch.save(record, f"{out}-rank{rank}.pt")


def test_distributed_sampler_resumes_in_the_usual_order_bit_for_bit(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    run_ranks(2, _train, tmp_path, str(tmp_path / "unbroken"), str(tmp_path / "a"), False, None)
    run_ranks(2, _train, tmp_path, root, str(tmp_path / "before"), False, SAVE_AT)
    run_ranks(2, _train, tmp_path, root, str(tmp_path / "after"), True, None)
    for rank in (0, 1):
        unbroken = torch.load(tmp_path / f"a-rank{rank}.pt")
        resumed = {**torch.load(tmp_path / f"before-rank{rank}.pt"),
                   **torch.load(tmp_path / f"after-rank{rank}.pt")}
        assert sorted(unbroken) == sorted(resumed) == list(range(1, EPOCHS * BATCHES_PER_EPOCH + 1))
        batches = [s for s in unbroken if not torch.equal(unbroken[s][0], resumed[s][0])]
        assert batches == [], f"rank {rank}: different batches from step {batches[:1]} on"
        losses = [s for s in unbroken if not torch.equal(unbroken[s][1], resumed[s][1])]
        assert losses == [], f"rank {rank}: different losses from step {losses[:1]} on"
