"""CheckpointManager: the facade a training loop talks to (save, wait, load, attach, list)."""

from __future__ import annotations

import builtins
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from statereg.backends.base import StorageBackend
from statereg.backends.registry import open_backend, url_scheme
from statereg.dcp.metadata import gc_paused
from statereg.declaration import load_spec
from statereg.engine.by_url import split_checkpoint_url
from statereg.engine.cadence import Cadence, CadenceReport
from statereg.engine.checkpoints import (
    Committed,
    checkpoint_name,
    latest_committed,
    list_committed,
    read_manifest_at,
    scan_root,
    step_key,
    step_of,
)
from statereg.engine.listing import CheckpointInfo
from statereg.engine.load import LoadResult, load_checkpoint, select_components
from statereg.engine.plan import RankPlan, check_live_sharing, compile_plan
from statereg.engine.resume import CopySource, Rung, climb
from statereg.engine.retention import best_checkpoints
from statereg.engine.saver import SaveHandle, SaveInfo, Saver
from statereg.engine.verify import VerifyMode
from statereg.engine.world import World
from statereg.errors import (
    CheckpointDeletedError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    SpecError,
    StateregError,
    StorageError,
)
from statereg.interop import ForeignKind, detect_foreign, load_foreign
from statereg.schemas.spec import RegistrySpec
from statereg.state.factory import build_adapters, check_objects
from statereg.state.protocols import TensorState
from statereg.tiers.engine import TierEngine
from statereg.tiers.signals import SignalGuard

logger = logging.getLogger(__name__)


def _lint(spec: RegistrySpec, adapters: dict[str, Any], rank: int) -> None:
    """Refuse, before any collective, a live object whose layout contradicts its declaration
    (tensors sharded across ranks in a component declared as one copy); say once (rank 0)
    which buffers a `trainable_only` model leaves out of its checkpoints."""
    for name, adapter in adapters.items():
        if not isinstance(adapter, TensorState):
            continue
        check_live_sharing(name, spec.components[name], adapter.sharded_keys())
        left_out = adapter.unsaved_buffers()
        if left_out and rank == 0:
            more = f" and {len(left_out) - 3} more" if len(left_out) > 3 else ""
            logger.warning(
                "component %r (trainable_only): its %d buffer(s) (%s%s) are not saved, and a "
                "load leaves them as the model holds them. If training changes them "
                "(BatchNorm's running statistics in train mode), a resume is not exact: keep "
                "those layers in eval mode, or declare trainable_only: false",
                name, len(left_out), ", ".join(left_out[:3]), more)


def _same_store(url: str, own: str) -> bool:
    """Whether `url` is on the run's own store: the same scheme and, for a remote one, the
    same bucket or container, so the same endpoint and credentials apply. Another bucket
    may be another account's or another endpoint's: it never gets the run's options."""
    scheme = url_scheme(url)
    if scheme != url_scheme(own):
        return False
    if scheme in ("", "file", "memory", "shm"):
        return True
    return url.partition("://")[2].split("/", 1)[0] == own.partition("://")[2].split("/", 1)[0]


@dataclass(frozen=True)
class _DeferredLoad:
    """Where a deferred component's tensors come from when attach() gives its object."""

    backend: StorageBackend
    committed: Committed
    strict: bool
    verify: VerifyMode

    def __hash__(self) -> int:
        return hash((id(self.backend), self.committed.name))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _fallback_failed(backend: StorageBackend, tried: list[tuple[str, StateregError]],
                     ) -> CorruptCheckpointError:
    """The error of a resume that fell back past a damaged newest checkpoint and found no
    older one to use: the newest's damage first, then why each older one was not used."""
    (newest, damage), *older = tried
    reasons = "; ".join(f"{backend.display(name)}: {_first_line(exc)}" for name, exc in older)
    return CorruptCheckpointError(
        f"{backend.display(newest)} is damaged ({_first_line(damage)}), and no older "
        f"checkpoint could be loaded instead ({reasons}). Nothing to resume from: repair "
        "the damaged checkpoint, or load an older one by step with the components it holds "
        "(exclude=[...])"
    )


class DurableCopies:
    """storage.url's committed checkpoints, newest step first: the last source of a resume
    (engine/resume.py). A damaged one is passed over for the next older intact one; one
    deleted while loading, for the newest there now. An older one that cannot be used
    either (damaged too, lacking a declared component, deleted meanwhile) ends the resume
    with one error naming the newest one's damage first, then why each older one was not
    used (docs/reliability.md, "When a load fails")."""

    def __init__(self, mgr: CheckpointManager) -> None:
        self._mgr = mgr
        self._passed: list[tuple[str, StateregError]] = []  # damaged ones, newest first

    def after(self, failed: Rung | None, error: StateregError | None) -> Rung | None:
        if failed is None or isinstance(error, CheckpointDeletedError):
            found = self._mgr._resolve(None, None)  # the newest now
            return None if found is None else Rung(*found)
        older = self._mgr._older_intact(failed.committed)
        return None if older is None else Rung(failed.backend, older)

    def skip(self, failed: Rung, error: StateregError) -> tuple[str, str]:
        name, backend = failed.committed.name, failed.backend
        if isinstance(error, CheckpointDeletedError):
            if self._passed:  # the one we fell back to went: say so, after the damage
                raise _fallback_failed(backend, [*self._passed, (name, error)]) from error
            return f"{backend.display(name)} was deleted while loading", ""
        if isinstance(error, CorruptCheckpointError):
            self._passed.append((name, error))
            return (f"{backend.display(name)} is damaged ({error})",
                    f" (the run's save of step {failed.committed.step} re-verifies it and, "
                    "damaged, replaces it)")
        if not self._passed:
            # The listing may have passed over damaged newer checkpoints already (a file
            # missing or of another size): the caller needs their damage first.
            self._passed = self._mgr.world.from_leader(self._mgr._damage_above, name)
        if not self._passed:
            raise error
        # An older checkpoint we fell back to cannot be used (e.g. it lacks a component):
        # the error the caller needs first is the newest one's damage.
        raise _fallback_failed(backend, [*self._passed, (name, error)]) from error

    def exhausted(self, failed: Rung, error: StateregError) -> None:
        if isinstance(error, CheckpointDeletedError):
            return  # none left since: a fresh start
        if len(self._passed) == 1:
            raise error
        raise _fallback_failed(failed.backend, self._passed) from error


class CheckpointManager:
    """Saves and restores the declared components of one training run.

    Keyword arguments are the live objects, named by their component keys in the spec.
    Under torch.distributed, construct it on every rank, in the same order as other
    collectives; `groups` names the process groups of `per_group` components.
    """

    def __init__(self, spec: RegistrySpec | str | os.PathLike[str] | dict[str, Any], *,
                 groups: dict[str, Any] | None = None, **objects: Any) -> None:
        self.spec = spec if isinstance(spec, RegistrySpec) else load_spec(spec)
        check_objects(self.spec, objects, initial=True)
        self.world = World.detect(groups)
        self._objects = dict(objects)
        self._adapters = build_adapters(self.spec, self._objects)
        _lint(self.spec, self._adapters, self.world.rank)
        self._backend = open_backend(self.spec.storage.url, self.spec.storage.options,
                                     self.spec.storage.read_cache)
        self.plan: RankPlan = compile_plan(self.spec, self.world.layout, self._backend.url,
                                           store=self._backend.capabilities)
        self._pending: dict[str, Any] = {}
        # Loaded components whose tensors load in place, waiting for attach(): where from.
        self._deferred: dict[str, _DeferredLoad] = {}
        # Components a failed load may have left half-overwritten, and why: save() refuses
        # while any remains; a load that restores them clears them.
        self._damaged: dict[str, str] = {}
        self._saver = Saver(self.spec, self._backend, self.world)
        # With `tiers:`, saves go to memory and drain to storage.url (docs/tiers.md).
        self._tiers = (None if self.spec.tiers is None
                       else TierEngine(self.spec, self._backend, self.world, self._adapters))
        # on_signal: finish the save in flight, flush to storage.url, exit (docs/tiers.md).
        self._signals = SignalGuard.install(self, self._saver, self._tiers)
        self._cadence = Cadence(self.spec.save)
        self.last_saved: SaveInfo | None = None
        self._saver.listeners.append(self._note_saved)

    # -- saving -------------------------------------------------------------------------

    def save(self, step: int, tokens_seen: int | None = None,
             extra: dict[str, Any] | None = None) -> SaveHandle:
        """Save every attached component as checkpoint `step`; returns its URL (a SaveHandle).

        With `tiers:`, only the tiers due at `step` save (memory every tiers.memory.every
        steps, drained in the background every tiers.durable.every): the URL is the memory
        checkpoint's, and when no tier is due the handle is empty (false, `handle.due` is
        False) and nothing was saved (docs/tiers.md).

        With `save.async: thread` this returns once the state is copied to host memory;
        the write and commit run in the background (see `wait`). With `save.early_return`
        the copy runs in the background too: call `wait_staged()` before changing the state.
        Refused while a failed load may have left components half-overwritten (see load()).
        """
        if self._signals is None:
            return self._save(step, tokens_seen, extra)
        with self._signals.saving():  # a signal during the save is acted on after it
            return self._save(step, tokens_seen, extra)

    def _save(self, step: int, tokens_seen: int | None,
              extra: dict[str, Any] | None) -> SaveHandle:
        if self._damaged:
            names = ", ".join(sorted(self._damaged))
            raise StateregError(
                f"save(step={step}) refused: {next(iter(self._damaged.values()))}, so "
                f"{names} may hold a mix of old and loaded values. Saving them would "
                f"checkpoint damaged state; a load that restores {names} succeeds clears this "
                "(mgr.load() resumes from the newest intact checkpoint)"
            )
        if self._deferred or self._pending:
            waiting = ", ".join(sorted({*self._deferred, *self._pending}))
            logger.warning("save(step=%s): %s loaded from a checkpoint but not attached yet, so "
                           "not in this checkpoint; call mgr.attach(...) before saving", step,
                           waiting)
        clock = self._cadence.clock
        started = clock()
        if self._tiers is not None:
            handle = self._tiers.save(self.plan, self._adapters, step, tokens_seen, extra)
        else:
            handle = self._saver.save(self.plan, self._adapters, step, tokens_seen, extra)
        if handle is None:
            return SaveHandle.not_due(step)
        self._cadence.saved(step, clock() - started)
        return handle

    def should_save(self, step: int) -> bool:
        """Whether the declared cadence (save.every_steps, every_seconds, every: auto) says
        to save at `step`. Under torch.distributed, call it on every rank at every step: with
        a time-based cadence rank 0's clock decides and every rank receives its answer (one
        small broadcast), so all ranks save the same steps."""
        due = self._cadence.due(step)
        if self._cadence.by_time and self.world.size > 1:
            due = bool(self.world.broadcast(due))
        if due and self.spec.save.every == "auto" and self.world.rank == 0:
            logger.info("every: auto: %s", self._cadence.report())
        return due

    @property
    def cadence(self) -> CadenceReport:
        """The interval `save.every: auto` uses now: stall, MTBF, expected goodput."""
        return self._cadence.report()

    def on_saved(self, listener: Callable[[SaveInfo], None]) -> None:
        """Call `listener(info)` after each committed save, on every rank: with `save.async`,
        on the save's background thread. `info` has step, url, stall_s, committed_s and
        bytes (e.g. for a tracker); a listener's failure is logged, not raised."""
        self._saver.listeners.append(listener)

    def _note_saved(self, info: SaveInfo) -> None:
        self.last_saved = info

    def wait_staged(self) -> None:
        """Block until the pending save's copy to host buffers is done; re-raise its failure.

        Only `save.early_return` leaves a copy running after save() returns; the loop must
        call this (or `wait_staged()` on the handle) before it changes parameters or
        optimizer state. A failure is raised again by the next `wait()` or `save()`.
        """
        self._saver.wait_staged()

    def wait(self) -> None:
        """Block until the pending background save is committed; re-raise its failure.

        With `tiers:`, also until the drain in flight is committed to storage.url."""
        self._saver.wait()
        if self._tiers is not None:
            self._tiers.wait()

    # -- loading ------------------------------------------------------------------------

    def _backend_for(self, root: str, options: dict[str, Any] | None = None,
                     ) -> StorageBackend:
        """The store of a checkpoint URL's `root`: this run's own backend for a URL under
        storage.url; another root opens with `options` (load(storage_options=...)), else
        with the run's storage.options if it is on the run's own store (same scheme and
        bucket), else with none (the environment's defaults). The run's storage.options are
        never sent to another store: they may be another account's, another endpoint's, or
        credentials meant for this store only."""
        read_cache = self.spec.storage.read_cache
        if options is not None:
            return open_backend(root, options, read_cache)
        if root.rstrip("/") == self._backend.url.rstrip("/"):  # as list() names them
            return self._backend
        candidate = open_backend(root, self.spec.storage.options
                                 if _same_store(root, self._backend.url) else {}, read_cache)
        if (type(candidate), candidate.root) == (type(self._backend), self._backend.root):
            return self._backend
        return candidate

    def _resolve(self, path: str | os.PathLike[str] | None, step: int | None,
                 options: dict[str, Any] | None = None,
                 ) -> tuple[StorageBackend, Committed] | None:
        """The checkpoint to load and its manifest. Collective: rank 0 lists the root and reads
        the manifest (and manifest.sum), every rank receives them, so the job reads them once
        and all ranks load the same checkpoint even if one is committed meanwhile."""
        if path is not None and step is not None:
            raise SpecError("load: pass a path or a step, not both")
        if path is None or step is not None or step_of(os.fspath(path)) is not None:
            backend = self._backend
            found = self.world.from_leader(self._find_here, path, step)
            return None if found is None else (backend, found)
        root, name = split_checkpoint_url(os.fspath(path))
        backend = self._backend_for(root, options)
        try:
            manifest = self.world.from_leader(read_manifest_at, backend, name)
        except StorageError as exc:
            if (backend is self._backend or options is not None
                    or _same_store(root, self._backend.url)):
                raise
            raise StorageError(
                f"{exc}. {root} is not on this run's store ({self._backend.url}), so the "
                "run's storage.options were not used for it: pass its own with "
                "mgr.load(url, storage_options={...})"
            ) from exc
        return backend, Committed(name, manifest)

    def _find_here(self, path: str | os.PathLike[str] | None, step: int | None,
                   ) -> Committed | None:
        """What _resolve finds under this job's root (run by rank 0 alone)."""
        if step is not None:
            name = checkpoint_name(step)
            try:
                return Committed(name, read_manifest_at(self._backend, name))
            except CheckpointNotFoundError:
                have = [str(c.step) for c in list_committed(self._backend)]
                raise CheckpointNotFoundError(
                    f"step {step} has no committed checkpoint in {self._backend.url}; committed "
                    f"steps: {', '.join(have) or 'none'}"
                ) from None
        if path is None:
            return latest_committed(self._backend)
        text = os.fspath(path)  # a bare checkpoint name under our root
        return Committed(text, read_manifest_at(self._backend, text))

    def _foreign(self, path: str | os.PathLike[str], options: dict[str, Any] | None = None,
                 ) -> tuple[StorageBackend, str, ForeignKind] | None:
        """A directory without a manifest that holds safetensors files or plain DCP."""
        text = os.fspath(path)
        if step_of(text) is not None:
            return None
        root, name = split_checkpoint_url(text)
        backend = self._backend_for(root, options)
        kind = detect_foreign(backend, name)
        return None if kind is None else (backend, name, kind)

    def load(self, path: str | os.PathLike[str] | None = None, *, step: int | None = None,
             exclude: list[str] | None = None, include: list[str] | None = None,
             profile: str | None = None, strict: bool = True, verify: VerifyMode = "fast",
             storage_options: dict[str, Any] | None = None) -> LoadResult | None:
        """Restore a checkpoint (default: the latest committed one); None if there is none.

        `exclude`/`include`/`profile` choose components (e.g. a fine-tune loads the model
        only); `strict=False` loads the model keys that match and ignores the rest.
        `path` may also be a directory without a statereg manifest (docs/formats.md): a
        Hugging Face safetensors directory fills the model component; a plain DCP checkpoint
        fills the components named in `include`. Such a result has `verified=False`.

        Every byte is checked against the manifest as it is read (`verify="fast"`, the
        default; "full" also checks every file first; "off" checks only the manifest). Tensors
        stream into live memory, so a damaged item may fail the load after some components
        were overwritten: a resume (no path, no step) then loads the next older intact
        copy, memory ones first with tiers (engine/resume.py, one warning per copy skipped),
        which overwrites them all again; otherwise the error is raised and save()
        refuses until a load restores those components (docs/reliability.md).

        `storage_options`: fsspec options for a `path` outside this run's root (e.g. the
        pre-training run's bucket, on another endpoint or with other credentials). Such a
        path never gets the run's own storage.options; without `storage_options` it opens
        with the environment's defaults (docs/fine-tuning.md).
        """
        if storage_options is not None and (path is None or step is not None):
            raise SpecError("load(storage_options=...) is for a path outside this run's root; "
                            "this run's own checkpoints use storage.options")
        if verify not in ("off", "fast", "full"):
            raise SpecError(f"load(verify={verify!r}): use 'off', 'fast' or 'full'")
        exclude = list(exclude or [])
        if profile is not None:
            if profile not in self.spec.profiles:
                raise SpecError(
                    f"load(profile={profile!r}): no such profile; declared profiles: "
                    f"{', '.join(self.spec.profiles) or 'none'}"
                )
            chosen = self.spec.profiles[profile]
            exclude += chosen.exclude
            include = include or chosen.include
        self.wait()
        # The caller waits on the load: Python's cyclic garbage collector is paused. A load
        # of 20,000 small tensors allocates ~10 objects an item that live until it ends, and
        # the full collections they set off, each a pass over the whole heap, cost
        # 0.5-1.2 CPU-s of a 3-4 s load (benchmarks/results/journal.md, "Many small
        # tensors"); what it frees by reference counting is freed as ever.
        with gc_paused():
            return self._load(path, step, include, exclude, strict, verify, storage_options)

    def _load(self, path: str | os.PathLike[str] | None, step: int | None,
              include: list[str] | None, exclude: list[str], strict: bool, verify: VerifyMode,
              storage_options: dict[str, Any] | None) -> LoadResult | None:
        """`load` once its arguments are checked and any async save is done."""

        def load(backend: StorageBackend, committed: Committed) -> LoadResult:
            return self._load_committed(backend, committed, include, exclude, strict, verify)

        if path is None and step is None:  # a resume: the ladder, memory copies first
            sources: list[CopySource] = [] if self._tiers is None else [self._tiers.copies()]
            result = climb([*sources, DurableCopies(self)], load)
            if result is None and self.world.rank == 0:
                logger.info("no checkpoint under %s: starting fresh", self._backend.url)
            return result
        try:
            resolved = self._resolve(path, step, storage_options)
        except CheckpointNotFoundError:
            foreign = None if path is None else self._foreign(path, storage_options)
            if foreign is None:
                raise
            kinds = {name: comp.kind for name, comp in self.spec.components.items()}
            return load_foreign(*foreign, kinds, self._adapters, include, exclude,
                                self.world, strict)
        if resolved is None:
            return None
        return load(*resolved)  # the caller named this checkpoint: its error is raised

    def _load_committed(self, backend: StorageBackend, committed: Committed,
                        include: list[str] | None, exclude: list[str], strict: bool,
                        verify: VerifyMode) -> LoadResult:
        """One load; a failure after live objects were modified marks them damaged."""
        names = select_components(self.spec.components, committed, include, exclude)
        touched: set[str] = set()
        try:
            result, pending = load_checkpoint(backend, committed, self.spec, self._adapters,
                                              names, self.world, strict=strict, verify=verify,
                                              touched=touched)
        except BaseException as exc:
            why = (f"loading {backend.display(committed.name)} failed "
                   f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}) "
                   "after it had started to overwrite them")
            self._damaged.update(dict.fromkeys(touched, why))
            raise
        for name in names:
            self._damaged.pop(name, None)
            self._pending.pop(name, None)
            self._deferred.pop(name, None)
        self._pending.update(pending)
        source = _DeferredLoad(backend, committed, strict, verify)
        self._deferred.update(dict.fromkeys(result.deferred, source))
        return result

    def _damage_above(self, name: str) -> list[tuple[str, StateregError]]:
        """The damaged checkpoints of higher steps than `name` that a resume passed over,
        newest first, each with its damage (run by rank 0 alone)."""
        limit = step_of(name) or 0
        scan = scan_root(self._backend, check_files=True)
        found: dict[str, StateregError] = {**scan.damaged}
        found.update((n, e) for n, e in scan.unreadable.items() if isinstance(e, StateregError))
        newer = [n for n in found if (step_of(n) or 0) > limit]
        return [(n, found[n]) for n in sorted(newer, key=step_key, reverse=True)]

    def _older_intact(self, damaged: Committed) -> Committed | None:
        """The newest committed checkpoint below `damaged`'s step (rank 0 lists and reads its
        manifest; every rank receives it)."""
        return self.world.from_leader(self._older_here, damaged.name)

    def _older_here(self, damaged: str) -> Committed | None:
        limit = step_of(damaged)
        older = [c for c in list_committed(self._backend)
                 if limit is not None and (step_of(c.name) or 0) < limit]
        return older[-1] if older else None

    def attach(self, **objects: Any) -> None:
        """Give objects built after load(); what that load read for them is applied now.

        Any component may come late (declare it `required: false`): state held for an
        object component is applied at once; a tensor component (model, optimizer, format
        dcp...) is read now from the checkpoint load() chose, with the same verification,
        on every rank (so under torch.distributed, call attach() on every rank, as load()).
        """
        check_objects(self.spec, objects, initial=False)
        self._objects.update(objects)
        self._adapters = build_adapters(self.spec, self._objects)
        _lint(self.spec, {n: a for n, a in self._adapters.items() if n in objects},
              self.world.rank)
        for name in objects:
            if name in self._pending:
                adapter = self._adapters[name]
                adapter.restore(self._pending[name])  # type: ignore[union-attr]
                del self._pending[name]
        due: dict[_DeferredLoad, list[str]] = {}
        for name in self.spec.components:  # declaration order: the same on every rank
            if name in objects and name in self._deferred:
                due.setdefault(self._deferred[name], []).append(name)
        for source, names in due.items():
            # Clears them from _deferred once applied; a failure leaves them waiting.
            self._load_committed(source.backend, source.committed, names, [], source.strict,
                                 source.verify)

    def attached(self, name: str) -> bool:
        """Whether component `name` has its live object (rng always has)."""
        if name not in self.spec.components:
            raise SpecError(f"attached({name!r}): not a declared component; declared: "
                            f"{', '.join(self.spec.components)}")
        return name in self._adapters

    @property
    def awaiting_attach(self) -> tuple[str, ...]:
        """Components a load read state for whose object has not been attached yet."""
        return tuple(n for n in self.spec.components if n in self._deferred or n in self._pending)

    # -- listing ------------------------------------------------------------------------

    def latest(self) -> str | None:
        """URL of the latest committed checkpoint, or None.

        Not collective (a rank may call it alone): the calling rank lists the root itself."""
        self.wait()
        found = latest_committed(self._backend)
        return None if found is None else self._backend.display(found.name)

    def list(self) -> list[str]:
        """URLs of every committed checkpoint, oldest first (not collective, as latest())."""
        self.wait()
        return [self._backend.display(c.name) for c in list_committed(self._backend)]

    def best(self) -> builtins.list[str]:
        """URLs of the checkpoints `save.keep_best` keeps, best first."""
        self.wait()
        chosen = best_checkpoints(list_committed(self._backend), self.spec.save)
        return [self._backend.display(c.name) for c in chosen]

    def load_best(self, **options: Any) -> LoadResult | None:
        """Load the best checkpoint by `save.keep_best`'s metric (as load() with its path);
        None when the root holds no checkpoint. `options` are load()'s (exclude, profile...).
        Collective under torch.distributed: rank 0 chooses, every rank loads the same one."""
        rule = self.spec.save.keep_best
        if rule is None:
            raise SpecError("load_best(): no 'save.keep_best' is declared, so no metric says "
                            "which checkpoint is best; add keep_best: {metric: NAME}")
        self.wait()
        chosen = self.world.from_leader(self._best_here)
        return None if chosen is None else self.load(chosen, **options)

    def _best_here(self) -> str | None:
        committed = list_committed(self._backend)
        best = best_checkpoints(committed, self.spec.save)
        if best:
            return best[0].name
        if committed:
            rule = self.spec.save.keep_best
            assert rule is not None
            raise CheckpointNotFoundError(
                f"load_best(): no checkpoint in {self._backend.url} records the metric "
                f"{rule.metric!r} in extra (pass it as save(..., extra={{{rule.metric!r}: "
                "value}})); load one by step instead"
            )
        return None

    def peek(self, url: str | os.PathLike[str] | None = None, *, step: int | None = None,
             storage_options: dict[str, Any] | None = None) -> CheckpointInfo | None:
        """Step, tokens and extra of a checkpoint (default: latest; or `url`, or `step` in this
        run's root, as load() takes them) without loading tensors. A `step` that has no
        committed checkpoint raises CheckpointNotFoundError naming the committed steps.

        Collective under torch.distributed, as load() is: rank 0 reads the manifest and every
        rank receives it (call it on every rank)."""
        self.wait()
        resolved = self._resolve(url, step, storage_options)
        if resolved is None:
            return None
        backend, committed = resolved
        return CheckpointInfo.of(committed.manifest, backend.display(committed.name))

    # -- lifetime -----------------------------------------------------------------------

    def close(self) -> None:
        """Wait for a pending save (and drain), stop the background threads, and end the
        process groups statereg made (their gloo threads with them).

        Call it on every rank before `dist.destroy_process_group()` (leaving the `with`
        block does): a manager never closed keeps its groups' threads running into
        interpreter exit, where they can abort the process (docs/distributed.md, "Shutting
        down"). Not a collective: a rank leaving on an error waits for no other. Under
        torch.distributed the manager cannot save or load afterwards; a new one can.
        """
        try:
            try:
                if self._tiers is not None:
                    self._tiers.close()
            finally:
                try:
                    self._saver.close()
                finally:
                    if self._signals is not None:  # after the drain: a signal meanwhile flushes
                        self._signals.uninstall()
        finally:
            self.world.release()  # last: nothing of statereg's runs a collective after it

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
