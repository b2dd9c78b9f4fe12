"""Named groups of another backend than gloo (NCCL in training) still carry statereg's CPU
traffic: statereg makes a gloo twin of each such group and uses that.

NCCL needs a GPU per rank, so the stand-in here is a group made with backend "cpu:gloo": any
backend that is not plain gloo takes the same path.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from harness import run_ranks
from torch import nn

import statereg
from statereg.engine.world import World

LAYOUT = [[0, 1], [2, 3]]


def _stage(stage: int) -> nn.Module:
    torch.manual_seed(10 + stage)
    return nn.Linear(16, 8)


def _spec(root: Path) -> dict:
    return {"storage": {"url": str(root)},
            "components": {"stage": {"kind": "model", "sharing": "per_group", "group": "pp"},
                           "bias": {"kind": "custom", "sharing": "per_group", "group": "pp",
                                    "format": "torch"}}}


class Bias:
    """A small per-group object saved with torch.save: read by one rank, broadcast."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def save_and_load_over_twins(rank: int, world_size: int, root: Path) -> None:
    groups = [dist.new_group(ranks, backend="cpu:gloo") for ranks in LAYOUT]
    stage = rank // 2
    mine = groups[stage]
    world = World.detect({"pp": mine})
    twin = world.groups["pp"]
    assert twin is not mine and dist.get_backend(twin) == "gloo"
    assert dist.get_process_group_ranks(twin) == LAYOUT[stage]

    mgr = statereg.CheckpointManager(_spec(root), groups={"pp": mine}, stage=_stage(stage),
                                     bias=Bias(torch.full((3,), float(stage))))
    mgr.save(step=1)
    mgr.close()
    loaded, bias = nn.Linear(16, 8), Bias(torch.zeros(3))
    statereg.CheckpointManager(_spec(root), groups={"pp": mine}, stage=loaded,
                               bias=bias).load()
    for key, value in _stage(stage).state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), (rank, key)
    assert torch.equal(bias.value, torch.full((3,), float(stage)))


def test_a_group_of_another_backend_gets_a_gloo_twin_and_saves_and_loads(
        tmp_path: Path) -> None:
    run_ranks(4, save_and_load_over_twins, tmp_path, tmp_path / "ckpt")
    files = {f.path for f in statereg.read_manifest(str(tmp_path / "ckpt" / "step_00000001")).files}
    assert {"stage/group_00000/.metadata", "stage/group_00002/.metadata"} <= files
    assert {"bias/group_00000/state.pt", "bias/group_00002/state.pt"} <= files, sorted(files)
