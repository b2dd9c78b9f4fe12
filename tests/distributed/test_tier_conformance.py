"""Conformance with memory tiers: every kind x sharing x format the schema accepts, saved into
the memory tier and drained to storage.url, comes back bit for bit from each tier.

On real gloo groups, each node with its own shared-memory folder ($STATEREG_NODE): one node
of one rank; two nodes of two ranks with `replicate: {to: next_node}`; and two nodes of two
ranks without it, where ranks read the files their node lacks from the other node. For each
accepted combination:

1. save step 1 (memory and durable both due: the memory checkpoint is drained), then change
   every saved value in place, as the next training step would;
2. a new manager restores it from memory, bit-identical;
3. with a replica, node 0's memory folder is deleted: the restore comes from node 1's
   replica, bit-identical, still from memory;
4. every node's memory folder is deleted: the restore comes from storage.url (the drained
   copy), bit-identical;
5. a manager without tiers loads the drained checkpoint, bit-identical: a drained checkpoint
   is a plain statereg checkpoint.

The same again on one rank with asynchronous saves (`thread`; `pinned` with `early_return`)
and with zstd compression. The matrix is the schema's (matrix.py), as in
test_conformance.py: a new kind, sharing or format is tested with tiers too, without
touching this file.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from harness import run_ranks
from matrix import (
    ACCEPTED,
    Case,
    assert_none_failed,
    change_in_place,
    load_fresh,
    pipeline_groups,
    seed_for,
)

import statereg

# This user's folder of memory roots under the shared-memory folder (backends/shm.py).
PRIVATE = f"statereg-{os.geteuid()}"

# (world size, ranks per node, replicate)
TOPOLOGIES = [(1, 1, False), (4, 2, True), (4, 2, False)]


def _tiered(case: Case, name: str, replicate: bool, settings: dict[str, Any],
            ) -> dict[str, Any]:
    spec = case.spec()
    spec["storage"].update(settings.get("storage", {}))
    spec["save"] = settings.get("save", {})
    memory: dict[str, Any] = {"url": f"shm://{name}", "every": 1, "keep_last": 2}
    if replicate:
        memory["replicate"] = {"to": "next_node"}
    spec["tiers"] = {"memory": memory, "durable": {"every": 1}}
    return spec


def _forget(rank: int, shm: Path, name: str, nodes: list[int]) -> None:
    """These nodes' memory of checkpoint root `name` is gone, seen by every rank at once."""
    dist.barrier()
    if rank == 0:
        for node in nodes:
            shutil.rmtree(shm / PRIVATE / f"node{node}" / name)
    dist.barrier()


def tier_pass(rank: int, world: int, root: Path, shm: Path, per_node: int,
              replicate: bool, settings: dict[str, Any]) -> None:
    nodes = world // per_node
    os.environ.update(STATEREG_SHM_DIR=str(shm), STATEREG_NODE=f"node{rank // per_node}",
                      STATEREG_RUN_ID=f"tiers-ws{world}", STATEREG_PEER_HOST="127.0.0.1")
    groups = pipeline_groups(rank, world)
    failures: list[str] = []
    for combo in ACCEPTED:
        case = Case(combo, root, world)
        name = "-".join(combo)
        spec = _tiered(case, name, replicate, settings)
        where = (f"{'/'.join(combo)} at world size {world} ({nodes} node(s)"
                 f"{', replicated' if replicate else ''})")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            tier = "save"
            try:
                objects = case.objects(seed_for(1, case.sharing, rank, groups))
                with statereg.CheckpointManager(spec, groups=groups, **objects) as mgr:
                    mgr.save(step=1).wait_staged()
                    change_in_place(objects)  # close() waits for the save and the drain
                steps: list[tuple[str, dict[str, Any], str, list[int]]] = [
                    ("memory", spec, "shm://", [])]
                if replicate:
                    steps.append(("node 1's replica", spec, "shm://", [0]))
                steps.append(("storage.url", spec, case.url, list(range(nodes))))
                steps.append(("storage.url without tiers", case.spec(), case.url, []))
                for tier, declared, prefix, lost in steps:
                    if lost:
                        _forget(rank, shm, name, lost)
                    result, exact = load_fresh(case, declared, rank, groups)
                    if result is None or result.step != 1 or \
                            not result.path.startswith(prefix):
                        failures.append(f"{where}: the restore from {tier} came from "
                                        f"{result.path if result else 'nowhere'}")
                    elif not exact:
                        failures.append(f"{where}: the restore from {tier} is not "
                                        f"bit-identical on rank {rank}")
            except Exception as exc:  # every combination is reported, not just the first
                failures.append(f"{where}, {tier}: {type(exc).__name__}: {exc}")
    assert_none_failed(failures, world)


@pytest.mark.parametrize(("world", "per_node", "replicate"), TOPOLOGIES)
def test_every_accepted_combination_round_trips_through_each_tier(
        tmp_path: Path, world: int, per_node: int, replicate: bool) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    run_ranks(world, tier_pass, tmp_path, tmp_path / "matrix", shm, per_node, replicate, {})


SETTINGS = {
    "async thread": {"save": {"async": "thread"}},
    "async pinned, early_return": {"save": {"async": "pinned", "early_return": True}},
    "zstd, float_aware": {"storage": {"compression": {"codec": "zstd", "float_aware": True}}},
}


@pytest.mark.parametrize("settings", SETTINGS)
def test_every_accepted_combination_round_trips_with_async_and_compressed_saves(
        tmp_path: Path, settings: str) -> None:
    # One rank: the engine's async and compression paths do not depend on the world size,
    # and several nodes save asynchronously in test_tier_replica.py.
    shm = tmp_path / "shm"
    shm.mkdir()
    run_ranks(1, tier_pass, tmp_path, tmp_path / "matrix", shm, 1, False, SETTINGS[settings])
