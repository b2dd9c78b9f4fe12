"""Deferred attach over the schema's matrix: every kind x sharing x format it accepts, loaded
by a manager that has no object for the component yet and given the object afterwards with
`attach()`, comes back bit for bit, at world sizes 1 and 2 on real gloo groups.

A trainer builds its optimizer after it resumes (Hugging Face's Trainer, Accelerate), so one
`load()` must cover components whose objects arrive later, tensor ones included: those are
checked by load() and read from the same checkpoint when attach() gives their object.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from harness import run_ranks
from matrix import (
    ACCEPTED,
    Case,
    assert_none_failed,
    bitwise_equal,
    pipeline_groups,
    reported,
    seed_for,
)

import statereg

# rng takes no object: it is always attached.
COMBOS = [c for c in ACCEPTED if c[0] != "rng"]


def late_spec(case: Case) -> dict[str, Any]:
    """The case's declaration with every component optional, so it can be attached late."""
    spec = case.spec()
    for component in spec["components"].values():
        component["required"] = False
    return spec


def attach_pass(rank: int, world: int, root: Path) -> None:
    groups = pipeline_groups(rank, world)
    failures: list[str] = []
    for combo in COMBOS:
        case = Case(combo, root, world)
        where = f"{'/'.join(combo)} at world size {world}"
        with reported(failures, where):
            saved = case.objects(seed_for(1, case.sharing, rank, groups))
            with statereg.CheckpointManager(case.spec(), groups=groups, **saved) as mgr:
                mgr.save(step=1)
            fresh = case.objects(seed_for(5000, case.sharing, rank, groups))
            with statereg.CheckpointManager(late_spec(case), groups=groups) as mgr:
                result = mgr.load()
                assert result is not None and result.step == 1
                waiting = set(mgr.awaiting_attach)
                if waiting != set(fresh):
                    failures.append(f"{where}: awaiting_attach {sorted(waiting)}, expected "
                                    f"{sorted(fresh)}")
                assert not any(mgr.attached(n) for n in fresh)
                mgr.attach(**fresh)
                assert all(mgr.attached(n) for n in fresh) and not mgr.awaiting_attach
            if not bitwise_equal(case.snapshot(saved), case.snapshot(fresh)):
                failures.append(f"{where}: attached after load() is not bit-identical on "
                                f"rank {rank}")
    assert_none_failed(failures, world)


@pytest.mark.parametrize("world", [1, 2])
def test_every_accepted_combination_attached_after_load_is_bit_identical(
        tmp_path: Path, world: int) -> None:
    run_ranks(world, attach_pass, tmp_path, tmp_path / "matrix")
