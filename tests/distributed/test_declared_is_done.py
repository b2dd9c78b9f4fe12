"""The three ways a declaration and the engine disagreed (issue 12), on real gloo ranks:
per_group x torch kept only the first group's copy; global on an FSDP2-sharded model kept
rank 0's shards and loaded silently half-initialised; a sharing changed between save and
load failed with a raw FileNotFoundError or blamed the process groups."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from torch import nn
from torch.distributed.fsdp import fully_shard

import statereg


class Stage:
    def __init__(self, value: int) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


def _pp(rank: int) -> Any:
    groups = [dist.new_group([0, 1], backend="gloo"), dist.new_group([2, 3], backend="gloo")]
    return groups[rank // 2]


def per_group_torch(rank: int, world: int, root: Path) -> None:
    spec = {"storage": {"url": str(root)},
            "components": {"stage": {"kind": "custom", "sharing": "per_group", "group": "pp",
                                     "format": "torch"}}}
    group = _pp(rank)
    mine = 10 + rank // 2  # the state of this rank's pipeline stage
    with statereg.CheckpointManager(spec, groups={"pp": group}, stage=Stage(mine)) as mgr:
        mgr.save(step=1)
    files = {f.path for f in statereg.read_manifest(str(root / "step_00000001")).files}
    assert {"stage/group_00000/state.pt", "stage/group_00002/state.pt"} <= files, files
    fresh = Stage(-1)
    with statereg.CheckpointManager(spec, groups={"pp": group}, stage=fresh) as mgr:
        mgr.load()
    assert fresh.value == mine


def test_per_group_torch_writes_and_loads_every_group_copy(tmp_path: Path) -> None:
    run_ranks(4, per_group_torch, tmp_path, tmp_path / "ckpt")


def global_on_sharded(rank: int, world: int, root: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    fully_shard(model)
    spec = {"storage": {"url": str(root)},
            "components": {"model": {"kind": "model", "sharing": "global"}}}
    with pytest.raises(statereg.SpecError) as info:
        statereg.CheckpointManager(spec, model=model)
    message = str(info.value)
    assert "component 'model'" in message and "declare sharing: sharded" in message, message
    assert not root.exists()  # refused before anything was written


def test_global_on_an_fsdp2_sharded_model_is_refused_at_construction(tmp_path: Path) -> None:
    run_ranks(2, global_on_sharded, tmp_path, tmp_path / "ckpt")


def sharing_changed(rank: int, world: int, root: Path, saved: str, declared: str) -> None:
    def spec(sharing: str) -> dict[str, Any]:
        return {"storage": {"url": str(root)},
                "components": {"stage": {"kind": "custom", "sharing": sharing}}}

    # One copy must be the same on every rank (else the save is refused, test_one_copy.py).
    value = rank if saved == "per_rank" else 7
    with statereg.CheckpointManager(spec(saved), stage=Stage(value)) as mgr:
        mgr.save(step=1)
    fresh = Stage(-1)
    with statereg.CheckpointManager(spec(declared), stage=fresh) as mgr, \
            pytest.raises(statereg.CheckpointMismatchError) as info:
        mgr.load()
    message = str(info.value)
    assert f"saved as sharing {saved}" in message and f"declared sharing {declared}" in message
    assert "component 'stage'" in message and "on 2 rank(s)" in message, message
    assert fresh.value == -1  # nothing was modified


@pytest.mark.parametrize(("saved", "declared"), [("per_rank", "global"), ("global", "per_rank")])
def test_a_sharing_changed_since_the_save_is_a_mismatch_naming_both(
        tmp_path: Path, saved: str, declared: str) -> None:
    run_ranks(2, sharing_changed, tmp_path, tmp_path / "ckpt", saved, declared)
