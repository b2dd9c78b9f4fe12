"""Conformance: every kind x sharing x format the schema accepts works exactly, at world sizes
1, 2 and 4 on real gloo groups; every combination it refuses is a SpecError at load_spec.

For each accepted combination and world size: save; the manifest's files are exactly the
ones the ranks' plans predicted; a load into fresh objects is bit-identical (each rank gets
its own copy back for per_rank, its group's for per_group); a load at another world size is
exact for one-copy patterns (global, replicated, sharded) and a StateregError otherwise.
The combinations are generated from the schema, so a new kind, sharing or format is tested
(or refused) without touching this file.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from harness import run_ranks
from matrix import (
    ACCEPTED,
    ONE_COPY,
    REFUSED,
    Case,
    assert_none_failed,
    declaration,
    load_fresh,
    pipeline_groups,
    reported,
    seed_for,
)

import statereg
from statereg.engine.plan import unpredicted

WORLD_SIZES = (1, 2, 4)


def test_every_combination_the_schema_refuses_is_a_spec_error_at_load_spec(
        report_figure: Callable[[str], None]) -> None:
    report_figure(f"schema matrix: {len(ACCEPTED)} accepted, {len(REFUSED)} refused "
                  f"kind x sharing x format combinations")
    assert ACCEPTED and REFUSED
    for kind, sharing, fmt in REFUSED:
        with pytest.raises(statereg.SpecError, match=r"components\.c") as info:
            statereg.load_spec({"storage": {"url": "./c"},
                                "components": {"c": declaration(kind, sharing, fmt)}})
        assert len(str(info.value)) > 40, (kind, sharing, fmt, str(info.value))


def conformance_pass(rank: int, world: int, root: Path, save: bool, load_from: list[int],
                     ) -> None:
    groups = pipeline_groups(rank, world)
    failures: list[str] = []
    for combo in ACCEPTED:
        case = Case(combo, root, world)
        where = f"{'/'.join(combo)} at world size {world}"
        with reported(failures, where):
            if save:
                objects = case.objects(seed_for(1, case.sharing, rank, groups))
                with statereg.CheckpointManager(case.spec(), groups=groups,
                                                **objects) as mgr:
                    mgr.save(step=1)
                    plans = mgr.world.all_gather(mgr.plan)
                manifest = statereg.read_manifest(f"{case.url}/step_00000001")
                extra, missing = unpredicted([f.path for f in manifest.files], plans)
                if extra or missing:
                    failures.append(f"{where}: files not predicted {extra}, predicted "
                                    f"but missing {missing}")
                _, exact = load_fresh(case, case.spec(), rank, groups)
                if not exact:
                    failures.append(f"{where}: load is not bit-identical on rank {rank}")
            for other in load_from:
                url = str(root / "-".join(combo) / f"ws{other}")
                try:
                    _, exact = load_fresh(case, case.spec(url), rank, groups)
                except statereg.StateregError as exc:
                    if combo[1] in ONE_COPY:
                        failures.append(f"{where} from {other}: refused ({exc})")
                    elif not str(exc).strip():
                        failures.append(f"{where} from {other}: an error without a reason")
                else:
                    if combo[1] not in ONE_COPY:
                        failures.append(f"{where} from {other}: loaded per-copy state "
                                        "saved at another world size")
                    elif not exact:
                        failures.append(f"{where} from {other}: not bit-identical")
    assert_none_failed(failures, world)


def test_every_accepted_combination_round_trips_at_world_sizes_1_2_4(
        tmp_path: Path, report_figure: Callable[[str], None]) -> None:
    report_figure(f"conformance matrix: {len(ACCEPTED)} combinations x {len(WORLD_SIZES)} "
                  f"world sizes = {len(ACCEPTED) * len(WORLD_SIZES)} save/load cases, plus "
                  f"{len(ACCEPTED) * 6} loads across world sizes")
    root = tmp_path / "matrix"
    # Each size saves and loads its own; then loads across sizes, both ways.
    run_ranks(1, conformance_pass, tmp_path, root, True, [])
    run_ranks(2, conformance_pass, tmp_path, root, True, [1])
    run_ranks(4, conformance_pass, tmp_path, root, True, [1, 2])
    run_ranks(1, conformance_pass, tmp_path, root, False, [2, 4])
    run_ranks(2, conformance_pass, tmp_path, root, False, [4])
