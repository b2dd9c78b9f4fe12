"""replicated, per_rank, per_group and global sharing on real gloo process groups."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from torch import nn

import statereg


class Counter:
    """A small stateful object (e.g. a per-rank data cursor or a stage's bookkeeping)."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]

    def reshard_state_dict(self, states: list[dict], rank: int, world_size: int) -> dict:
        """A global cursor: the total is split evenly over the new ranks."""
        total = sum(s["value"] for s in states)
        return {"value": total // world_size}


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(128, 256), nn.Linear(256, 64))  # data outweighs framing


def _data_bytes(root: Path, component: str) -> int:
    return sum(p.stat().st_size for p in (root / "step_00000001" / component).glob("*.distcp"))


# -- replicated ---------------------------------------------------------------------------


def replicated_save(rank: int, world: int, root: Path, validate: bool, perturb: bool) -> None:
    model = _model(seed=0)  # identical on every rank, like DDP
    if perturb and rank == 1:
        with torch.no_grad():
            model[1].bias[3] += 1.0
    spec = {"storage": {"url": str(root)},
            "components": {"model": {"kind": "model", "sharing": "replicated",
                                     "validate": validate}}}
    mgr = statereg.CheckpointManager(spec, model=model)
    if not perturb:
        mgr.save(step=1)
        return
    with pytest.raises(statereg.CheckpointMismatchError) as info:
        mgr.save(step=1)
    assert "'1.bias'" in str(info.value) and "rank(s) [1]" in str(info.value)


def test_replicated_model_is_written_once(tmp_path: Path) -> None:
    single = tmp_path / "single"
    spec = {"storage": {"url": str(single)},
            "components": {"model": {"kind": "model", "sharing": "replicated"}}}
    model = _model(seed=0)
    statereg.CheckpointManager(spec, model=model).save(step=1)

    root = tmp_path / "ckpt"
    run_ranks(2, replicated_save, tmp_path, root, True, False)
    one_copy = sum(t.nbytes for t in model.state_dict().values())
    written = _data_bytes(root, "model")
    # Every tensor is written by exactly one rank: one copy plus a few KB of file framing.
    assert one_copy <= written < one_copy * 1.1, (one_copy, written)
    assert written <= _data_bytes(single, "model") + 4096

    loaded = _model(seed=7)
    statereg.CheckpointManager(spec | {"storage": {"url": str(root)}}, model=loaded).load()
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_replicas_that_differ_fail_the_save_naming_tensor_and_ranks(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    run_ranks(2, replicated_save, tmp_path, root, True, True)
    assert not (root / "step_00000001" / "manifest.json").exists()


# -- per_rank -----------------------------------------------------------------------------


def _per_rank_spec(root: Path, policy: str = "error") -> dict:
    return {"storage": {"url": str(root)},
            "components": {"rng": {"kind": "rng", "on_world_size_change": policy},
                           "cursor": {"kind": "dataloader", "on_world_size_change": policy}}}


def per_rank_save(rank: int, world: int, root: Path, out: Path) -> None:
    torch.manual_seed(1000 + rank)
    mgr = statereg.CheckpointManager(_per_rank_spec(root), cursor=Counter(10 * (rank + 1)))
    mgr.save(step=1)
    (out / f"expected-{rank}.json").write_text(json.dumps(torch.rand(4).tolist()))


def per_rank_load(rank: int, world: int, root: Path, out: Path) -> None:
    torch.manual_seed(0)  # scramble: the load must restore this rank's own stream
    cursor = Counter()
    statereg.CheckpointManager(_per_rank_spec(root), cursor=cursor).load()
    assert cursor.value == 10 * (rank + 1)
    assert torch.rand(4).tolist() == json.loads((out / f"expected-{rank}.json").read_text())


def test_per_rank_state_returns_to_its_own_rank(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    run_ranks(2, per_rank_save, tmp_path, root, tmp_path)
    files = {f.path for f in statereg.read_manifest(str(root / "step_00000001")).files}
    assert {"rng/rank_00000.json", "rng/rank_00001.json", "cursor/rank_00000.json",
            "cursor/rank_00001.json"} <= files
    run_ranks(2, per_rank_load, tmp_path, root, tmp_path)

    # World size 2 -> 1: an error by default, naming both sizes and what to do.
    with pytest.raises(statereg.CheckpointMismatchError) as info:
        statereg.CheckpointManager(_per_rank_spec(root), cursor=Counter()).load()
    assert "checkpoint=2, current=1" in str(info.value)
    assert "on_world_size_change" in str(info.value)

    # reset: the fresh state stays.
    cursor = Counter(5)
    statereg.CheckpointManager(_per_rank_spec(root, "reset"), cursor=cursor).load()
    assert cursor.value == 5

    # reshard: the cursor splits its global total; RNG streams derive from the checkpoint,
    # reproducibly.
    draws = []
    for _ in range(2):
        cursor = Counter()
        statereg.CheckpointManager(_per_rank_spec(root, "reshard"), cursor=cursor).load()
        assert cursor.value == 30
        draws.append(torch.rand(3))
    assert torch.equal(draws[0], draws[1])


# -- per_group and global -----------------------------------------------------------------


def _stage_model(stage: int) -> nn.Module:
    torch.manual_seed(stage)
    return nn.Linear(4 + stage, 4)  # each pipeline stage holds different parameters


def _group_spec(root: Path) -> dict:
    return {"storage": {"url": str(root)},
            "components": {
                "stage": {"kind": "model", "sharing": "per_group", "group": "pp"},
                "stats": {"kind": "custom", "sharing": "per_group", "group": "pp"},
                "scheduler": {"kind": "scheduler", "sharing": "global"},
            }}


def _pipeline_groups(rank: int) -> dict:
    first, second = dist.new_group([0, 1]), dist.new_group([2, 3])
    return {"pp": first if rank < 2 else second}


def _scheduler(lr_steps: int) -> torch.optim.lr_scheduler.StepLR:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    for _ in range(lr_steps):
        opt.step()
        sched.step()
    return sched


def per_group_save(rank: int, world: int, root: Path) -> None:
    stage = rank // 2
    mgr = statereg.CheckpointManager(
        _group_spec(root), groups=_pipeline_groups(rank), stage=_stage_model(stage),
        stats=Counter(100 + stage), scheduler=_scheduler(5 if rank == 0 else 1))
    mgr.save(step=1)


def per_group_load(rank: int, world: int, root: Path) -> None:
    stage = rank // 2
    model = _stage_model(stage)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    stats, sched = Counter(), _scheduler(0)
    mgr = statereg.CheckpointManager(_group_spec(root), groups=_pipeline_groups(rank),
                                     stage=model, stats=stats, scheduler=sched)
    mgr.load()
    expected = _stage_model(stage)
    for key, value in expected.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), (rank, key)
    assert stats.value == 100 + stage
    assert sched.state_dict() == _scheduler(5).state_dict()  # rank 0's copy, on every rank


def test_per_group_copies_map_back_to_their_group_and_global_is_rank_0s(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    run_ranks(4, per_group_save, tmp_path, root)
    files = {f.path for f in statereg.read_manifest(str(root / "step_00000001")).files}
    assert {"stats/group_00000/state.json", "stats/group_00002/state.json",
            "stage/group_00000/.metadata", "stage/group_00002/.metadata",
            "scheduler/state.json"} <= files
    assert not any(p.startswith("scheduler/") and p != "scheduler/state.json" for p in files)
    run_ranks(4, per_group_load, tmp_path, root)
