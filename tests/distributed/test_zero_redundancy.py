"""ZeroRedundancyOptimizer: each rank's partition of the optimizer state comes back exactly,
declared per_rank; any one-copy sharing is refused at construction, naming the component.

Its local optimizer's hyperparameters lag behind the exposed groups a scheduler writes
until the next step, so statereg saves the exposed groups' values: the resumed run then
steps with the learning rate the uninterrupted one had (a StepLR halves it mid-run here).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from harness import run_ranks
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import statereg

SAVE_AT, TOTAL = 4, 8


def _build() -> tuple[nn.Module, nn.Module, ZeroRedundancyOptimizer, object]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 1))
    ddp = DistributedDataParallel(model)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                        lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, ddp, optimizer, scheduler


def _spec(url: str, sharing: str) -> dict:
    return {"storage": {"url": url}, "components": {
        "model": {"kind": "model"}, "optimizer": {"kind": "optimizer", "sharing": sharing},
        "scheduler": {"kind": "scheduler"}}}


def zero_run(rank: int, world: int, url: str, out: str) -> None:
    def train(step: int) -> str:
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = ddp(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        return loss.item().hex()

    model, ddp, optimizer, scheduler = _build()
    with statereg.CheckpointManager(_spec(url, "per_rank"), model=model, optimizer=optimizer,
                                    scheduler=scheduler) as mgr:
        reference = [train(step) for step in range(SAVE_AT)]
        mgr.save(step=SAVE_AT)
        reference += [train(step) for step in range(SAVE_AT, TOTAL)]
    model, ddp, optimizer, scheduler = _build()
    with statereg.CheckpointManager(_spec(url, "per_rank"), model=model, optimizer=optimizer,
                                    scheduler=scheduler) as mgr:
        mgr.load()
        resumed = [train(step) for step in range(SAVE_AT, TOTAL)]
    refusal = ""
    try:
        statereg.CheckpointManager(_spec(url, "sharded"), model=model, optimizer=optimizer,
                                   scheduler=scheduler)
    except statereg.SpecError as exc:
        refusal = str(exc)
    Path(out, f"rank{rank}.json").write_text(json.dumps(
        {"reference": reference[SAVE_AT:], "resumed": resumed, "refusal": refusal}))


def test_zero_redundancy_optimizer_resumes_each_partition_exactly(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    run_ranks(2, zero_run, tmp_path, str(tmp_path / "ckpt"), str(out))
    for rank in range(2):
        got = json.loads((out / f"rank{rank}.json").read_text())
        assert got["resumed"] == got["reference"], f"rank {rank}"
        assert got["refusal"].startswith("component 'optimizer' is a ZeroRedundancyOptimizer")
        assert "declare the component sharing: per_rank" in got["refusal"]
