"""StateregSavePlanner: the same plan and `.metadata` as DCP's DefaultSavePlanner, built faster."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

import statereg
from statereg.dcp.planner import StateregSavePlanner


def flat_tensors() -> dict[str, Any]:
    """Shapes repeated and not, several dtypes, a scalar, an empty tensor, a live Parameter."""
    return {
        "a.weight": torch.randn(4, 3),
        "b.weight": torch.randn(4, 3),
        "a.bias": torch.randn(4),
        "steps": torch.tensor(7),
        "half": torch.randn(4, 3, dtype=torch.float16),
        "ids": torch.arange(5),
        "empty": torch.zeros(0, 2),
        "param": nn.Parameter(torch.randn(4, 3)),
    }


def plan_with(planner: SavePlanner, state: dict[str, Any], ranks: int = 1,
              ) -> tuple[list[SavePlan], Any]:
    """DCP's planning sequence, with `ranks` ranks holding the same state (replicas)."""
    local: list[SavePlan] = []
    for rank in range(ranks):
        planner.set_up_planner(state, None, rank == 0)
        local.append(planner.create_local_plan())
    plans, metadata = planner.create_global_plan(local)
    final = [planner.finish_plan(plan) for plan in plans]
    return final, metadata


def described(plans: list[SavePlan]) -> list[list[tuple]]:
    # MetadataIndex compares without its index hint; the hint is part of the plan too.
    return [[(item, item.index.index) for item in plan.items] for plan in plans]


@pytest.mark.parametrize("state", [
    pytest.param(flat_tensors(), id="flat tensors"),
    pytest.param({}, id="empty"),
    pytest.param({"w": torch.randn(3), "nested": {"x": torch.randn(2), "n": 1}}, id="nested"),
    pytest.param({"w": torch.randn(3), "note": "text", "n": 3}, id="objects"),
])
@pytest.mark.parametrize("ranks", [1, 2])
def test_plan_and_metadata_equal_the_default_planners(state, ranks):
    expected_plans, expected = plan_with(DefaultSavePlanner(), state, ranks)
    plans, metadata = plan_with(StateregSavePlanner(), state, ranks)
    assert described(plans) == described(expected_plans)
    assert metadata == expected
    assert pickle.loads(pickle.dumps(metadata)) == expected


def test_equal_shapes_share_their_storage_metadata_and_pickle_smaller():
    state = {f"p{i}": torch.randn(8) for i in range(200)}
    _, expected = plan_with(DefaultSavePlanner(), state)
    _, metadata = plan_with(StateregSavePlanner(), state)
    stored = metadata.state_dict_metadata
    assert stored["p0"] is stored["p199"]
    assert len(pickle.dumps(metadata)) < len(pickle.dumps(expected)) / 2


def test_resolve_data_returns_the_live_tensor():
    state = flat_tensors()
    planner = StateregSavePlanner()
    plans, _ = plan_with(planner, state)
    for item in plans[0].items:
        assert planner.resolve_data(item) is state[item.index.fqn]


def test_a_saved_model_reads_back_with_plain_dcp(make_spec, tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.LayerNorm(4))
    mgr = statereg.CheckpointManager(make_spec("model"), model=model)
    mgr.save(step=1)
    directory = tmp_path / "ckpt" / "step_00000001" / "model"
    metadata = FileSystemReader(str(directory)).read_metadata()
    assert metadata.planner_data == {k: (k,) for k in model.state_dict()}
    restored = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load(restored, storage_reader=FileSystemReader(str(directory)), no_dist=True)
    for key, value in model.state_dict().items():
        assert torch.equal(restored[key], value), key
