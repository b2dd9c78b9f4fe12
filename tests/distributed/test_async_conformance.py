"""Asynchronous saves across the schema's matrix: for every kind x sharing x format the
schema accepts, 2 real gloo ranks save three steps with `async: thread` and
`early_return`, each queued behind the one before, changing every saved value in place
(and drawing from the global generator) as soon as `wait_staged()` returns, as the next
training step would. The last step loads bit for bit: each save holds the values of its
own `save()` call, none of the changes made after it. The matrix is the schema's
(matrix.py); test_tier_conformance.py runs the other async modes on one rank.
"""

from __future__ import annotations

from pathlib import Path

from harness import run_ranks
from matrix import (
    ACCEPTED,
    Case,
    assert_none_failed,
    change_in_place,
    load_fresh,
    pipeline_groups,
    reported,
    seed_for,
)

import statereg

WORLD = 2


def async_pass(rank: int, world: int, root: Path) -> None:
    groups = pipeline_groups(rank, world)
    failures: list[str] = []
    for combo in ACCEPTED:
        case = Case(combo, root, world)
        spec = case.spec()
        spec["save"] = {"async": "thread", "early_return": True, "keep_last": 1}
        where = "/".join(combo)
        with reported(failures, where):
            objects = case.objects(seed_for(1, case.sharing, rank, groups))
            with statereg.CheckpointManager(spec, groups=groups, **objects) as mgr:
                for step in (1, 2, 3):
                    mgr.save(step=step).wait_staged()
                    change_in_place(objects)  # the last save may still be writing
            # Step 3 holds seed 1's values changed twice, by the steps before it.
            result, exact = load_fresh(case, case.spec(), rank, groups, changes=2)
            if result is None or result.step != 3:
                failures.append(f"{where}: loaded {result.path if result else 'nothing'}")
            elif not exact:
                failures.append(f"{where}: step 3 is not bit-identical on rank {rank}")
    assert_none_failed(failures, world)


def test_every_accepted_combination_saves_asynchronously_what_save_was_given(
        tmp_path: Path) -> None:
    run_ranks(WORLD, async_pass, tmp_path, tmp_path / "matrix")
