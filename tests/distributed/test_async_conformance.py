"""Asynchronous saves across the schema's matrix: for every kind x sharing x format the
schema accepts, 2 real gloo ranks save three steps with `async: thread` and
`early_return`, each queued behind the one before, changing every saved value in place
(and drawing from the global generator) as soon as `wait_staged()` returns, as the next
training step would. The last step loads bit for bit: each save holds the values of its
own `save()` call, none of the changes made after it. The matrix is the schema's
(matrix.py); test_tier_conformance.py runs the other async modes on one rank.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from harness import run_ranks
from matrix import (
    ACCEPTED,
    Case,
    assert_none_failed,
    bitwise_equal,
    change_in_place,
    pipeline_groups,
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
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            try:
                objects = case.objects(seed_for(1, case.sharing, rank, groups))
                with statereg.CheckpointManager(spec, groups=groups, **objects) as mgr:
                    for step in (1, 2, 3):
                        mgr.save(step=step).wait_staged()
                        change_in_place(objects)  # the last save may still be writing
                expected = case.objects(seed_for(1, case.sharing, rank, groups))
                change_in_place(expected)
                change_in_place(expected)
                saved = case.snapshot(expected)
                fresh = case.objects(seed_for(5000, case.sharing, rank, groups))
                with statereg.CheckpointManager(case.spec(), groups=groups, **fresh) as mgr:
                    result = mgr.load()
                if result is None or result.step != 3:
                    failures.append(f"{where}: loaded {result.path if result else 'nothing'}")
                elif not bitwise_equal(saved, case.snapshot(fresh)):
                    failures.append(f"{where}: step 3 is not bit-identical on rank {rank}")
            except Exception as exc:  # every combination is reported, not just the first
                failures.append(f"{where}: {type(exc).__name__}: {exc}")
    assert_none_failed(failures, world)


def test_every_accepted_combination_saves_asynchronously_what_save_was_given(
        tmp_path: Path) -> None:
    run_ranks(WORLD, async_pass, tmp_path, tmp_path / "matrix")
