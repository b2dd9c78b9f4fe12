"""Signals (docs/tiers.md#signals): on a declared signal the trainer finishes the save in
flight, flushes the newest memory checkpoint to storage.url within on_signal.grace_s, and
exits with status 128 + signum, even though the signal also killed its DataLoader workers.

The trainer, `train(MODE, ROOT)`, forks from the reliability forkserver (torch already
imported, so a run starts in a fraction of a second) into a session of its own, and trains a
tiny model with AdamW on batches from a DataLoader with two worker processes, saving every
step (memory every 2, drained every 8) under ROOT, its stderr in ROOT/stderr, until a signal
ends it. MODE:
- drill: writes ROOT/started once the first memory checkpoint is committed;
- mid_save: holds the memory save of step 6 after its second file (writes ROOT/reached);
- no_tiers: no tiers, `save.async: thread`; holds step 3's background write (ROOT/reached)
  and stops saving;
- slow_drain: grace_s 1; holds the drain of step 8 for a minute (ROOT/reached).
`train_rank(MODE, ROOT, RANK)`, forked the same way, is one of two ranks of a gloo job (no
DataLoader workers, stderr in ROOT/stderr-RANK); rank 0 writes ROOT/started once the first
memory checkpoint is committed. MODE "straggler": after each save the ranks meet in an
all_reduce (as DDP's gradient buckets do), and after step 3's save rank 1 writes
ROOT/straggling and sleeps for STRAGGLE_S before it: rank 0 waits in that collective.
"""

from __future__ import annotations

import logging
import os
import random
import re
import select
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import tier_trainee
import torch
import torch.distributed as dist
from reliability_kit import forkserver

import statereg
from statereg.backends.local import LocalBackend
from statereg.backends.registry import open_backend
from statereg.backends.shm import SharedMemoryBackend
from statereg.engine.checkpoints import list_committed, scan_root
from statereg.engine.verify import verify_files
from statereg.errors import SpecError

# This user's folder of memory roots under the shared-memory folder (backends/shm.py).
PRIVATE = f"statereg-{os.geteuid()}"

GRACE_S = 10.0
# A trainer waits for its signal in a session of its own, so it outlives a test run that is
# interrupted before sending it: it gives up after this long rather than train forever.
ORPHAN_S = 180.0
RUNS = 20
STRAGGLE_S = 40.0
SEED = int(os.environ.get("STATEREG_SIGNAL_DRILL_SEED", "1616"))
pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


def spec(root: Path, mode: str = "drill") -> dict[str, Any]:
    declared: dict[str, Any] = {
        "storage": {"url": str(root / "durable")},
        "components": {"model": {"kind": "model"}, "optimizer": {"kind": "optimizer"}},
        "tiers": {"memory": {"every": 2, "keep_last": 2},
                  "durable": {"every": 8, "keep_last": 2}},
        "on_signal": {"signals": ["SIGTERM", "SIGUSR1"],
                      "grace_s": {"slow_drain": 1.0, "straggler": 5.0}.get(mode, GRACE_S)},
    }
    if mode in ("rank", "straggler"):  # per-rank files: on two nodes, rank 1's are elsewhere
        declared["components"]["rng"] = {"kind": "rng"}
    if mode == "no_tiers":
        del declared["tiers"]
        declared["save"] = {"async": "thread"}
        declared["on_signal"] = ["SIGTERM"]
    return declared


def batches(workers: int) -> Iterator[torch.Tensor]:
    """The same batches in every process, epoch after epoch, from `workers` processes."""
    data = torch.utils.data.TensorDataset(torch.randn(512, 8, generator=torch.Generator()
                                                      .manual_seed(7)))
    # fork: the workers are this trainer's children, in its session (a trainer forked from the
    # forkserver would otherwise have the forkserver start them).
    loader = torch.utils.data.DataLoader(data, batch_size=4, num_workers=workers,
                                         multiprocessing_context="fork" if workers else None)
    while True:
        for (batch,) in loader:
            yield batch


class Trainee(tier_trainee.Trainee):
    def __init__(self) -> None:
        torch.set_num_threads(1)
        super().__init__()


def announce(path: Path, text: str) -> None:
    """Write `path` whole or not at all: the test never reads it half-written."""
    written = path.with_suffix(".tmp")
    written.write_text(text)
    written.rename(path)


def hold(root: Path, mode: str) -> None:
    """Make the save of `mode` stop for a while, after writing ROOT/reached."""
    victim, tier, seconds = {"mid_save": ("step_00000006/", "memory", 1.5),
                             "no_tiers": ("step_00000003/", "durable", 1.5),
                             "slow_drain": ("step_00000008/", "durable", 60.0)}[mode]
    opened: list[str] = []
    open_write = LocalBackend.open_write

    def held_open_write(self: Any, path: str, on_done: Any = None) -> Any:
        if path.startswith(victim) and isinstance(self, SharedMemoryBackend) == (
                tier == "memory"):
            opened.append(path)
            if len(opened) == 2:
                announce(root / "reached", threading.current_thread().name)
                time.sleep(seconds)
        return open_write(self, path, on_done)

    LocalBackend.open_write = held_open_write  # type: ignore[method-assign]


def train(mode: str, root: Path) -> None:
    if mode != "drill":
        hold(root, mode)
    trainee = Trainee()
    mgr = statereg.CheckpointManager(spec(root, mode), model=trainee.model,
                                     optimizer=trainee.optimizer)
    deadline = time.monotonic() + ORPHAN_S
    for step, batch in enumerate(batches(workers=2), start=1):
        if time.monotonic() > deadline:
            os._exit(97)  # never signalled: the test that started it is gone
        trainee.train_on(batch)
        mgr.save(step)
        if mode == "drill" and step == 2:
            announce(root / "started", "step 2")
        if mode == "no_tiers" and step == 3:
            while time.monotonic() < deadline:  # the signal comes while the async save
                time.sleep(0.05)                 # is held, outside save()
            os._exit(97)


def child(mode: str, root: Path, env: dict[str, str], rank: int | None = None) -> None:
    """A trainer (or one rank) in a forked child: a session of its own (killpg reaches it
    and its DataLoader workers, as a scheduler's signal does), the run's environment, stderr
    to a file."""
    os.setsid()
    os.environ.update(env)
    name = "stderr" if rank is None else f"stderr-{rank}"
    os.dup2(os.open(root / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
    # statereg's logger has a NullHandler: a program shows its warnings by configuring logging,
    # as a training script does (docs/tiers.md#signals).
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    if rank is None:
        train(mode, root)
    else:
        train_rank(mode, root, rank)


def train_rank(mode: str, root: Path, rank: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{root / 'pg-init'}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=120))
    trainee = Trainee()
    mgr = statereg.CheckpointManager(spec(root, mode), model=trainee.model,
                                     optimizer=trainee.optimizer)
    for step, batch in enumerate(batches(workers=0), start=1):
        trainee.train_on(batch)
        mgr.save(step)
        if step == 2 and rank == 0:
            announce(root / "started", "step 2")
        if mode == "straggler":
            if step == 3 and rank == 1:
                announce(root / "straggling", "step 3")
                time.sleep(STRAGGLE_S)
            dist.all_reduce(torch.ones(1))


def trained(steps: int) -> dict[str, torch.Tensor]:
    """The reference: `steps` steps in this process, batches from a loader without workers."""
    trainee = Trainee()
    for step, batch in enumerate(batches(workers=0), start=1):
        if step > steps:
            break
        trainee.train_on(batch)
    return trainee.tensors()


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """A private folder on the real tmpfs (/dev/shm) where there is one, else on disk."""
    if os.access("/dev/shm", os.W_OK):
        shm = Path(tempfile.mkdtemp(prefix="statereg-signals-", dir="/dev/shm"))
    else:
        shm = tmp_path / "shm"
        shm.mkdir()
    values = {"STATEREG_SHM_DIR": str(shm), "STATEREG_NODE": "node0",
              "STATEREG_RUN_ID": "signals"}
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    yield values
    shutil.rmtree(shm, ignore_errors=True)


def start(mode: str, root: Path, env: dict[str, str]) -> Any:
    """The trainer, forked from the forkserver (a multiprocessing Process)."""
    root.mkdir(parents=True, exist_ok=True)
    process = forkserver().Process(target=child, args=(mode, root, env))
    process.start()
    return process


def stderr(root: Path) -> str:
    path = root / "stderr"
    return path.read_text() if path.exists() else ""


def children(pid: int) -> list[int]:
    """The processes `pid`'s main thread started (the DataLoader forks its workers there)."""
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def wait_for(path: Path, process: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.is_alive(), stderr(path.parent)[-3000:]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def terminate(process: Any, root: Path, signum: int = signal.SIGTERM) -> tuple[float, str]:
    """Signal the trainer's process group; seconds until it exited, and its stderr."""
    sent = time.monotonic()
    os.killpg(process.pid, signum)
    process.join(GRACE_S + 20)
    took = time.monotonic() - sent
    assert process.exitcode is not None, "the trainer is still running"
    return took, stderr(root)


def assert_durable_whole(root: Path) -> list[int]:
    """Every checkpoint storage.url shows verifies file by file; its steps."""
    durable = open_backend(str(root / "durable"))
    committed = list_committed(durable)
    for checkpoint in committed:
        verify_files(durable, checkpoint.name, checkpoint.manifest.files, "full")
    return [c.step for c in committed]


def newest_memory_step(root: Path) -> int:
    trainee = Trainee()
    with statereg.CheckpointManager(spec(root), model=trainee.model,
                                    optimizer=trainee.optimizer) as mgr:
        assert mgr._tiers is not None
        return list_committed(mgr._tiers.memory)[-1].step


def assert_loads_bit_identically(root: Path, step: int, mode: str = "drill") -> None:
    """A fresh manager loads `step` from storage.url exactly as a run that never stopped."""
    trainee = Trainee()
    with statereg.CheckpointManager(spec(root, mode), model=trainee.model,
                                    optimizer=trainee.optimizer) as mgr:
        result = mgr.load(step=step)
    assert result is not None and result.path == str(root / "durable" / f"step_{step:08d}")
    expected, got = trained(step), trainee.tensors()
    assert expected.keys() == got.keys()
    assert [k for k in expected if not torch.equal(expected[k], got[k])] == []


def drill_once(moment: float, root: Path, env: dict[str, str]) -> tuple[float, str, int]:
    """One trainer, SIGTERMed `moment` s after it reported started, with its workers."""
    process = start("drill", root, env)
    wait_for(root / "started", process)
    assert len(children(process.pid)) >= 2  # the DataLoader's workers
    time.sleep(moment)
    took, err = terminate(process, root)
    assert process.exitcode == 128 + signal.SIGTERM, err[-6000:]
    return took, err, process.exitcode


def test_sigterm_at_20_random_moments_flushes_the_newest_memory_checkpoint(
        tmp_path: Path, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    moments = [round(random.Random(SEED + i).uniform(0.0, 0.6), 3) for i in range(RUNS)]
    print(f"SIGTERM drill: seed {SEED} (STATEREG_SIGNAL_DRILL_SEED), moments {moments}")
    roots = [tmp_path / f"run{i:02d}" for i in range(RUNS)]
    # Two trainers at a time, each with its own run id (its own memory folder).
    envs = [{**env, "STATEREG_RUN_ID": f"signals{i:02d}"} for i in range(RUNS)]
    with ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(drill_once, moments, roots, envs))
    print(f"seconds from SIGTERM to exit: {[round(took, 2) for took, _, _ in outcomes]}")
    for i, (root, (took, err, _)) in enumerate(zip(roots, outcomes, strict=True)):
        assert took < GRACE_S, (i, took)
        flushed = re.findall(r"rank 0: SIGTERM: (.*), ([0-9.]+) s after the signal; exiting "
                             r"with status 143", err)
        assert len(flushed) == 1, (i, err[-3000:])
        monkeypatch.setenv("STATEREG_RUN_ID", envs[i]["STATEREG_RUN_ID"])
        newest = newest_memory_step(root)
        assert f"step_{newest:08d}" in flushed[0][0], (i, flushed)
        assert newest in assert_durable_whole(root), i
        assert_loads_bit_identically(root, newest)


def test_a_signal_during_a_save_waits_for_that_save_then_flushes_it(
        tmp_path: Path, env: dict[str, str]) -> None:
    process = start("mid_save", tmp_path, env)
    wait_for(tmp_path / "reached", process)  # the memory save of step 6 is held mid-way
    took, err = terminate(process, tmp_path)

    assert process.exitcode == 128 + signal.SIGTERM, err[-3000:]
    assert took < GRACE_S
    assert "rank 0: SIGTERM: finishing the save in flight first" in err
    assert re.search(r"rank 0: SIGTERM: flushed shm://signals/ws1-[0-9a-f]+/step_00000006 to "
                     r"\S+/durable/step_00000006, [0-9.]+ s after the signal", err), err
    assert 6 in assert_durable_whole(tmp_path)
    assert_loads_bit_identically(tmp_path, 6)


def test_without_tiers_a_signal_commits_the_async_save_in_flight_and_exits(
        tmp_path: Path, env: dict[str, str]) -> None:
    process = start("no_tiers", tmp_path, env)
    wait_for(tmp_path / "reached", process)  # step 3's background write is held
    assert (tmp_path / "reached").read_text().startswith("statereg")  # not the main thread
    took, err = terminate(process, tmp_path)

    assert process.exitcode == 128 + signal.SIGTERM, err[-3000:]
    assert took < GRACE_S
    durable = tmp_path / "durable"
    assert f"rank 0: SIGTERM: every save to {durable} is committed" in err
    assert assert_durable_whole(tmp_path) == [1, 2, 3]
    assert_loads_bit_identically(tmp_path, 3, "no_tiers")


def test_a_flush_longer_than_the_grace_period_exits_at_its_end_leaving_no_partial_copy(
        tmp_path: Path, env: dict[str, str]) -> None:
    process = start("slow_drain", tmp_path, env)
    wait_for(tmp_path / "reached", process)  # the drain of step 8 is held for a minute
    took, err = terminate(process, tmp_path, signal.SIGUSR1)

    assert process.exitcode == 128 + signal.SIGUSR1, err[-3000:]
    assert 1.0 <= took < 5.0
    assert ("rank 0: SIGUSR1: on_signal.grace_s 1.0 s is over before the flush finished: "
            "exiting with status 138; storage.url keeps its earlier checkpoints") in err
    assert 8 not in assert_durable_whole(tmp_path)


def current_wakeup_fd() -> int:
    current = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(current)
    return current


def test_handlers_are_installed_for_the_manager_and_given_back_at_close(
        tmp_path: Path, env: dict[str, str]) -> None:
    def before(signum: int, frame: Any) -> None:
        raise AssertionError("not called while the manager is open")

    previous = signal.signal(signal.SIGUSR1, before)
    # The wakeup fd an event loop may have set: the manager's pipe replaces it while it is
    # open (passing other signals' bytes on to it) and gives it back at close.
    loop_r, loop_w = os.pipe()
    os.set_blocking(loop_w, False)
    previous_fd = signal.set_wakeup_fd(loop_w)
    try:
        trainee = Trainee()
        mgr = statereg.CheckpointManager(spec(tmp_path), model=trainee.model,
                                         optimizer=trainee.optimizer)
        assert signal.getsignal(signal.SIGUSR1) == mgr._signals._handle
        assert signal.getsignal(signal.SIGTERM) == mgr._signals._handle
        assert current_wakeup_fd() not in (loop_w, -1)
        watcher = mgr._signals._watcher
        mgr.close()
        watcher.join(timeout=5)
        assert not watcher.is_alive()  # no thread is left behind by a closed manager
        assert signal.getsignal(signal.SIGUSR1) is before
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert current_wakeup_fd() == loop_w
        assert "save" not in vars(mgr)  # save() is the class's again
    finally:
        signal.signal(signal.SIGUSR1, previous)
        signal.set_wakeup_fd(previous_fd)
        os.close(loop_r)
        os.close(loop_w)


def test_other_signals_reach_the_wakeup_fd_that_was_set_before_and_children_have_their_own(
        tmp_path: Path, env: dict[str, str]) -> None:
    # An event loop's wakeup fd, set before the manager: while the manager's pipe replaces
    # it, the bytes of signals the manager does not declare are passed on to it. A child
    # forked from the trainer (a DataLoader worker) writes nothing into the trainer's pipe,
    # and a declared signal sent to it alone ends it as it would have without statereg.
    loop_r, loop_w = os.pipe()
    os.set_blocking(loop_w, False)
    previous_fd = signal.set_wakeup_fd(loop_w)
    previous_usr2 = signal.signal(signal.SIGUSR2, lambda signum, frame: None)
    trainee = Trainee()
    mgr = statereg.CheckpointManager(spec(tmp_path), model=trainee.model,
                                     optimizer=trainee.optimizer)
    try:
        signal.raise_signal(signal.SIGUSR2)
        ready, _, _ = select.select([loop_r], [], [], 5)
        assert ready and os.read(loop_r, 16) == bytes([signal.SIGUSR2])

        child = os.fork()
        if child == 0:  # a DataLoader worker: its wakeup fd is not the trainer's pipe
            code = 0 if current_wakeup_fd() == -1 else 3
            if code == 0:
                os.kill(os.getpid(), signal.SIGTERM)  # the default action: it ends here
                time.sleep(5)
            os._exit(code + 1)
        _, status = os.waitpid(child, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status
        time.sleep(0.2)  # the trainer's watcher saw nothing: it did not act and still waits
        assert mgr._signals._received is None and mgr._signals._watcher.is_alive()
    finally:
        mgr.close()
        signal.signal(signal.SIGUSR2, previous_usr2)
        signal.set_wakeup_fd(previous_fd)
        os.close(loop_r)
        os.close(loop_w)


def test_on_signal_is_refused_outside_the_main_thread(tmp_path: Path,
                                                      env: dict[str, str]) -> None:
    trainee = Trainee()
    failure: list[BaseException] = []

    def construct() -> None:
        try:
            statereg.CheckpointManager(spec(tmp_path), model=trainee.model,
                                       optimizer=trainee.optimizer)
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=construct)
    thread.start()
    thread.join()
    assert len(failure) == 1 and isinstance(failure[0], SpecError)
    assert str(failure[0]) == (
        "on_signal ['SIGTERM', 'SIGUSR1']: Python handles signals in the main thread only, "
        "so construct the CheckpointManager there, or remove on_signal")


@pytest.mark.parametrize(("declared", "message"), [
    (["SIGKILL"], "SIGKILL cannot be caught, so nothing can run on it: declare SIGTERM, "
                  "which schedulers send before SIGKILL"),
    (["SIGTERM", "SIGTERM"], "SIGTERM listed more than once"),
    ({"signals": ["SIGTERM"], "grace": 5}, "unknown field 'grace'; allowed fields: grace_s, "
                                           "signals"),
    ({"signals": ["SIGTERM"], "grace_s": 0}, "Input should be greater than 0"),
])
def test_a_wrong_on_signal_is_refused_naming_the_field(
        tmp_path: Path, declared: Any, message: str) -> None:
    with pytest.raises(SpecError) as refused:
        statereg.load_spec({**spec(tmp_path), "on_signal": declared})
    assert "on_signal" in str(refused.value) and message in str(refused.value)


def test_on_signal_shorthands_are_the_long_form(tmp_path: Path) -> None:
    long = statereg.load_spec({**spec(tmp_path), "on_signal": {"signals": ["SIGTERM"]}})
    for short in ("SIGTERM", ["SIGTERM"]):
        assert statereg.load_spec({**spec(tmp_path), "on_signal": short}) == long
    assert long.on_signal is not None and long.on_signal.grace_s == 25.0


@pytest.mark.parametrize("nodes", [1, 2])
def test_two_ranks_both_signalled_rank_0_flushes_and_rank_1_leaves_after_it(
        tmp_path: Path, env: dict[str, str], nodes: int) -> None:
    # On two simulated nodes rank 1's files are in node1's memory only: rank 0's flush reads
    # them from rank 1's node while rank 1 waits for the flush.
    ranks = []
    for rank in (0, 1):
        node = {**env, "STATEREG_NODE": f"node{rank if nodes == 2 else 0}"}
        ranks.append(forkserver().Process(target=child, args=("rank", tmp_path, node, rank)))
        ranks[-1].start()
    wait_for(tmp_path / "started", ranks[0])
    time.sleep(0.2)
    for process in reversed(ranks):  # as torchrun forwards it: to each rank in turn
        os.kill(process.pid, signal.SIGTERM)
    for process in ranks:
        process.join(GRACE_S + 20)
    errs = [(tmp_path / f"stderr-{rank}").read_text() for rank in (0, 1)]

    assert [p.exitcode for p in ranks] == [143, 143], errs
    assert re.search(r"rank 0: SIGTERM: (flushed \S+ to|the newest memory checkpoint is "
                     r"already in) \S+/step_\d+, [0-9.]+ s after the signal; exiting with "
                     r"status 143", errs[0]), errs[0]
    assert re.search(r"rank 1: SIGTERM: rank 0 flushed, [0-9.]+ s after the signal; exiting "
                     r"with status 143", errs[1]), errs[1]
    memory = open_backend(str(next(Path(env["STATEREG_SHM_DIR"]).glob(
        f"{PRIVATE}/node0/signals/ws2-*"))))
    # By manifests: on two nodes node0's folder lacks rank 1's files, which list() would skip.
    newest = scan_root(memory).committed[-1]
    assert newest.name in errs[0]
    assert newest.step in assert_durable_whole(tmp_path)
    flushed = statereg.read_manifest(str(tmp_path / "durable" / newest.name))
    assert {"rng/rank_00000.json", "rng/rank_00001.json"} <= {f.path for f in flushed.files}
    if nodes == 2:  # node1's memory holds rank 1's files and not rank 0's
        node1 = next(Path(env["STATEREG_SHM_DIR"]).glob(f"{PRIVATE}/node1/signals/ws2-*"))
        assert (node1 / newest.name / "rng" / "rank_00001.json").exists()
        assert not (node1 / newest.name / "rng" / "rank_00000.json").exists()
    assert [n for n in memory.list_dir("") if n.startswith("signal-flushed-")] != []


def test_a_signal_while_waiting_in_a_collective_for_a_straggler_flushes_within_the_grace(
        tmp_path: Path, env: dict[str, str]) -> None:
    # Python runs a handler only when the main thread is back from C: here the all_reduce
    # returns after STRAGGLE_S (8x the grace), when the scheduler's SIGKILL has come. The
    # signal's delivery, not its handler, starts the grace, and the flush runs meanwhile.
    ranks = [forkserver().Process(target=child, args=("straggler", tmp_path, env, rank))
             for rank in (0, 1)]
    for process in ranks:
        process.start()
    try:
        wait_for(tmp_path / "straggling", ranks[1])
        time.sleep(0.5)  # rank 0 is in the all_reduce of step 3 by now
        sent = time.monotonic()
        os.kill(ranks[0].pid, signal.SIGTERM)  # rank 1 hangs: it gets no signal in time
        ranks[0].join(STRAGGLE_S + 20)
        took = time.monotonic() - sent
    finally:
        for process in ranks:
            if process.is_alive():
                os.kill(process.pid, signal.SIGKILL)
            process.join(10)
    err = (tmp_path / "stderr-0").read_text()

    assert ranks[0].exitcode == 143, err
    found = re.search(r"rank 0: SIGTERM: flushed \S+ to \S+/(step_\d+), ([0-9.]+) s after the "
                      r"signal; exiting with status 143", err)
    assert found is not None, err
    logged = float(found.group(2))
    assert took < 5.0, f"rank 0 left {took:.1f} s after the signal, past its 5 s grace"
    # Timed from delivery: the log's figure cannot be far below what the test measured.
    assert logged <= took and took - logged < 2.0, (logged, took)
    name = found.group(1)
    assert int(name.removeprefix("step_")) in assert_durable_whole(tmp_path)
