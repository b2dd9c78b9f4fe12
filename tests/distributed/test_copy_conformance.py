"""`statereg cp` across the schema's matrix: every kind x sharing x format the schema accepts,
saved plain or zstd-compressed at world sizes 1 and 2, copied by rank 0 with each
recompression `cp` offers (keep, none, zstd, zstd without float planes), verifies file by
file and loads into fresh objects on every rank bit for bit. The matrix is the schema's
(matrix.py): a new kind, sharing or format is copied here without touching this file.
"""

from __future__ import annotations

from pathlib import Path

import pytest
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
from statereg.dcp.codec import CompressionSettings
from statereg.engine.transfer import Recompress, copy_checkpoint

RECOMPRESS: dict[str, Recompress] = {
    "keep": "keep", "none": None,
    "zstd": CompressionSettings(level=3, float_aware=True),
    "zstd-plain": CompressionSettings(level=3, float_aware=False)}


def _copy(url: str, target: str, recompress: Recompress) -> None:
    copy_checkpoint(open_backend(url), "step_00000001", open_backend(target), recompress)
    statereg.verify(f"{target}/step_00000001")


def copy_pass(rank: int, world: int, root: Path, compressed: bool) -> None:
    groups = pipeline_groups(rank, world)
    failures: list[str] = []
    for combo in ACCEPTED:
        case = Case(combo, root, world)
        spec = case.spec()
        if compressed:
            spec["storage"]["compression"] = {"codec": "zstd", "float_aware": True}
        where = f"{'/'.join(combo)} at world size {world}{', zstd' if compressed else ''}"
        with reported(failures, where):
            objects = case.objects(seed_for(1, case.sharing, rank, groups))
            with statereg.CheckpointManager(spec, groups=groups, **objects) as mgr:
                mgr.save(step=1)
            for mode, recompress in RECOMPRESS.items():
                target = f"{case.url}-cp-{mode}"
                error = on_rank_zero(rank, _copy, case.url, target, recompress)
                if error is not None:
                    failures.append(f"{where}, cp {mode}: {error}")
                    continue
                if not load_fresh(case, case.spec(target), rank, groups)[1]:
                    failures.append(f"{where}, cp {mode}: not bit-identical on rank {rank}")
    assert_none_failed(failures, world)


@pytest.mark.parametrize(("world", "compressed"), [(1, False), (2, True)])
def test_every_accepted_combination_copies_with_each_recompression(
        tmp_path: Path, world: int, compressed: bool) -> None:
    run_ranks(world, copy_pass, tmp_path, tmp_path / "matrix", compressed)
