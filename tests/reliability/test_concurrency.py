"""Two savers in one root: both commit distinct checkpoints, or the later one fails with a
clear error; `latest` never names an incomplete checkpoint; no two savers ever both believe
they committed one step. Object stores get there with conditional writes (S3 If-None-Match,
GCS ifGenerationMatch=0), local disk with link(2), never with a local lock file."""

from __future__ import annotations

import json
import queue
import threading
import time
from typing import Any

import crash_driver
import pytest
import torch
from crash_driver import SINGLE_COMPONENTS, TinyState, declaration
from reliability_kit import assert_identical, committed_names, forkserver

import statereg
import statereg.engine.save_steps
from statereg.backends.registry import open_backend
from statereg.engine import claims as claims_module
from statereg.engine.checkpoints import read_latest, read_manifest_at
from statereg.engine.claims import claim_file
from statereg.engine.publish import commit as publish_commit
from statereg.engine.verify import verify_files


def collect(results: Any, count: int, children: list[Any], timeout: float = 120) -> list[Any]:
    """`count` reports from `results`; fails at once when a child died before sending its
    own (one that failed to import would otherwise cost the whole timeout)."""
    reports: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(reports) < count:
        try:
            reports.append(results.get(timeout=1))
        except queue.Empty:
            dead = [c.exitcode for c in children if c.exitcode not in (None, 0)]
            if dead:
                pytest.fail(f"a saver exited with status {dead[0]} before reporting "
                            f"({len(reports)} of {count} reports came)")
            if time.monotonic() > deadline:
                pytest.fail(f"{len(reports)} of {count} reports came within {timeout} s")
    return reports


def run_savers(store, plans: list[tuple[list[int], int]]) -> list[tuple]:
    """Fork one saver per (steps, seed), released together by a barrier; their reports."""
    context = forkserver()
    barrier = context.Barrier(len(plans))
    results = context.Queue()
    children = [context.Process(target=crash_driver.save_at_barrier,
                                args=(store.url, store.options, steps, seed, barrier, results))
                for steps, seed in plans]
    for child in children:
        child.start()
    try:
        reports = collect(results, sum(len(steps) for steps, _ in plans), children)
    except BaseException:
        for child in children:  # the others would wait at the barrier for a minute
            child.kill()
        raise
    for child in children:
        child.join(60)
        assert child.exitcode == 0
    return reports


@pytest.mark.parametrize("store", ["local", "memory", "s3"], indirect=True)
def test_an_exclusive_create_has_exactly_one_winner(store):
    backend = open_backend(store.url, store.options)
    assert backend.atomic_create
    wins: list[int] = []
    losses: list[int] = []
    start = threading.Barrier(8)

    def racer(i: int) -> None:
        start.wait()
        try:
            backend.create_bytes("step_00000001/manifest.json", f"{i}".encode())
        except FileExistsError:
            losses.append(i)
        else:
            wins.append(i)

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(wins) == 1 and len(losses) == 7
    assert backend.read_bytes("step_00000001/manifest.json") == f"{wins[0]}".encode()
    assert not [p for p in store.files() if ".tmp" in p]


@pytest.mark.parametrize("store", ["local", "s3", "gcs"], indirect=True)
def test_two_processes_saving_different_steps_both_commit(store):
    reports = run_savers(store, [([10], 10), ([11], 11)])

    assert sorted(r[:3] for r in reports) == [("committed", 10, 10), ("committed", 11, 11)]
    assert committed_names(store.url, store.options) == ["step_00000010", "step_00000011"]
    assert read_latest(open_backend(store.url, store.options)) in (
        "step_00000010", "step_00000011")
    for step in (10, 11):
        statereg.verify(f"{store.url}/step_{step:08d}", store.options)
        state = TinyState.trained(1)
        statereg.CheckpointManager(declaration(store.url, store.options, SINGLE_COMPONENTS),
                                   **state.objects()).load(step=step)
        assert_identical(state.snapshot(), TinyState.trained(step).snapshot())


@pytest.mark.parametrize("store", ["local", "s3"], indirect=True)
def test_two_processes_saving_the_same_step_never_both_commit(store):
    # Three rounds, so the race is run more than once: steps 5, 6 and 7 by both savers.
    reports = run_savers(store, [([5, 6, 7], 1), ([5, 6, 7], 2)])

    for step in (5, 6, 7):
        mine = [r for r in reports if r[1] == step]
        committed = [r for r in mine if r[0] == "committed"]
        refused = [r for r in mine if r[0] == "refused"]
        assert len(committed) == 1 and len(refused) == 1, mine
        kind, message = refused[0][2], refused[0][3]
        assert kind in ("CheckpointInProgressError", "CheckpointExistsError"), refused
        assert f"step_{step:08d}" in message
        assert any(words in message for words in (
            "is being saved by", "already a committed checkpoint", "committed by another save"))
        winner = committed[0][2]
        url = f"{store.url}/step_{step:08d}"
        statereg.verify(url, store.options)
        assert statereg.read_manifest(url, store.options).extra == {"seed": winner}
        state = TinyState.trained(9)
        statereg.CheckpointManager(declaration(store.url, store.options, SINGLE_COMPONENTS),
                                   **state.objects()).load(step=step)
        assert_identical(state.snapshot(), TinyState.trained(winner).snapshot())


def test_latest_never_names_an_incomplete_checkpoint_while_two_processes_save(tmp_path):
    class Root:
        url = str(tmp_path / "root")
        options: dict = {}

    backend = open_backend(Root.url)
    seen: list[str] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            name = read_latest(backend)
            if name is None:
                continue
            committed = read_manifest_at(backend, name)
            verify_files(backend, name, committed.files, "fast")
            seen.append(name)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        reports = run_savers(Root, [([1, 3, 5, 7], 1), ([2, 4, 6, 8], 2)])
    finally:
        done.set()
        watcher.join()
    assert all(r[0] == "committed" for r in reports), reports
    assert committed_names(Root.url, {}) == [f"step_{s:08d}" for s in range(1, 9)]
    assert seen, "the watcher never saw a `latest`"


class StalledSaver:
    """Saver A in a thread named saver-a, saving step 3 of `decl`, held just before it
    commits until `finish()`; its outcome is the StateregError it raised, or None."""

    def __init__(self, decl: dict, monkeypatch: pytest.MonkeyPatch) -> None:
        stalled, self._resume = threading.Event(), threading.Event()
        commit = statereg.engine.save_steps.commit

        def stalling_commit(*args: Any) -> None:
            if threading.current_thread().name == "saver-a":
                stalled.set()
                self._resume.wait(30)
            commit(*args)

        monkeypatch.setattr(statereg.engine.save_steps, "commit", stalling_commit)
        self._outcome: queue.Queue = queue.Queue()

        def saver_a() -> None:
            try:
                statereg.CheckpointManager(decl, **TinyState.trained(1).objects()).save(step=3)
            except statereg.StateregError as exc:
                self._outcome.put(exc)
            else:
                self._outcome.put(None)

        self._thread = threading.Thread(target=saver_a, name="saver-a")
        self._thread.start()
        assert stalled.wait(30)

    def finish(self) -> statereg.StateregError | None:
        self._resume.set()
        self._thread.join(30)
        return self._outcome.get(timeout=5)


def test_a_saver_taken_over_while_it_looked_dead_does_not_commit(tmp_path, monkeypatch):
    """Saver A stalls after writing its files; its claim looks stale (another host, silent
    past its lease); saver B takes the step over and commits. A then fails, naming it."""
    url = str(tmp_path / "root")
    decl = declaration(url, {}, SINGLE_COMPONENTS)
    backend = open_backend(url)
    saver_a = StalledSaver(decl, monkeypatch)
    # A's claim, as another host would see it after A went silent for ten minutes.
    numbers = claims_module.read_claims(backend, "step_00000003")
    raw = claims_module.read_claim(backend, "step_00000003", numbers[-1])
    stale = claims_module.ClaimInfo(**{**raw.__dict__, "host_id": "elsewhere", "renewed_at": 0})
    backend.write_bytes(f"step_00000003/{claim_file(numbers[-1])}", stale.to_json())

    statereg.CheckpointManager(decl, **TinyState.trained(2).objects()).save(step=3)
    error = saver_a.finish()

    assert isinstance(error, statereg.CheckpointInProgressError)
    assert "was taken over" in str(error) and "nothing was committed by this save" in str(error)
    statereg.verify(f"{url}/step_00000003")
    state = TinyState.trained(9)
    statereg.CheckpointManager(decl, **state.objects()).load(step=3)
    assert_identical(state.snapshot(), TinyState.trained(2).snapshot())


def test_commit_creates_the_manifest_exclusively(tmp_path):
    decl = declaration(str(tmp_path), {}, SINGLE_COMPONENTS)
    url = statereg.CheckpointManager(decl, **TinyState.trained(1).objects()).save(step=1)
    backend = open_backend(str(tmp_path))
    manifest = read_manifest_at(backend, "step_00000001")
    before = (tmp_path / "step_00000001" / "manifest.json").read_bytes()
    forged = manifest.model_copy(update={"extra": {"forged": True}})

    with pytest.raises(statereg.CheckpointExistsError, match="committed by another save"):
        publish_commit(backend, "step_00000001", forged, None)
    assert (tmp_path / "step_00000001" / "manifest.json").read_bytes() == before
    statereg.verify(url)  # manifest.sum is the winner's too


@pytest.mark.parametrize("store", ["local", "s3"], indirect=True)
def test_a_reader_racing_retention_resumes_from_the_newest_or_hears_it_was_deleted(store):
    """Another process's retention (keep_last: 1) deletes checkpoints while this one loads:
    a resume loads the newest checkpoint still there; a load of a named checkpoint that
    vanished is a CheckpointDeletedError (or not found), never a raw FileNotFoundError."""
    spec = {"storage": {"url": store.url, "options": store.options, "io_threads": 1},
            "components": {"model": {"kind": "model"}}, "save": {"keep_last": 1}}
    writer = statereg.CheckpointManager(spec, model=torch.nn.Linear(256, 256))
    writer.save(step=1)
    stop = threading.Event()
    saved: list[int] = []

    def keep_saving() -> None:
        step = 2
        while not stop.is_set() and step < 200:
            writer.save(step=step)
            saved.append(step)
            step += 1

    thread = threading.Thread(target=keep_saving)
    thread.start()
    failures: list[BaseException] = []
    try:
        reader = statereg.CheckpointManager(spec, model=torch.nn.Linear(256, 256))
        loads, deadline = 0, time.monotonic() + 60
        # At least 15 loads, and on until retention has run under them (on a busy machine
        # 15 loads can finish before the writer's third save).
        while loads < 15 or (len(saved) < 3 and time.monotonic() < deadline):
            loads += 1
            try:
                assert reader.load() is not None  # a resume always finds one
            except BaseException as exc:
                failures.append(exc)
            try:
                reader.load(step=1)  # deleted by retention long ago
            except statereg.CheckpointNotFoundError as exc:
                assert "step 1" in str(exc) or "step_00000001" in str(exc), exc
    finally:
        stop.set()
        thread.join()
        writer.close()
    assert not failures, failures
    assert len(saved) >= 3  # retention really ran under the reader


def test_a_saver_whose_claim_was_written_over_does_not_commit(tmp_path, monkeypatch):
    """On a store that ignores conditional creates, a second saver's claim of the same number
    lands over the first's: the first saver compares its token before it commits, and
    commits nothing (the claim number alone would match)."""
    url = str(tmp_path / "root")
    decl = declaration(url, {}, SINGLE_COMPONENTS)
    backend = open_backend(url)
    saver_a = StalledSaver(decl, monkeypatch)
    numbers = claims_module.read_claims(backend, "step_00000003")
    mine = claims_module.read_claim(backend, "step_00000003", numbers[-1])
    other = claims_module.ClaimInfo(**{**mine.__dict__, "token": "0" * 32, "pid": 1})
    backend.write_bytes(f"step_00000003/{claim_file(numbers[-1])}", other.to_json())
    error = saver_a.finish()

    assert isinstance(error, statereg.CheckpointInProgressError), error
    assert "nothing was committed by this save" in str(error)
    assert not (tmp_path / "root" / "step_00000003" / "manifest.json").exists()


RACE_ROUNDS = 20


def race_every_step(url: str, options: dict, steps: list[int], seed: int, barrier: Any,
                    results: Any) -> None:
    """Save each of `steps` with this saver's state (`seed`), meeting the other saver at the
    barrier before each, so every step is raced; report ("committed", step, seed, ""),
    ("refused", step, type, message) for a StateregError, or ("escaped", step, type,
    message) for anything else save() let out."""
    torch.set_num_threads(1)
    state = TinyState.trained(seed)
    mgr = statereg.CheckpointManager(declaration(url, options, SINGLE_COMPONENTS),
                                     **state.objects())
    for step in steps:
        barrier.wait(60)
        try:
            mgr.save(step=step, extra={"seed": seed})
        except statereg.StateregError as exc:
            results.put(("refused", step, type(exc).__name__, str(exc)))
        except BaseException as exc:
            results.put(("escaped", step, type(exc).__name__, str(exc)))
        else:
            results.put(("committed", step, seed, ""))


class _Root:
    def __init__(self, url: str, options: dict) -> None:
        self.url, self.options = url, options


@pytest.fixture(params=["local", "ignoring-s3"])
def race_root(request, tmp_path) -> _Root:
    """A root on local disk, or on an S3 server that ignores conditional creates (moto
    behind a relay that strips If-None-Match, as s3rver and older on-prem servers do)."""
    if request.param == "local":
        return _Root(str(tmp_path / "root"), {})
    from storage_servers import new_bucket, s3_options
    proxy = request.getfixturevalue("condition_ignoring_proxy")
    bucket = new_bucket(request.getfixturevalue("s3_admin"))
    return _Root(f"s3://{bucket}/run", s3_options(proxy.endpoint))


def test_two_writers_racing_every_step_never_leave_a_false_commit(race_root):
    """Issue 25 case 8: on a store that ignores conditional creates, two writers racing one
    step were told "committed" for a checkpoint that fails verify, let DCP's bare
    RuntimeError("Checkpoint already exists") out of save(), and the loser was told its
    claim "lapsed, or gc removed it". Over 20 raced steps: at most one saver is told
    committed per step, and its checkpoint verifies and loads bit-exact with its own state;
    nothing but a StateregError escapes save(); every checkpoint that stands loads; a loser
    is told it lost a race with another writer (or that the step is taken)."""
    steps = list(range(1, RACE_ROUNDS + 1))
    context = forkserver()
    barrier = context.Barrier(2)
    results = context.Queue()
    children = [context.Process(target=race_every_step,
                                args=(race_root.url, race_root.options, steps, seed, barrier,
                                      results))
                for seed in (1, 2)]
    for child in children:
        child.start()
    try:
        reports = collect(results, 2 * len(steps), children, timeout=90)
    finally:
        for child in children:
            child.join(30)
            if child.exitcode is None:
                child.kill()
    escaped = [r for r in reports if r[0] == "escaped"]
    assert not escaped, escaped
    for report in reports:
        if report[0] == "refused":
            kind, message = report[2], report[3]
            assert kind in ("CheckpointInProgressError", "CheckpointExistsError"), report
            assert f"step_{report[1]:08d}" in message, report
            assert "lapsed, or" not in message, report
    standing = set(committed_names(race_root.url, race_root.options))
    for step in steps:
        name = f"step_{step:08d}"
        committed = [r[2] for r in reports if r[1] == step and r[0] == "committed"]
        assert len(committed) <= 1, (step, committed)
        if committed:
            assert name in standing, (step, committed)
        if name not in standing:
            continue
        url = f"{race_root.url}/{name}"
        statereg.verify(url, race_root.options)
        seed = statereg.read_manifest(url, race_root.options).extra["seed"]
        assert not committed or seed == committed[0], (step, committed, seed)
        state = TinyState.trained(9)
        statereg.CheckpointManager(declaration(race_root.url, race_root.options,
                                               SINGLE_COMPONENTS),
                                   **state.objects()).load(step=step)
        assert_identical(state.snapshot(), TinyState.trained(seed).snapshot())


def test_a_saver_overtaken_between_its_claim_check_and_its_manifest_is_not_told_committed(
        condition_ignoring_proxy, s3_admin, monkeypatch):
    """Issue 25 case 8, one interleaving pinned down on a store that ignores conditional
    creates: savers A and B both find step 3 unclaimed; A claims it, writes its files and
    checks its claim; only then does B's claim land (over A's), and B writes its files while
    A commits. A's manifest stood for a moment, but its claim is B's: A is told it lost a race
    (CheckpointExistsError, not "lapsed, or gc removed it"); B's manifest, written after,
    stands, is told committed, verifies and loads B's values: none of A's files, written under
    A's own writer directory, was overwritten or named by it."""
    from storage_servers import new_bucket, s3_options

    url = f"s3://{new_bucket(s3_admin)}/run"
    options = s3_options(condition_ignoring_proxy.endpoint)
    decl = declaration(url, options, SINGLE_COMPONENTS)
    backend_class = type(open_backend(url, options))
    create = backend_class.create_bytes
    both_listed = threading.Barrier(2, timeout=60)
    a_checked, a_done = threading.Event(), threading.Event()

    def create_in_order(self, path: str, data: bytes):
        saver = threading.current_thread().name
        if path.endswith(claim_file(0)):
            both_listed.wait()  # each found the step unclaimed
            if saver == "saver-b":
                assert a_checked.wait(60)  # B's claim lands after A checked its own
        if path.endswith("manifest.sum"):
            if saver == "saver-a":
                a_checked.set()
                assert b_committing.wait(60)  # A commits while B is at its commit too
            else:
                b_committing.set()
                assert a_done.wait(60)  # B's manifest is written after A's
        return create(self, path, data)

    b_committing = threading.Event()
    monkeypatch.setattr(backend_class, "create_bytes", create_in_order)
    outcomes: dict[str, Any] = {}

    # Built before the threads start: training seeds torch's global generator, which two
    # threads building their states at once would share.
    states = {1: TinyState.trained(1), 2: TinyState.trained(2)}

    def save(name: str, seed: int) -> None:
        try:
            statereg.CheckpointManager(decl, **states[seed].objects()).save(
                step=3, extra={"seed": seed})
            outcomes[name] = "committed"
        except BaseException as exc:
            outcomes[name] = exc
        finally:
            if name == "saver-a":
                a_done.set()

    threads = [threading.Thread(target=save, args=(n, s), name=n)
               for n, s in (("saver-a", 1), ("saver-b", 2))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)

    error = outcomes["saver-a"]
    assert isinstance(error, statereg.CheckpointExistsError), outcomes
    assert "lost a race with another writer" in str(error)
    assert f"its claim {claim_file(0)} replaced this one's" in str(error)
    assert "does not enforce conditional creates" in str(error)
    assert "lapsed, or" not in str(error)
    assert outcomes["saver-b"] == "committed", outcomes
    checkpoint = f"{url}/step_00000003"
    statereg.verify(checkpoint, options)
    manifest = statereg.read_manifest(checkpoint, options)
    assert manifest.extra == {"seed": 2} and manifest.writer is not None
    assert all(f.path.startswith(f"writer-{manifest.writer}/") for f in manifest.files)
    state = TinyState.trained(9)
    statereg.CheckpointManager(decl, **state.objects()).load(step=3)
    assert_identical(state.snapshot(), TinyState.trained(2).snapshot())


def test_a_checkpoint_in_a_writer_directory_reads_as_any_other(condition_ignoring_proxy,
                                                                 s3_admin, tmp_path):
    """On a store without exclusive creates every file of a save lies under its writer
    directory. Everything that reads checkpoints follows it: an incremental save references
    the previous one's files there, load, `statereg cp` (the copy has no writer directory)
    and plain `dcp.load` of `step_N/writer-<token>/model`."""
    import torch.distributed.checkpoint as dcp
    from storage_servers import new_bucket, s3_options

    from statereg.cli import main as cli

    url = f"s3://{new_bucket(s3_admin)}/run"
    options = s3_options(condition_ignoring_proxy.endpoint)
    decl = declaration(url, options, SINGLE_COMPONENTS)
    decl["save"]["incremental"] = True
    state = TinyState.trained(4)
    mgr = statereg.CheckpointManager(decl, **state.objects())
    mgr.save(step=1)
    mgr.save(step=2)  # the same values: every tensor item is referenced from step 1
    first = statereg.read_manifest(f"{url}/step_00000001", options)
    second = statereg.read_manifest(f"{url}/step_00000002", options)
    assert first.writer and second.writer and first.writer != second.writer
    assert first.format_version == "1.2"
    assert second.references and all(
        r.path.startswith(f"step_00000001/writer-{first.writer}/") for r in second.references)

    for step in (1, 2):
        statereg.verify(f"{url}/step_{step:08d}", options)
        loaded = TinyState.trained(9)
        statereg.CheckpointManager(decl, **loaded.objects()).load(step=step)
        assert_identical(loaded.snapshot(), state.snapshot())

    copy_root = str(tmp_path / "copy")
    assert cli(["cp", f"{url}/step_00000002", copy_root, "--src-options",
                json.dumps(options)]) in (0, None)
    copied = statereg.read_manifest(f"{copy_root}/step_00000002")
    assert copied.writer is None and not copied.references
    assert all(not f.path.startswith("writer-") for f in copied.files)
    loaded = TinyState.trained(9)
    statereg.CheckpointManager(declaration(copy_root, {}, SINGLE_COMPONENTS),
                               **loaded.objects()).load(step=2)
    assert_identical(loaded.snapshot(), state.snapshot())

    local = tmp_path / "plain"
    s3_admin.get(f"{url.removeprefix('s3://')}/step_00000001/writer-{first.writer}/model",
                 str(local), recursive=True)
    plain = {k: torch.zeros_like(v) for k, v in state.model.state_dict().items()}
    dcp.load(plain, checkpoint_id=str(local), no_dist=True)
    assert_identical(plain, dict(state.model.state_dict()))
