"""Two savers in one root: both commit distinct checkpoints, or the later one fails with a
clear error; `latest` never names an incomplete checkpoint; no two savers ever both believe
they committed one step. Object stores get there with conditional writes (S3 If-None-Match,
GCS ifGenerationMatch=0), local disk with link(2), never with a local lock file."""

from __future__ import annotations

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
import statereg.engine.save
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
        commit = statereg.engine.save.commit

        def stalling_commit(*args: Any) -> None:
            if threading.current_thread().name == "saver-a":
                stalled.set()
                self._resume.wait(30)
            commit(*args)

        monkeypatch.setattr(statereg.engine.save, "commit", stalling_commit)
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
