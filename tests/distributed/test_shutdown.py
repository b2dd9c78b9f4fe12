"""A distributed job that used statereg exits cleanly: close() ends the process groups
statereg made and their gloo threads, on every rank, without a collective.

The abort this guards against (issue 41, item 7): a gloo group's worker threads stop only
when the last reference to the group goes, not at `dist.destroy_process_group()`. statereg's
World kept its groups, so their threads ran into interpreter exit; a worker thread that then
dropped the last reference to a finished `*_object` collective (whose tensors Python owns)
took the GIL while the interpreter was finalizing, and the process died with "terminate
called without an active exception" (SIGABRT). docs/distributed.md, "Shutting down".
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from torch import nn

import statereg
from statereg.errors import StateregError

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(),
                                reason="counts native threads through /proc")


def _gloo_workers() -> int:
    """This process's gloo worker threads (two per live gloo process group)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{task}/comm").read_text().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return names.count("pt_gloo_runloop")


def _gloo_workers_after_close(expected: int) -> int:
    """_gloo_workers() once it is `expected`, or after a second. close() joins the threads,
    but the kernel lists a joined thread in /proc/self/task a moment longer (its exit has
    woken pthread_join before the task is released): a loaded machine's snapshot taken right
    after close() can still count it. A thread that close() left running stays counted."""
    deadline = time.monotonic() + 1.0
    while (count := _gloo_workers()) != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return count


def _spec(root: str) -> dict:
    return {"storage": {"url": root},
            "components": {"model": {"kind": "model", "sharing": "replicated"},
                           "rng": {"kind": "rng"}}}


def _close_ends_threads(rank: int, world_size: int, root: str) -> None:
    dist.barrier()  # the default group's threads are up
    before = _gloo_workers()
    torch.manual_seed(0)
    with statereg.CheckpointManager(_spec(root), model=nn.Linear(4, 4)) as mgr:
        assert _gloo_workers() > before  # statereg's own gloo group
        mgr.save(step=1)
        assert mgr.load() is not None
    assert _gloo_workers_after_close(before) == before, "statereg's gloo threads outlived close()"
    with pytest.raises(StateregError, match=r"closed.*construct a new CheckpointManager"):
        mgr.save(step=2)
    again = statereg.CheckpointManager(_spec(root), model=nn.Linear(4, 4))
    assert again.load().step == 1  # a new manager works after the old one's close
    again.close()
    again.close()  # closing twice is harmless
    assert _gloo_workers_after_close(before) == before


def test_close_ends_statereg_groups_and_their_threads(tmp_path: Path) -> None:
    run_ranks(2, _close_ends_threads, tmp_path, str(tmp_path / "ckpt"))


def _peer_left(rank: int, world_size: int, root: str) -> None:
    mgr = statereg.CheckpointManager(_spec(root), model=nn.Linear(4, 4))
    mgr.save(step=1)
    if rank == 0:
        mgr.close()  # alone, as a rank leaving on an error does: it waits for no one
    dist.barrier()  # on the default group, which stays: rank 0 has closed by now
    if rank == 1:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"[Cc]onnection closed by peer"):
            mgr.save(step=2)  # its first collective meets rank 0's closed group
        assert time.monotonic() - started < 20, "a save on a closed peer's group waited"
        mgr.close()


def test_a_rank_still_saving_after_a_peer_closed_fails_at_once(tmp_path: Path) -> None:
    run_ranks(2, _peer_left, tmp_path, str(tmp_path / "ckpt"))


# One rank of a job in the order docs/distributed.md gives: leave the manager's `with`
# block, then barrier and destroy. Its last collectives before that are statereg's object
# collectives (the save's and the load's), whose work a lagging gloo thread could hold.
_JOB = """
import os, sys
import torch
import torch.distributed as dist
from torch import nn
import statereg

rank = int(os.environ["RANK"])
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=rank, world_size=2)
torch.manual_seed(0)
spec = {"storage": {"url": sys.argv[2]},
        "components": {"model": {"kind": "model", "sharing": "replicated"},
                       "rng": {"kind": "rng"}}}
with statereg.CheckpointManager(spec, model=nn.Linear(16, 4)) as mgr:
    start = mgr.load()
    mgr.save(step=start.step + 1 if start else 1)
    mgr.load()
dist.barrier()
dist.destroy_process_group()
"""

RUNS = int(os.environ.get("STATEREG_SHUTDOWN_RUNS", "3"))


@pytest.mark.timeout(120 + 90 * RUNS)  # a run takes seconds, half a minute on a loaded machine
def test_a_two_rank_job_exits_cleanly_every_time(tmp_path: Path) -> None:
    """RUNS jobs of two real interpreters each (not forked: a forked child skips the
    interpreter's finalization, where the abort happened), each exiting with status 0.
    STATEREG_SHUTDOWN_RUNS=50 for the long run recorded in docs/distributed.md."""
    script = tmp_path / "job.py"
    script.write_text(_JOB)
    # The ranks import the statereg under test, wherever the test process found it.
    source = str(Path(statereg.__file__).resolve().parents[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")]))}
    failed: dict[int, list[str]] = {}
    for run in range(RUNS):
        init = tmp_path / f"init-{run}"
        ranks = [subprocess.Popen([sys.executable, str(script), str(init), str(tmp_path / "ckpt")],
                                  env={**env, "RANK": str(rank)}, stderr=subprocess.PIPE,
                                  text=True) for rank in range(2)]
        for rank, process in enumerate(ranks):
            _, err = process.communicate(timeout=300)
            if process.returncode != 0:
                failed.setdefault(run, []).append(
                    f"run {run} rank {rank}: status {process.returncode}: {err.strip()[-600:]}")
    assert not failed, f"{len(failed)} of {RUNS} runs did not exit cleanly:\n" + \
        "\n".join(line for lines in failed.values() for line in lines)
