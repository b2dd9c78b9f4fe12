"""Crash drills for memory-first tiers (docs/tiers.md): a real trainer process is SIGKILLed
during a memory save, memory retention, a drain or durable retention; a fresh process must
resume bit-identically from the newest complete copy in either tier, storage.url must never
hold a partial checkpoint, and the resumed run must finish over the leftovers.

The trainer (`train`) runs 12 steps (memory every 2, drain every 4) in a child forked from
the reliability forkserver (torch already imported). `Tripwire` numbers every storage event
of both tiers: before a file is opened for writing ("open"), after half of its first write
reached the file ("half", a partial file), after it is closed and durable but before it is
renamed or linked into place ("done"), and before a file or tree is deleted ("delete").
Each event is named by tier, kind, path (a temporary file's random suffix read as `.tmp`)
and occurrence, so it names the same moment in every run although the drain thread
interleaves with the training loop. A dry run lists every event; the drill draws kill
points from that list with a seed, printed and replayable with STATEREG_DRILL_SEED
(STATEREG_DRILL_POINTS sets how many points: 24 by default).
"""

from __future__ import annotations

import functools
import os
import random
import re
import shutil
import signal
import tempfile
import threading
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tier_trainee
import torch
from reliability_kit import KILLED, assert_identical, run_child
from tqdm import tqdm

import statereg
from statereg.backends.checksum import HashingWriter
from statereg.backends.local import LocalBackend
from statereg.backends.registry import open_backend
from statereg.backends.shm import SharedMemoryBackend
from statereg.engine.checkpoints import list_committed
from statereg.engine.verify import verify_files

# This user's folder of memory roots under the shared-memory folder (backends/shm.py).
PRIVATE = f"statereg-{os.geteuid()}"

if TYPE_CHECKING:
    import pytest

STEPS = 12
MEMORY_EVERY, DURABLE_EVERY = 2, 4
SEED_ENV, POINTS_ENV = "STATEREG_DRILL_SEED", "STATEREG_DRILL_POINTS"
DEFAULT_POINTS = 24
_TEMPORARY = re.compile(r"\.tmp-\d+-[0-9a-f]+$")


def spec(durable: str) -> dict[str, Any]:
    return {"storage": {"url": durable},
            "components": {"model": {"kind": "model"}, "optimizer": {"kind": "optimizer"}},
            "tiers": {"memory": {"every": MEMORY_EVERY, "keep_last": 2},
                      "durable": {"every": DURABLE_EVERY, "keep_last": 2}}}


class Trainee(tier_trainee.Trainee):
    def __init__(self) -> None:
        torch.set_num_threads(1)
        super().__init__()

    def manager(self, durable: str) -> statereg.CheckpointManager:  # type: ignore[override]
        return super().manager(spec(durable))


@functools.cache
def references() -> list[dict[str, torch.Tensor]]:
    """The state after each step 0..STEPS of a run that is never killed. Call it first from
    the main thread: Trainee seeds torch's global generator."""
    trainee = Trainee()
    states = [trainee.tensors()]
    for step in range(1, STEPS + 1):
        trainee.step(step)
        states.append(trainee.tensors())
    return states


def trained(steps: int) -> dict[str, torch.Tensor]:
    return references()[steps]


@dataclass(frozen=True)
class Event:
    """One storage event of the trainer: the moment a kill point names."""

    tier: str  # "memory" or "durable"
    kind: str  # "open", "half", "done" or "delete"
    path: str  # relative to the tier's root; a temporary file's suffix reads `.tmp`
    nth: int  # its occurrence among events of the same tier, kind and path

    @property
    def phase(self) -> str:
        """What the trainer was doing: a memory save, memory retention, a drain (claims
        included), or durable retention."""
        deleting = self.kind == "delete" and "/.claim-" not in self.path
        if self.tier == "memory":
            return "memory retention" if deleting else "memory save"
        return "durable retention" if deleting else "drain"

    def __str__(self) -> str:
        return f"{self.tier}:{self.kind}:{self.path}#{self.nth}"

    @classmethod
    def parse(cls, text: str) -> Event:
        tier, kind, rest = text.split(":", 2)
        path, nth = rest.rsplit("#", 1)
        return cls(tier, kind, path, int(nth))


class Tripwire:
    """Numbers the trainer's storage events (patching classes of this process only); dies
    by SIGKILL at `kill_at`, after writing its name to `marker` (proof it got there), and
    appends every event to `log` (the dry run)."""

    def __init__(self, kill_at: Event | None, marker: Path, log: Path | None) -> None:
        self.kill_at, self.marker, self.log = kill_at, marker, log
        self.seen: Counter[tuple[str, str, str]] = Counter()
        self.lock = threading.Lock()

    def reached(self, tier: str, kind: str, path: str) -> bool:
        """Count one event; True when it is the kill point."""
        path = _TEMPORARY.sub(".tmp", path)
        with self.lock:
            self.seen[tier, kind, path] += 1
            event = Event(tier, kind, path, self.seen[tier, kind, path])
            if self.log is not None:
                with self.log.open("a") as log:
                    log.write(f"{event}\n")
        return event == self.kill_at

    def die(self) -> None:
        self.marker.write_text(str(self.kill_at))
        os.kill(os.getpid(), signal.SIGKILL)

    def install(self) -> None:
        wire = self
        open_write, remove_file = LocalBackend.open_write, LocalBackend.remove_file
        remove_tree = LocalBackend.remove_tree
        write, close = HashingWriter.write, HashingWriter.close

        def tier(backend: LocalBackend) -> str:
            return "memory" if isinstance(backend, SharedMemoryBackend) else "durable"

        def armed_open_write(self: LocalBackend, path: str, on_done: Any = None) -> Any:
            if wire.reached(tier(self), "open", path):
                wire.die()
            writer = open_write(self, path, on_done)
            writer.drill = [tier(self), False]  # its tier; whether it was written to
            return writer

        def armed_write(self: HashingWriter, data: Any) -> int:
            drill = getattr(self, "drill", None)
            if drill is not None and not drill[1]:
                drill[1] = True
                if wire.reached(drill[0], "half", self.path):
                    view = memoryview(data).cast("B")
                    self._sink.write(view[: max(1, len(view) // 2)])
                    self._sink.flush()
                    os.fsync(self._sink.fileno())
                    wire.die()
            return write(self, data)

        def armed_close(self: HashingWriter) -> None:
            was_closed = self.closed
            close(self)
            drill = getattr(self, "drill", None)
            if drill is not None and not was_closed and wire.reached(drill[0], "done", self.path):
                wire.die()

        def armed_remove_file(self: LocalBackend, path: str) -> None:
            if wire.reached(tier(self), "delete", path):
                wire.die()
            remove_file(self, path)

        def armed_remove_tree(self: LocalBackend, path: str) -> None:
            if wire.reached(tier(self), "delete", path):
                wire.die()
            remove_tree(self, path)

        LocalBackend.open_write = armed_open_write  # type: ignore[method-assign]
        LocalBackend.remove_file = armed_remove_file  # type: ignore[method-assign]
        LocalBackend.remove_tree = armed_remove_tree  # type: ignore[method-assign]
        HashingWriter.write = armed_write  # type: ignore[method-assign]
        HashingWriter.close = armed_close  # type: ignore[method-assign]


def train(root: str, env: dict[str, str], kill_at: str | None, log: str | None) -> None:
    """The trainer (a forked child): 12 steps, saving every step; killed at `kill_at`."""
    os.environ.update(env)  # the forkserver's children inherit its environment, not ours
    # The progress bar's default lock is a multiprocessing semaphore, which a killed process
    # never unlinks (Python warns of each at exit): a thread lock serves one process as well.
    tqdm.set_lock(threading.RLock())
    Tripwire(Event.parse(kill_at) if kill_at else None, Path(root) / "reached",
             Path(log) if log else None).install()
    trainee = Trainee()
    mgr = trainee.manager(f"{root}/durable")
    for step in range(1, STEPS + 1):
        trainee.step(step)
        mgr.save(step)
    mgr.close()


def resume(root: str, env: dict[str, str]) -> None:
    """A fresh process after the kill: load the nearest copy, train on to the end, and
    report (ROOT/resumed.pt) what it loaded and where it ended."""
    os.environ.update(env)
    report: dict[str, Any] = {}
    try:
        trainee = Trainee()
        mgr = trainee.manager(f"{root}/durable")
        result = mgr.load()
        report.update(step=result.step if result else None,
                      path=result.path if result else None, loaded=trainee.tensors())
        for step in range((result.step if result else 0) + 1, STEPS + 1):
            trainee.step(step)
            mgr.save(step)
        mgr.close()
        report["final"] = trainee.tensors()
    except BaseException:
        report["error"] = traceback.format_exc()
    torch.save(report, f"{root}/resumed.pt")


def private_shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                request: pytest.FixtureRequest) -> dict[str, str]:
    """A private folder on the real tmpfs (/dev/shm) where there is one, else on disk; the
    environment naming it (set here, and given to each forked child). Not a fixture: every
    trainer imports this module, and importing pytest would cost each one a second."""
    if os.access("/dev/shm", os.W_OK):
        shm = Path(tempfile.mkdtemp(prefix="statereg-drill-", dir="/dev/shm"))
        request.addfinalizer(lambda: shutil.rmtree(shm, ignore_errors=True))
    else:
        shm = tmp_path / "shm"
        shm.mkdir()
    values = {"STATEREG_SHM_DIR": str(shm), "STATEREG_NODE": "node0",
              "STATEREG_RUN_ID": "drill"}
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    return values


def committed_steps(backend: Any) -> list[int]:
    return [c.step for c in list_committed(backend)]


def assert_whole(backend: Any) -> list[int]:
    """Every committed checkpoint under `backend` is whole (every file, every checksum);
    returns their steps."""
    committed = list_committed(backend)
    for checkpoint in committed:
        verify_files(backend, checkpoint.name, checkpoint.manifest.files, "full")
    return [c.step for c in committed]


def memory_root(env: dict[str, str], run_id: str) -> Path | None:
    """The job-identity folder of run `run_id` in memory (None before it was created)."""
    found = list((Path(env["STATEREG_SHM_DIR"]) / PRIVATE / env["STATEREG_NODE"] / run_id)
                 .glob("ws*"))
    assert len(found) <= 1, found
    return found[0] if found else None


def dry_run(base: Path, env: dict[str, str]) -> list[Event]:
    """Every storage event of a run that is never killed, in the order it happened."""
    root = base / "dry"
    root.mkdir()
    log = root / "events"
    code = run_child(train, str(root), {**env, "STATEREG_RUN_ID": "dry"}, None, str(log))
    assert code == 0, f"the dry run exited with {code}"
    return [Event.parse(line) for line in log.read_text().splitlines()]


def choose(events: list[Event], count: int, seed: int) -> list[Event]:
    """`count` kill points drawn with `seed`: a fair share from each phase first (all of a
    phase that has fewer), the rest from everything left."""
    rng = random.Random(seed)
    phases: dict[str, list[Event]] = {}
    for event in events:
        phases.setdefault(event.phase, []).append(event)
    chosen: list[Event] = []
    for phase in sorted(phases):
        chosen += rng.sample(phases[phase], min(len(phases[phase]), count // len(phases)))
    rest = [e for e in events if e not in chosen]
    chosen += rng.sample(rest, min(len(rest), count - len(chosen)))
    return chosen


def drill(base: Path, env: dict[str, str], point: Event, number: int) -> dict[str, Any]:
    """Kill the trainer at `point`, check what the disk holds, resume in a fresh process.
    Returns what the parent asserts: the step the disk says is newest and its tier, the
    resumed run's report, and the steps each tier holds at its end (all verified)."""
    root = base / f"point{number:02d}"
    root.mkdir()
    child_env = {**env, "STATEREG_RUN_ID": f"point{number:02d}"}
    code = run_child(train, str(root), child_env, str(point), None)
    assert code == KILLED, f"the trainer exited with {code} instead of being killed"
    assert (root / "reached").read_text() == str(point)
    durable = open_backend(str(root / "durable"))
    in_durable = assert_whole(durable)  # never a partial checkpoint
    run_id = child_env["STATEREG_RUN_ID"]
    folder = memory_root(env, run_id)
    in_memory = assert_whole(open_backend(str(folder))) if folder else []
    newest = max(in_memory + in_durable, default=None)
    code = run_child(resume, str(root), child_env)
    assert code == 0, f"the resumed run exited with {code}"
    report = torch.load(root / "resumed.pt")
    if "error" in report:
        raise AssertionError(f"the resumed run failed: {report['error']}")
    return {"newest": newest, "in_memory": newest in in_memory, "report": report,
            "durable": str(root / "durable"), "after": assert_whole(durable),
            "memory_after": assert_whole(open_backend(str(memory_root(env, run_id))))}


def check(point: Event, outcome: dict[str, Any]) -> None:
    """The resumed run loaded the newest complete copy bit-identically and ended equal to a
    run that was never killed, with its last step in memory and every due drain committed."""
    newest, report = outcome["newest"], outcome["report"]
    assert report["step"] == newest, f"resumed from {report['step']}, newest copy is {newest}"
    if newest is not None:
        want = "shm://" if outcome["in_memory"] else f"{outcome['durable']}/step_"
        assert report["path"].startswith(want), report["path"]
    assert_identical(report["loaded"], trained(newest or 0), f"state loaded at {newest}")
    assert_identical(report["final"], trained(STEPS), f"state at step {STEPS}")
    assert outcome["memory_after"][-1] == STEPS, outcome["memory_after"]
    due = [s for s in range((newest or 0) + 1, STEPS + 1) if s % DURABLE_EVERY == 0]
    if due:
        assert outcome["after"][-1] == due[-1], (outcome["after"], due)


def test_sigkill_at_random_points_resumes_bit_identically_from_the_newest_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest,
) -> None:
    env = private_shm(tmp_path, monkeypatch, request)
    seed = int(os.environ.get(SEED_ENV) or random.SystemRandom().randrange(2**32))
    count = int(os.environ.get(POINTS_ENV) or DEFAULT_POINTS)
    print(f"tier drill seed {seed} ({count} points): replay with {SEED_ENV}={seed}")
    references()
    events = dry_run(tmp_path, env)
    points = choose(events, count, seed)
    assert len(points) == min(count, len(events)) >= min(count, 20)
    assert {p.phase for p in points} == {e.phase for e in events} == {
        "memory save", "memory retention", "drain", "durable retention"}
    failures = []

    def one(numbered: tuple[int, Event]) -> None:
        number, point = numbered
        try:
            check(point, drill(tmp_path, env, point, number))
        except Exception as exc:  # a damaged copy raises statereg's own errors
            failures.append(f"point {number} ({point}, {point.phase}): "
                            f"{type(exc).__name__}: {exc}")

    with ThreadPoolExecutor(2) as pool:  # two trainers at a time: one per core
        list(pool.map(one, enumerate(points)))
    assert not failures, f"seed {seed} ({SEED_ENV}={seed} replays it):\n" + "\n".join(failures)


def test_restart_after_the_node_lost_its_memory_restores_from_durable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest,
) -> None:
    env = private_shm(tmp_path, monkeypatch, request)
    before_manifest = Event("durable", "open", "step_00000008/manifest.json.tmp", 1)
    code = run_child(train, str(tmp_path), env, str(before_manifest), None)
    assert code == KILLED
    durable = str(tmp_path / "durable")
    # The drain of step 8 died before its manifest; the wait policy had finished step 4's.
    assert committed_steps(open_backend(durable)) == [4]
    for entry in Path(env["STATEREG_SHM_DIR"]).iterdir():  # a reboot empties tmpfs
        shutil.rmtree(entry)
    fresh = Trainee()
    mgr = fresh.manager(durable)
    result = mgr.load()
    assert result.step == 4 and result.path == f"{durable}/step_00000004"
    assert_identical(fresh.tensors(), trained(4))
    mgr.close()


def test_a_job_with_another_run_id_never_loads_the_first_jobs_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest,
) -> None:
    private_shm(tmp_path, monkeypatch, request)
    durable = str(tmp_path / "durable")
    first = Trainee()
    mgr = first.manager(durable)
    for step in (1, 2):
        first.step(step)
        mgr.save(step)
    mgr.close()
    assert committed_steps(open_backend(durable)) == []  # step 2 is in memory only
    monkeypatch.setenv("STATEREG_RUN_ID", "another-job")
    second = Trainee()
    assert second.manager(durable).load() is None
    untouched = Trainee().tensors()
    assert all(torch.equal(t, untouched[k]) for k, t in second.tensors().items())

