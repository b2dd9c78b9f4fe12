"""check_replicas: ranks compare one digest per component, and name the tensor that differs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from statereg.engine.plan import ComponentPlan
from statereg.engine.save import CapturedComponent, check_replicas
from statereg.errors import CheckpointMismatchError


class TwoRanks:
    """A World stand-in: rank 0 holds `captured`; rank 1's copy answers every all_gather."""

    distributed = True
    size = 2
    rank = 0

    def __init__(self, other: list[CapturedComponent]) -> None:
        self.other = other
        self.gathers: list[Any] = []

    def all_gather(self, obj: Any) -> list[Any]:
        from statereg.engine import save

        # Rank 1 computes the same kind of object from its own copy.
        theirs = save._replica_digests(self.other)
        if len(self.gathers) == 0:
            theirs = {comp: save._combined(d) for comp, d in theirs.items()}
        self.gathers.append(obj)
        return [obj, theirs]


def replicated(tensors: dict[str, torch.Tensor], validate: bool = True) -> CapturedComponent:
    plan = ComponentPlan(name="model", kind="model", sharing="replicated", format="dcp",
                         writers=(0, 1), files=(), validate=validate)
    return CapturedComponent(plan, tensors=tensors)


def state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    # A 0-dim buffer too: BatchNorm's num_batches_tracked has no byte view of its own.
    return {"w": torch.randn(3, 2), "b": torch.randn(3), "count": torch.tensor(5)}


def test_equal_replicas_exchange_one_digest_per_component():
    world = TwoRanks([replicated(state())])
    check_replicas(world, [replicated(state())])  # type: ignore[arg-type]
    assert len(world.gathers) == 1
    assert set(world.gathers[0]) == {"model"}


@pytest.mark.parametrize("key", ["w", "count"])
def test_a_differing_replica_names_the_tensor_and_the_rank(key):
    theirs = state()
    theirs[key] = theirs[key] + 1
    world = TwoRanks([replicated(theirs)])
    with pytest.raises(CheckpointMismatchError, match=rf"tensor '{key}' differs between rank 0 "
                       r"and rank\(s\) \[1\]"):
        check_replicas(world, [replicated(state())])  # type: ignore[arg-type]
    assert len(world.gathers) == 2


def test_components_without_validate_are_not_compared():
    theirs = state()
    theirs["w"] += 1
    world = TwoRanks([replicated(theirs, validate=False)])
    check_replicas(world, [replicated(state(), validate=False)])  # type: ignore[arg-type]
    assert world.gathers == [{}]
