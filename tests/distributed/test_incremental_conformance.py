"""Incremental saves across the schema's matrix: for every kind x sharing x format the schema
accepts, 2 real gloo ranks save four steps with `incremental: true` and `keep_last: 2`:
steps 2 and 3 unchanged from step 1, so they reference step 1's files (DCP components
reference every item), step 4 changed. Retention deletes steps 1 and 2 while step 3 still
reads step 1's files. Steps 3 and 4 load bit for bit, and `statereg cp` of step 3 is
self-contained, verifies and loads bit for bit. The matrix is the schema's (matrix.py).
"""

from __future__ import annotations

from pathlib import Path

from harness import run_ranks
from matrix import (
    ACCEPTED,
    Case,
    assert_none_failed,
    load_fresh,
    on_rank_zero,
    pipeline_groups,
    reported,
    seed_for,
)

import statereg
from statereg.backends.registry import open_backend
from statereg.engine.transfer import copy_checkpoint

WORLD = 2
STEPS = ((1, 1), (2, 1), (3, 1), (4, 2))  # (step, seed of the values it saves)


def _copy(url: str, target: str) -> None:
    copy_checkpoint(open_backend(url), "step_00000003", open_backend(target))
    if statereg.read_manifest(f"{target}/step_00000003").references:
        raise AssertionError("the copy references files outside itself")
    statereg.verify(f"{target}/step_00000003")


def incremental_pass(rank: int, world: int, root: Path) -> None:
    groups = pipeline_groups(rank, world)
    failures: list[str] = []
    for combo in ACCEPTED:
        case = Case(combo, root, world)
        spec = case.spec()
        spec["save"] = {"incremental": True, "keep_last": 2}
        where = "/".join(combo)
        with reported(failures, where):
            for step, seed in STEPS:
                objects = case.objects(seed_for(seed, case.sharing, rank, groups))
                with statereg.CheckpointManager(spec, groups=groups, **objects) as mgr:
                    mgr.save(step=step)
            references = statereg.read_manifest(f"{case.url}/step_00000003").references
            if case.fmt == "dcp" and not any(r.path.startswith("step_00000001/")
                                             for r in references):
                failures.append(f"{where}: step 3 references none of step 1's files")
            for step, seed in STEPS[2:]:
                if not load_fresh(case, spec, rank, groups, seed, step=step)[1]:
                    failures.append(f"{where}: step {step} is not bit-identical")
            error = on_rank_zero(rank, _copy, case.url, f"{case.url}-cp")
            if error is not None:
                failures.append(f"{where}, cp: {error}")
            elif not load_fresh(case, case.spec(f"{case.url}-cp"), rank, groups)[1]:
                failures.append(f"{where}: the copy of step 3 is not bit-identical")
    assert_none_failed(failures, world)


def test_every_accepted_combination_saves_incrementally_through_retention_and_cp(
        tmp_path: Path) -> None:
    run_ranks(WORLD, incremental_pass, tmp_path, tmp_path / "matrix")
