"""Execute a load in two phases: check and prepare every selected component, then apply.

The load plan (engine/plan.py `compile_load`) is compiled from the manifest's record of what
was saved and the live declaration, and refuses every mismatch at once, before anything is
read. Nothing live is modified until every component has been checked against the
checkpoint, so a mismatch in one component leaves all of them as they were.

Under torch.distributed a load reads each stored byte once per job: the manifest and the
size check by rank 0, what every rank of a collective needs alike by one of its ranks,
broadcast over the gloo group (docs/distributed.md, "Loads read each stored byte once").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from statereg.backends.base import StorageBackend
from statereg.backends.stores import ReadableStore
from statereg.backends.verified import VerifiedReads
from statereg.engine.checkpoints import Committed
from statereg.engine.io_policy import storage_policy
from statereg.engine.layouts import LAYOUTS, KeyReport, ReadContext
from statereg.engine.plan import LoadTask, Saved, compile_load
from statereg.engine.report import Progress, describe_rate
from statereg.engine.verify import VerifyMode, verify_files
from statereg.engine.world import World, caught
from statereg.errors import (
    CheckpointDeletedError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    SpecError,
)
from statereg.schemas.manifest import MANIFEST_NAME, FileRecord, Manifest
from statereg.schemas.spec import RegistrySpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadResult:
    """What a load restored, and the bookkeeping saved with it."""

    step: int
    tokens_seen: int | None
    extra: dict[str, Any]
    path: str
    components: tuple[str, ...]
    # False for a foreign source (Hugging Face directory, plain DCP): no manifest, no checksums.
    verified: bool = True
    keys: dict[str, KeyReport] = field(default_factory=dict)  # per tensor component
    # Components without an object yet whose tensors load in place: checked now, read from
    # this checkpoint when mgr.attach() gives their object.
    deferred: tuple[str, ...] = ()


def select_components(declared: Iterable[str], committed: Committed, include: list[str] | None,
                      exclude: list[str]) -> list[str]:
    """The declared components to load: `include` (default all) minus `exclude`."""
    declared = list(declared)
    for name in [*(include or []), *exclude]:
        if name not in declared:
            raise SpecError(
                f"load: {name!r} is not a declared component; declared: {', '.join(declared)}"
            )
    chosen = [n for n in (include or declared) if n not in exclude]
    absent = [n for n in chosen if n not in committed.manifest.components]
    if absent:
        raise CheckpointMismatchError(
            f"{committed.name} has no component {', '.join(map(repr, absent))} (it holds "
            f"{', '.join(committed.manifest.components)}); pass exclude={absent!r} to load the rest"
        )
    return chosen


def read_records(manifest: Manifest, name: str, names: Iterable[str]) -> dict[str, FileRecord]:
    """The files a load of components `names` may read, by path from the root: the
    checkpoint's own and every file it references (incremental items)."""
    selected = {p for n in names for p in manifest.components[n].files}
    records = {f"{name}/{f.path}": f for f in manifest.files if f.path in selected}
    records.update((f.path, f) for f in manifest.references)
    return records


def _verify_share(backend: StorageBackend, committed: Committed, files: list[FileRecord],
                  mode: VerifyMode, world: World) -> None:
    """fast: rank 0 checks every file's size from one listing of the checkpoint and tells
    the others (a listing per rank would be N requests for the same answer); full: each rank
    reads and checks every world.size-th file, so the reading is spread over the ranks."""
    if mode == "fast":
        world.from_leader(_verify_files_of, backend, committed, files, mode)
        return
    _verify_files_of(backend, committed, files[world.rank::world.size], mode,
                     committed.manifest.references[world.rank::world.size])


def _verify_files_of(backend: StorageBackend, committed: Committed, files: list[FileRecord],
                     mode: VerifyMode, references: list[FileRecord] | None = None) -> None:
    verify_files(backend, committed.name, files, mode)
    verify_files(backend, "", committed.manifest.references if references is None
                 else references, mode)


def missing_as_damage(error: BaseException | None, where: str) -> BaseException | None:
    """`error`, except that a file the manifest lists but the store lacks (FileNotFoundError,
    also inside DCP's CheckpointException) is a CorruptCheckpointError naming it: the
    checkpoint is damaged, so a resume falls back past it. Without this, a load that reads
    without checking sizes first (verify="off", export-hf) raised the bare OSError."""
    if error is None:
        return None
    own = error
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        own = first[0] if isinstance(first, tuple) and isinstance(first[0], BaseException) \
            else error
    if not isinstance(own, FileNotFoundError) or isinstance(own, CheckpointNotFoundError):
        return error
    damage = CorruptCheckpointError(
        f"{where}: file {own.filename or own}, which the manifest lists, is missing; the "
        "checkpoint is damaged: load an earlier one"
    )
    damage.__cause__ = own
    return damage


def _agree_unless_deleted(backend: StorageBackend, name: str, world: World,
                          error: BaseException | None, what: str) -> None:
    """world.agree, except that a failure because the checkpoint vanished under the load (most
    often another process's retention) is a CheckpointDeletedError on every rank, never a raw
    FileNotFoundError or a claim that the checkpoint is damaged; a file missing from a
    checkpoint that is still there is damage (missing_as_damage)."""
    error = missing_as_damage(error, what)
    try:
        world.agree(error, what)
    except BaseException as exc:
        # Every rank is here (agree raised on all): rank 0 looks, every rank hears.
        gone = not backend.exists(f"{name}/{MANIFEST_NAME}") if world.rank == 0 else None
        if world.broadcast(gone):
            raise CheckpointDeletedError(
                f"{backend.display(name)} was deleted while it was being loaded (most often by "
                "another process's retention: keep_last); load it again to use the newest "
                "checkpoint, or give this job its own root"
            ) from exc
        raise


def load_checkpoint(backend: StorageBackend, committed: Committed, spec: RegistrySpec,
                    adapters: dict[str, Any], names: list[str], world: World,
                    strict: bool = True, verify: VerifyMode = "fast",
                    touched: set[str] | None = None,
                    ) -> tuple[LoadResult, dict[str, Any]]:
    """Load `names` from a committed checkpoint into their adapters, on every rank.

    Returns the result and the states of components whose objects are not attached yet.
    Any rank's failure is raised on every rank. Everything read before the apply phase (the
    manifest, DCP metadata, object state, sidecars) is verified before anything is
    modified; tensors stream into live memory and are verified as they arrive, so a damaged
    item can fail the load after some components were modified: `touched` (when given)
    receives, on every rank, the names of the components the apply phase reached, so the
    caller can make that state unusable (CheckpointManager refuses to save it).
    """
    started = time.perf_counter()
    manifest = committed.manifest
    where = backend.display(committed.name)
    # A checkpoint saved under a writer token keeps its components in data_dir(); the plan
    # and the layouts read them there, by paths relative to it.
    plain, data_dir = manifest.without_writer(), manifest.data_dir(committed.name)
    saved = {n: Saved(r.kind, r.sharing, r.format, manifest.world_size, tuple(r.files))
             for n, r in plain.components.items()}
    # Every rank compiles the same tasks from the same manifest, so all agree on a mismatch.
    tasks: dict[str, LoadTask] = {}
    with caught() as compiling:
        tasks = compile_load(spec, saved, names, world.layout, where)
    world.agree(compiling.error, f"checking {where}")
    selected_files = {p for n in names for p in manifest.components[n].files}
    files = [f for f in manifest.files if f.path in selected_files]
    with caught() as verifying:
        _verify_share(backend, committed, files, verify, world)
    _agree_unless_deleted(backend, committed.name, world, verifying.error, f"verifying {where}")
    steps: list[tuple[str, Callable[[], None]]] = []
    pending: dict[str, Any] = {}
    keys: dict[str, KeyReport] = {}
    deferred = [n for n in names
                if adapters.get(n) is None and LAYOUTS[tasks[n].layout].needs_object]

    # Every byte read from here on is checked against the manifest as it is read (whole
    # files by their checksums, DCP items by their digests), unless verify is off.
    records = read_records(plain, data_dir, names) if verify != "off" else None
    reader: ReadableStore = backend if records is None else VerifiedReads(backend, records)
    # Derived now, after a tier's restore located the files (node memory some of whose
    # files are on peers is read once and broadcast).
    io = storage_policy(backend.capabilities, spec.storage)
    ctx = ReadContext(reader, data_dir, world, records, io, strict)

    # Layouts read for their collective once and broadcast (ReadContext.read_once,
    # GroupReader), so ranks agree after each component: a rank that failed alone must not
    # leave the others waiting in the next component's collective.
    for name in (n for n in names if n not in deferred):
        task = tasks[name]
        prepared = None
        with caught() as preparing:
            prepared = LAYOUTS[task.layout].prepare(task, plain.components[name],
                                                    adapters.get(name), ctx)
        _agree_unless_deleted(backend, committed.name, world, preparing.error,
                              f"checking {where} ({name})")
        steps.append((name, prepared.apply))
        if prepared.pending is not None:
            pending[name] = prepared.pending
        if prepared.keys is not None:
            keys[name] = prepared.keys
    nbytes = sum(f.size for f in files)

    with Progress(nbytes, f"load {committed.name}") as progress, torch.no_grad():
        for name, apply in steps:
            if touched is not None:
                touched.add(name)
            with caught() as applying:
                apply()
            _agree_unless_deleted(backend, committed.name, world, applying.error,
                                  f"loading {where} ({name})")
            progress.update(manifest.components[name].bytes)
    elapsed = time.perf_counter() - started
    if world.rank == 0:  # once per job, not once per rank
        logger.info("loaded %s on %d rank(s): %s (%s)", where, world.size,
                    describe_rate(nbytes, elapsed), ", ".join(names))
    result = LoadResult(
        step=manifest.step,
        tokens_seen=manifest.tokens_seen,
        extra=dict(manifest.extra),
        path=backend.display(committed.name),
        components=tuple(names),
        keys=keys,
        deferred=tuple(deferred),
    )
    for name, report in keys.items():
        if (report.missing or report.unexpected) and world.rank == 0:
            logger.warning("loaded %s into %r with strict=False: %s", where, name, report)
    return result, pending
