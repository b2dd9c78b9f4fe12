"""Run a function on N real processes joined in a gloo process group (CPU).

Storage for a multi-rank test comes from tests/conftest.py's `store` fixture, parametrized
indirectly with the backends the test runs over; pass `store.url` and `store.options` on to
the ranks through run_ranks' arguments.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from child_processes import forkserver_context

# A `store` parameter for multi-rank tests: ranks are separate processes, and memory:// lives
# in one process, so they cannot share a checkpoint there.
MEMORY_IS_PROCESS_LOCAL = pytest.param("memory", marks=pytest.mark.skip(
    reason="memory:// is process-local: each rank's process has its own memory filesystem, so "
    "ranks cannot share a checkpoint there (docs/distributed.md)"))


def _entry(rank: int, fn: Callable[..., None], world_size: int, init_file: str,
           args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=60))
    fn(rank, world_size, *args)
    # Leave together: a rank that exits first closes its gloo connections under a peer that
    # is still running, which can abort the peer ("terminate called without an active
    # exception"). A failed rank raises above and the spawner stops the others.
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(world_size: int, fn: Callable[..., None], tmp: Path, *args: Any) -> None:
    """Run fn(rank, world_size, *args) on every rank; a rank's exception fails the call.

    fn must be a module-level function (it is pickled by reference into the children).
    """
    init_file = tmp / f"pg-init-{os.getpid()}-{world_size}-{len(list(tmp.iterdir()))}"
    # Ranks fork from one server process that imported torch and statereg once, rather than
    # each importing them afresh (seconds of CPU per rank, on the two cores CI has).
    forkserver_context()
    mp.start_processes(_entry, args=(fn, world_size, str(init_file), args), nprocs=world_size,
                       join=True, start_method="forkserver")
