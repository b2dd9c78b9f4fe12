"""The Saver: the save pipeline of one run, across its saves (capture, cross-rank checks,
staging, the background write and the commit); the steps of each save are save_steps.py.
The manager only hands it the plan and the live adapters.

    save(step) -> capture (plan's tasks) -> check keys and replicas on every rank
               -> off:   write and commit now
               -> async: copy into reused host buffers, then write and commit on a thread
               -> early_return: the copy itself runs on that thread (wait_staged() first)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from statereg.backends.base import StorageBackend
from statereg.dcp.metadata import gc_paused
from statereg.engine.checkpoints import checkpoint_name
from statereg.engine.layouts import Captured
from statereg.engine.layouts.dcp import SavePlans
from statereg.engine.plan import RankPlan
from statereg.engine.save_steps import (
    capture,
    check_consistency,
    check_copies,
    check_extra,
    check_replicas,
    save_checkpoint,
    summarize,
)
from statereg.engine.staging import LoopMark, StagingArea, mark_loop
from statereg.engine.world import World, caught
from statereg.errors import SpecError, StateregError
from statereg.schemas.manifest import exact_int, int_text
from statereg.schemas.spec import RegistrySpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveInfo:
    """What one save did, for a tracker or a log: the step and where it went, how long it
    held the training loop (`stall_s`), how long until it was committed (`committed_s`, from
    the call of save()), and how many bytes of state it saved (before compression)."""

    step: int
    url: str
    stall_s: float
    committed_s: float
    bytes: int


class SaveHandle(str):
    """What save() returns: the checkpoint's URL (a plain str to every caller) and a wait.

    With `save.early_return`, `wait_staged()` blocks until the state is copied to host
    buffers, after which the loop may change parameters and optimizer state, and re-raises a
    failure of that copy. Otherwise the copy is done before save() returns, and it returns
    at once. `CheckpointManager.wait()` waits for the commit.
    """

    _staged: Future[None] | None
    _committed: Future[SaveInfo]
    due: bool  # False: nothing was due at this step (tiers), so nothing was saved

    def __new__(cls, url: str, staged: Future[None] | None = None,
                committed: Future[SaveInfo] | None = None) -> SaveHandle:
        handle = super().__new__(cls, url)
        handle._staged = staged
        handle._committed = committed if committed is not None else Future()
        handle.due = True
        return handle

    @classmethod
    def not_due(cls, step: int) -> SaveHandle:
        """The handle of a save() at which no tier was due: an empty URL (false in `if
        handle:`), nothing to wait for, and info() says so."""
        committed: Future[SaveInfo] = Future()
        committed.set_exception(StateregError(
            f"save(step={step}) saved nothing: no tier was due at this step (tiers.memory."
            "every, tiers.durable.every); check handle.due before asking for its info"))
        handle = cls("", committed=committed)
        handle.due = False
        return handle

    def info(self) -> SaveInfo:
        """What the save did, once committed: blocks until then; re-raises its failure."""
        return self._committed.result()

    def wait_staged(self) -> None:
        """Block until this save's copy to host buffers is done; re-raise its failure."""
        if self._staged is not None:
            self._staged.result()

    def __reduce__(self) -> tuple[type[str], tuple[str]]:
        # Pickled or copied, a handle is its URL: a Future cannot leave this process.
        return str, (str(self),)


class Saver:
    """Runs saves of one run, at most one in flight."""

    def __init__(self, spec: RegistrySpec, backend: StorageBackend, world: World) -> None:
        self.spec = spec
        self.backend = backend
        self.world = world
        self._staging = StagingArea(pinned=spec.save.async_mode == "pinned")
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: Future[str] | None = None
        self._staged: Future[None] | None = None
        self._failure: tuple[str, float] | None = None  # what the last background failure was
        # DCP plans kept from one save to the next: a save of unchanged shapes reuses them.
        self._plans = SavePlans()
        # Called with each committed save's SaveInfo (CheckpointManager.on_saved).
        self.listeners: list[Callable[[SaveInfo], None]] = []

    def save(self, plan: RankPlan, adapters: dict[str, Any], step: int,
             tokens_seen: int | None, extra: dict[str, Any] | None,
             after_commit: Callable[[str], None] | None = None) -> SaveHandle:
        """Save `step`; `after_commit(name)` runs once it is committed, on every rank, where
        the commit ran (in the background for an async save: memory tiers share, retain and
        drain there, statereg/tiers/engine.py).

        A sync save runs with Python's cyclic garbage collector paused: the caller waits on
        it, and a save of 20,000 small tensors allocates objects that live until it ends,
        whose full collections (each a pass over the whole heap) cost ~0.5 CPU-s of a 2.5 s
        save (benchmarks/results/journal.md, "Many small tensors"). An async save leaves it
        on: the training loop runs beside its writes."""
        if self.spec.save.async_mode != "off":
            return self._save(plan, adapters, step, tokens_seen, extra, after_commit)
        with gc_paused():
            return self._save(plan, adapters, step, tokens_seen, extra, after_commit)

    def _save(self, plan: RankPlan, adapters: dict[str, Any], step: int,
              tokens_seen: int | None, extra: dict[str, Any] | None,
              after_commit: Callable[[str], None] | None) -> SaveHandle:
        # The manifest reader's own range (MAX_EXACT_INT): past it a committed manifest
        # would be one nobody reads, so it is refused here, before anything is written.
        if not exact_int(step) or step < 0:
            raise SpecError(f"save(step={_shown(step)}): step must be a non-negative int, at "
                            "most 2**64-1")
        if tokens_seen is not None and (not exact_int(tokens_seen) or tokens_seen < 0):
            raise SpecError(f"save(tokens_seen={_shown(tokens_seen)}): tokens_seen must be a "
                            "non-negative int, at most 2**64-1, or None (e.g. int(tokens))")
        started = time.perf_counter()
        self.wait()
        extra = check_extra(extra)
        world = self.world
        captured: list[Captured] = []
        summary = None
        with caught() as reading:
            captured = capture(plan, adapters)
            summary = summarize(self.spec, captured, world.size, plan, adapters)
        # One collective: every rank's failure, declaration digest and replica digests.
        summaries = world.gather_checked(summary, reading.error,
                                         f"save of step {step}: reading state")
        check_consistency(world, self.spec, captured, summaries)
        check_replicas(world, captured, summaries)
        check_copies(plan, summaries)
        url = self.backend.display(checkpoint_name(step))
        nbytes = sum(c.nbytes for c in captured)
        stall: list[float] = []  # the loop's stall, known once save() is about to return
        committed: Future[SaveInfo] = Future()

        def commit(items: list[Captured]) -> str:
            try:
                name = save_checkpoint(self.backend, self.spec, items, step=step,
                                       tokens_seen=tokens_seen, extra=extra, world=world,
                                       plans=self._plans)
                if after_commit is not None:
                    after_commit(name)
            except BaseException as exc:
                committed.set_exception(exc)
                raise
            done = time.perf_counter() - started
            self._announce(committed, SaveInfo(step, url, stall[0] if stall else done,
                                               done, nbytes))
            return name

        if self.spec.save.async_mode == "off":
            commit(captured)
            return SaveHandle(url, committed=committed)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="statereg-save")
        if not self.spec.save.early_return:
            staged = self._stage(captured, step)
            stall.append(time.perf_counter() - started)
            self._inflight = self._executor.submit(self._reported, step,
                                                   lambda: commit(staged))
            return SaveHandle(url, committed=committed)
        done: Future[None] = Future()
        mark = mark_loop(captured)  # the copies wait for the loop's work queued until now

        def stage_then_save() -> str:
            try:
                staged = self._stage(captured, step, mark)
            except BaseException as exc:
                done.set_exception(exc)
                raise
            done.set_result(None)
            return commit(staged)

        self._staged = done
        stall.append(time.perf_counter() - started)
        self._inflight = self._executor.submit(self._reported, step, stage_then_save)
        return SaveHandle(url, done, committed)

    def _announce(self, committed: Future[SaveInfo], info: SaveInfo) -> None:
        """Resolve the handle's info and tell the listeners; a listener's failure is logged,
        never the save's (the checkpoint is committed)."""
        committed.set_result(info)
        for listener in self.listeners:
            try:
                listener(info)
            except Exception:
                logger.exception("an on_saved listener failed for step %d (the checkpoint "
                                 "is committed)", info.step)

    def _reported(self, step: int, work: Callable[[], str]) -> str:
        """Run a background save; a failure is logged at once, naming the step and the time,
        and the next wait() or save() re-raises it with the same words attached."""
        started = time.time()
        try:
            return work()
        except BaseException as exc:
            failed = time.time()
            when = time.strftime("%H:%M:%S", time.localtime(failed))
            self._failure = (f"raised by the background save of step {step}, which started "
                             f"{failed - started:.1f} s before it failed at {when}", failed)
            logger.error("the background save of step %d failed at %s: %s", step, when, exc)
            raise

    def _stage(self, captured: list[Captured], step: int, mark: LoopMark | None = None,
               ) -> list[Captured]:
        """Copy the tensors into the staging buffers; a failure on any rank fails every rank."""
        staged = None
        with caught() as copying:
            staged = self._staging.stage(captured, mark)
        self.world.agree(copying.error, f"save of step {step}: copying state to host buffers")
        return staged

    def wait_staged(self) -> None:
        """Block until the pending save's copy to host buffers is done; re-raise its failure."""
        if self._staged is not None:
            self._staged.result()

    def wait(self) -> None:
        """Block until the pending background save is committed; re-raise its failure."""
        inflight, self._inflight, self._staged = self._inflight, None, None
        if inflight is None:
            return
        try:
            inflight.result()
        except BaseException as exc:
            if self._failure is not None:
                note, failed = self._failure
                self._failure = None
                add_note = getattr(exc, "add_note", None)  # Python 3.11+
                if add_note is not None:
                    add_note(f"{note} ({time.time() - failed:.1f} s ago)")
            raise

    def close(self) -> None:
        """Wait for a pending save and stop the background thread."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown()
                self._executor = None


def _shown(value: Any) -> str:
    """repr(value), except for an int too long to print (int_text)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return int_text(value)
    return repr(value)
