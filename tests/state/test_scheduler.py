"""Schedulers resume exactly what the checkpoint saved, whatever an earlier load left behind.

torch's LRScheduler.load_state_dict merges the loaded dict into the object's __dict__, so a key
that only an earlier load brought (a damaged state.json read with verify: off, found by the
model-based test, seed 5039) would outlive a later load of an intact checkpoint and be saved
from then on.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import statereg


def run(root: Path, make_scheduler: Callable[[torch.optim.Optimizer], Any],
        ) -> tuple[Any, Any, Any]:
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = make_scheduler(optimizer)
    spec = {"storage": {"url": str(root)},
            "components": {"model": {"kind": "model"}, "optimizer": {"kind": "optimizer"},
                           "scheduler": {"kind": "scheduler"}}}
    mgr = statereg.CheckpointManager(spec, model=model, optimizer=optimizer, scheduler=scheduler)
    return mgr, optimizer, scheduler


def test_a_key_only_a_damaged_unverified_load_brought_does_not_survive_a_good_load(tmp_path):
    mgr, optimizer, scheduler = run(tmp_path, lambda opt: torch.optim.lr_scheduler.StepLR(opt, 2))
    saved = {}
    for step in (1, 2):
        optimizer.step()
        scheduler.step()
        mgr.save(step=step)
        saved[step] = scheduler.state_dict()
    state_json = next((tmp_path / "step_00000002" / "scheduler").rglob("state.json"))
    state_json.write_bytes(state_json.read_bytes().replace(b'"_last_lr"', b'"_latt_lr"'))

    mgr.load(step=2, verify="off")  # reads the damage unchecked, as documented
    assert "_latt_lr" in scheduler.state_dict()
    mgr.load(step=1)
    assert scheduler.state_dict() == saved[1]
    mgr.save(step=3)  # and the stray key is not saved either
    assert b"_latt_lr" not in next(
        (tmp_path / "step_00000003" / "scheduler").rglob("state.json")).read_bytes()


def test_a_scheduler_keeps_its_own_attributes_across_loads(tmp_path):
    """LambdaLR leaves its functions out of state_dict(); they are its own, never dropped."""
    mgr, optimizer, scheduler = run(
        tmp_path, lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5 ** epoch))
    optimizer.step()
    scheduler.step()
    mgr.save(step=1)
    for _ in range(2):
        mgr.load(step=1)
    assert scheduler.get_last_lr() == [0.05]
    optimizer.step()
    scheduler.step()
    assert scheduler.get_last_lr() == [0.025]
