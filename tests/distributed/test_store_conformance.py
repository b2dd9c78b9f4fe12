"""Conformance on every remote store: every kind x sharing x format the schema accepts, saved
into S3 (moto and SeaweedFS), GCS (the emulator) and Azure (Azurite), is exactly the files
the plan predicted and loads into fresh objects bit for bit. test_conformance.py runs the
same matrix on local disk at world sizes 1, 2 and 4; each format's files reach each store
through the same writers whatever the world size, and several ranks writing one checkpoint
on an object store are drilled in test_sharded.py and test_read_once.py. One rank here (2
ranks took 55-62 s against 36 s, in a suite that must stay near 15 minutes). The matrix is
the schema's (matrix.py): a new kind, sharing, format or store is tested here without
touching this file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness import run_ranks
from matrix import (
    ACCEPTED,
    Case,
    assert_none_failed,
    load_fresh,
    pipeline_groups,
    reported,
    seed_for,
)

import statereg
from statereg.engine.plan import unpredicted

WORLD = 1


def store_pass(rank: int, world: int, url: str, options: dict[str, Any]) -> None:
    groups = pipeline_groups(rank, world)
    failures: list[str] = []
    for combo in ACCEPTED:
        case = Case(combo, url, world, options)
        where = f"{'/'.join(combo)} on {url.split(':')[0]}"
        with reported(failures, where):
            objects = case.objects(seed_for(1, case.sharing, rank, groups))
            with statereg.CheckpointManager(case.spec(), groups=groups, **objects) as mgr:
                mgr.save(step=1)
                plans = mgr.world.all_gather(mgr.plan)
            manifest = statereg.read_manifest(f"{case.url}/step_00000001", options)
            # Paths below the writer directory where the store needs one (GCS emulator).
            extra, missing = unpredicted([f.path for f in manifest.without_writer().files],
                                         plans)
            if extra or missing:
                failures.append(f"{where}: files not predicted {extra}, predicted but "
                                f"missing {missing}")
            if not load_fresh(case, case.spec(), rank, groups)[1]:
                failures.append(f"{where}: load is not bit-identical on rank {rank}")
    assert_none_failed(failures, world)


def test_every_accepted_combination_round_trips_on_each_remote_store(
        every_remote_store: Any, tmp_path: Path) -> None:
    run_ranks(WORLD, store_pass, tmp_path, every_remote_store.url, every_remote_store.options)
