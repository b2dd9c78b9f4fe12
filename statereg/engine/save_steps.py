"""The steps of one save: capture what the plan says, check it across ranks, write every file
through its layout, then commit.

The async pipeline around these steps (staging, the background thread) is engine/saver.py.
"""

from __future__ import annotations

import json
import logging
import time
from array import array
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal

import torch

from statereg.backends.base import StorageBackend
from statereg.backends.checksum import FileRecorder, WrittenFile, new_hasher
from statereg.dcp.codec import CompressionSettings
from statereg.dcp.reports import ItemReports
from statereg.dcp.writer import WriteReport
from statereg.engine.checkpoints import Committed, checkpoint_name
from statereg.engine.claims import Claim, claim_checkpoint, claim_scope
from statereg.engine.incremental import (
    check_references,
    hold_previous,
    reference_records,
    reuse_index,
)
from statereg.engine.io_policy import storage_policy
from statereg.engine.layouts import LAYOUTS, Captured
from statereg.engine.layouts.dcp import PlannedWriteContext, SavePlans
from statereg.engine.plan import WORLD, RankPlan
from statereg.engine.publish import commit
from statereg.engine.report import Progress, describe_rate
from statereg.engine.retention import apply_retention
from statereg.engine.world import World, caught, describe, raise_own
from statereg.errors import CheckpointMismatchError, SpecError, StateregError
from statereg.schemas.manifest import (
    FORMAT_VERSION,
    MAX_MANIFEST_BYTES,
    MAX_MANIFEST_DEPTH,
    PLAIN_FORMAT_VERSION,
    WRITER_DIR_PREFIX,
    ComponentRecord,
    FileRecord,
    Manifest,
    exact_int,
    int_text,
    nesting_depth,
)
from statereg.schemas.spec import RegistrySpec, StorageSpec
from statereg.version import __version__

logger = logging.getLogger(__name__)


def capture(plan: RankPlan, adapters: dict[str, Any]) -> list[Captured]:
    """The state of every task this rank takes part in. Tensors are referenced, not copied."""
    return [LAYOUTS[task.layout].capture(task, adapters[task.component])
            for task in plan.tasks
            if task.takes_part and task.component in adapters]


def state_digest(spec: RegistrySpec, captured: list[Captured]) -> tuple[str, dict]:
    """A digest of what every rank must agree on: the declaration and the shared key sets."""
    keys = {
        c.task.component: sorted(c.tensors)
        for c in captured
        if c.tensors is not None and c.task.sharing in ("sharded", "replicated")
    }
    hasher = new_hasher()
    hasher.update(json.dumps([redacted_spec(spec), keys], sort_keys=True).encode())
    return hasher.hexdigest(), keys


@dataclass(frozen=True)
class SaveSummary:
    """What one rank tells the others before a save, in one collective: the digest of its
    declaration and shared key sets, one digest per `replicated` component declared with
    validate, and per-key digests of the state that one stored copy stands for on every
    rank (`copies`; engine docs: "one copy is one rank's"). Empty on a single process, which
    has no other copy to compare."""

    state: str
    replicas: dict[str, int]
    copies: dict[str, dict[str, int]] = field(default_factory=dict)
    # Model components whose buffers a DistributedDataParallel broadcasts from rank 0 at
    # every training forward: rank 0's stored copy is the one every rank's next step uses.
    broadcast: tuple[str, ...] = ()


def summarize(spec: RegistrySpec, captured: list[Captured], world_size: int,
              plan: RankPlan | None = None, adapters: dict[str, Any] | None = None,
              ) -> SaveSummary:
    if world_size == 1:
        return SaveSummary(state_digest(spec, captured)[0], {})
    replicas = {comp: _combined(d) for comp, d in _replica_digests(captured).items()}
    copies, broadcast = _copy_digests(captured, plan, adapters or {})
    return SaveSummary(state_digest(spec, captured)[0], replicas, copies, broadcast)


def _copy_digests(captured: list[Captured], plan: RankPlan | None, adapters: dict[str, Any],
                  ) -> tuple[dict[str, dict[str, int]], tuple[str, ...]]:
    """Per component, per key, a digest of the state one stored copy must stand for on every
    rank: a model's buffers (the coordinator writes them) and a global or replicated
    object's state (rank 0 writes it). Every rank digests its own, so a rank whose copy
    differs is found before anything is written."""
    copies: dict[str, dict[str, int]] = {}
    broadcast: list[str] = []
    for item in captured:
        # Over the world only: a named group's copies differ from group to group.
        if item.coordinator_only and item.tensors is not None and item.task.collective == WORLD:
            copies[item.task.component] = {key: _digest(item.tensors[key])
                                           for key in sorted(item.coordinator_only)}
            adapter = adapters.get(item.task.component)
            if getattr(adapter, "buffers_broadcast", lambda: False)():
                broadcast.append(item.task.component)
    for task in plan.tasks if plan is not None else ():
        adapter = adapters.get(task.component)
        if (task.sharing not in ("global", "replicated") or task.kind in ("model", "optimizer")
                or adapter is None or task.layout == "consolidated"):
            continue
        state = adapter.capture()
        state = getattr(state, "tensors", state)
        keys = state.items() if isinstance(state, dict) else [("", state)]
        copies[task.component] = {str(key): _digest(value) for key, value in keys}
    return copies, tuple(broadcast)


def _digest(value: Any) -> int:
    """xxh3_64 of a state value's content: tensors and arrays by their bytes, containers by
    their items, other objects by their type only (their repr may hold addresses)."""
    hasher = new_hasher()
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, torch.Tensor):
            hasher.update(f"T{item.dtype}{tuple(item.shape)}".encode())
            if (type(item) in (torch.Tensor, torch.nn.Parameter) and item.layout == torch.strided
                    and not item.is_quantized and not item.is_nested and item.numel()):
                hasher.update(item.detach().cpu().contiguous().reshape(-1)
                              .view(torch.uint8).numpy())
        elif isinstance(item, dict):
            hasher.update(b"{%d" % len(item))
            for key in sorted(item, key=repr):
                hasher.update(repr(key).encode())
                pending.append(item[key])
        elif isinstance(item, (list, tuple)):
            hasher.update(b"[%d" % len(item))
            pending.extend(reversed(item))
        elif item is None or isinstance(item, (bool, int, float, str, bytes, torch.dtype)):
            hasher.update(repr(item).encode())
        elif hasattr(item, "tobytes") and hasattr(item, "dtype"):  # numpy arrays and scalars
            hasher.update(f"A{item.dtype}{getattr(item, 'shape', ())}".encode())
            hasher.update(item.tobytes())
        else:
            hasher.update(type(item).__qualname__.encode())
    return hasher.intdigest()


def check_copies(plan: RankPlan, summaries: list[SaveSummary]) -> None:
    """One stored copy must stand for every rank's state: refuse, naming the component, key
    and ranks, when the ranks' copies differ and the difference would be lost on a resume.

    A model's buffers that DDP broadcasts from rank 0 may differ (each rank updates its own
    during a forward; the next forward overwrites them with rank 0's): rank 0's are stored.
    """
    first = summaries[0]
    for component, digests in first.copies.items():
        if component in first.broadcast:
            continue
        for key, digest in digests.items():
            differ = [rank for rank, theirs in enumerate(summaries)
                      if theirs.copies.get(component, {}).get(key) != digest]
            if not differ:
                continue
            task = plan.task(component)
            if task.kind == "model":
                raise SpecError(
                    f"component {component!r} (model): buffer {key!r} differs between rank 0 "
                    f"and rank(s) {differ}, and no DistributedDataParallel(broadcast_buffers="
                    "True) makes rank 0's the one every rank uses next, so one stored copy "
                    "would not resume every rank exactly; nothing was saved. Keep the buffers "
                    "equal on every rank (wrap the model in DDP, or use SyncBatchNorm), or "
                    "declare the component sharing: per_rank to store each rank's own"
                )
            shown = f" (at key {key!r})" if key else ""
            raise SpecError(
                f"component {component!r} ({task.kind}) is declared {task.sharing}: one copy, "
                f"rank 0's, restored on every rank; but its state differs between rank 0 and "
                f"rank(s) {differ}{shown}, so the other ranks would resume with rank 0's "
                "values; nothing was saved. Declare it sharing: per_rank to store each rank's "
                "own state, or keep it equal on every rank"
            )


def check_consistency(world: World, spec: RegistrySpec, captured: list[Captured],
                      summaries: list[SaveSummary]) -> None:
    """Every rank must save the same declaration and key sets; else name the rank and keys.

    Mismatched key sets would make DCP's collectives wait forever. `summaries` are every
    rank's; the key sets themselves are exchanged only when the digests differ.
    """
    digests = [summary.state for summary in summaries]
    if len(set(digests)) == 1:
        return
    all_keys = world.all_gather(state_digest(spec, captured)[1])
    problems = []
    for rank, (other, theirs) in enumerate(zip(digests, all_keys, strict=True)):
        if other == digests[0]:
            continue
        diffs = []
        for comp in sorted(set(all_keys[0]) | set(theirs)):
            mine, other_keys = set(all_keys[0].get(comp, [])), set(theirs.get(comp, []))
            if mine != other_keys:
                only = sorted(other_keys - mine)[:5]
                missing = sorted(mine - other_keys)[:5]
                diffs.append(f"{comp}: only on rank {rank}: {only}, missing on rank {rank}: "
                             f"{missing}")
        problems.append(f"rank {rank} differs from rank 0: "
                        + ("; ".join(diffs) if diffs else "the declarations differ"))
    raise SpecError(
        "ranks disagree on what to save (" + " | ".join(problems) + "); every rank must build "
        "the same model and declaration before calling save()"
    )


def _replica_digests(captured: list[Captured]) -> dict[str, dict[str, int]]:
    """xxh3_64 of each tensor's bytes, per `replicated` component declared with validate."""
    digests: dict[str, dict[str, int]] = {}
    for item in captured:
        if not item.task.validate or item.tensors is None:
            continue
        mine = digests.setdefault(item.task.component, {})
        for key, tensor in item.tensors.items():
            # One rank's copy of a model's buffers is stored; check_copies compares them.
            if isinstance(tensor, torch.Tensor) and key not in item.coordinator_only:
                hasher = new_hasher()
                # reshape(-1): a 0-dim tensor (a step count, BatchNorm's counter) has no byte view
                hasher.update(tensor.detach().cpu().contiguous().reshape(-1)
                              .view(torch.uint8).numpy())
                mine[key] = hasher.intdigest()
    return digests


def _combined(digests: dict[str, int]) -> int:
    """One digest of a component's per-tensor digests, in key order."""
    hasher = new_hasher()
    hasher.update(array("Q", (digests[key] for key in sorted(digests))).tobytes())
    return hasher.intdigest()


def check_replicas(world: World, captured: list[Captured],
                   summaries: list[SaveSummary]) -> None:
    """For `replicated` components declared with validate: every rank's copy must be equal.

    `summaries` carry one digest per component and rank; the per-tensor digests (to name the
    tensor) are exchanged only when those differ.
    """
    if all(summary.replicas == summaries[0].replicas for summary in summaries):
        return
    gathered = world.all_gather(_replica_digests(captured))
    for comp, mine in gathered[0].items():
        for key, digest in mine.items():
            differ = [r for r, theirs in enumerate(gathered) if theirs[comp][key] != digest]
            if differ:
                raise CheckpointMismatchError(
                    f"component {comp!r} is declared replicated, but tensor {key!r} differs "
                    f"between rank 0 and rank(s) {differ}; nothing was saved. Synchronize the "
                    "replicas (e.g. broadcast from rank 0; SyncBatchNorm for BatchNorm "
                    "statistics), or declare the component per_rank so that each rank's own "
                    "copy is stored"
                )


def redacted_spec(spec: RegistrySpec) -> dict[str, Any]:
    """The declaration as JSON data, with every storage option value hidden."""
    options = {k: "<redacted>" for k in spec.storage.options}
    storage = spec.storage.model_copy(update={"options": options})
    blank = spec.model_copy(update={"storage": storage})
    return blank.model_dump(mode="json", by_alias=True)


# `extra` may take at most this share of the manifest bound: the rest is for the file list
# and digests, which grow with the model. Checked before any data file is written.
MAX_EXTRA_BYTES = MAX_MANIFEST_BYTES // 4


def check_extra(extra: Any) -> dict[str, Any]:
    """`extra` must be a dict that survives JSON unchanged and that a reader will accept: the
    manifest stores it, and a manifest the reader refuses would be a checkpoint nobody loads.

    Checked before any data file is written, and without recursion (a hostile depth would
    raise RecursionError in json.dumps).
    """
    if extra is None:
        return {}
    if not isinstance(extra, dict):
        raise SpecError(
            f"save(extra=...) must be a dict of JSON values, got {type(extra).__name__}; "
            "e.g. extra={'loss': float(loss)}"
        )
    # The manifest holds `extra` one level below its top: the reader's depth bound, less one.
    if nesting_depth(extra) > MAX_MANIFEST_DEPTH - 1:
        raise SpecError(
            f"save(extra=...) nests lists or dicts more than {MAX_MANIFEST_DEPTH - 1} deep; "
            "a manifest that deep is refused on load: store a flatter summary"
        )
    defect = _unreadable(extra)
    if defect is not None:
        raise SpecError(f"save(extra=...) holds {defect}")
    extra = dict(extra)
    size = 0
    for key, value in extra.items():
        if not isinstance(key, str):
            raise SpecError(f"save(extra=...): key {key!r} must be a string")
        odd = _non_finite(value)
        if odd is not None:
            raise SpecError(
                f"save(extra=...): {key!r} holds the float {odd!r}, which JSON cannot store "
                "(a manifest reader refuses NaN and infinity); pass a finite number, or leave "
                f"{key!r} out of this save's extra (e.g. a loss that diverged)"
            )
        try:
            size += len(json.dumps(value, allow_nan=False)) + len(key) + 4
        except (TypeError, ValueError):
            raise SpecError(
                f"save(extra=...): value of {key!r} ({type(value).__name__}) is not plain JSON; "
                "pass numbers, strings, lists or dicts (e.g. float(loss))"
            ) from None
        if size > MAX_EXTRA_BYTES:
            raise SpecError(
                f"save(extra=...) is over {MAX_EXTRA_BYTES} bytes as JSON (at key {key!r}); "
                f"the manifest that stores it is bounded ({MAX_MANIFEST_BYTES} bytes) so that "
                "every reader can parse it: store large data as a component, not in extra"
            )
    return extra


def _non_finite(value: Any) -> float | None:
    """The first NaN or infinite float in `value` (iterative, as nesting_depth), or None:
    JSON has no such number, so json.dumps refuses it and no manifest could hold it."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, list | tuple):
            pending.extend(item)
        elif isinstance(item, float) and (item != item or abs(item) == float("inf")):
            return item
    return None


def _unreadable(value: Any) -> str | None:
    """What in `value` a manifest reader would not read back as saved (iterative, as
    nesting_depth), or None: an integer outside the range it keeps exactly, or a dict key
    that is not a string (JSON would turn it into one)."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            for key in item:
                if not isinstance(key, str):
                    return (f"the key {int_text(key) if isinstance(key, int) else repr(key)} "
                            "(a dict key that is not a string), which a manifest reader would "
                            "read back as a string; use string keys")
            pending.extend(item.values())
        elif isinstance(item, list | tuple):
            pending.extend(item)
        elif isinstance(item, int) and not isinstance(item, bool) and not exact_int(item):
            return (f"the integer {int_text(item)}, outside the 64-bit range a manifest reader "
                    "keeps exactly; store it as a string")
    return None


def compression_settings(storage: StorageSpec) -> CompressionSettings | None:
    """The codec settings tensor files are written with, or None for uncompressed files."""
    declared = storage.compression
    if declared is None or declared.codec == "none":
        return None
    return CompressionSettings(level=declared.level, threads=declared.threads,
                               float_aware=declared.float_aware)


FileCodec = Literal["none", "zstd", "zstd+planes"]  # FileRecord.codec in the manifest


def file_codec(path: str, settings: CompressionSettings | None) -> FileCodec:
    """What the manifest records for a file: DCP data files carry compressed items."""
    if settings is None or not path.endswith(".distcp"):
        return "none"
    return "zstd+planes" if settings.float_aware else "zstd"


@dataclass
class IncrementalState:
    """One rank's view of an incremental save: what it may reference, what it did reference."""

    previous: Committed | None
    digests: dict[str, str] = field(default_factory=dict)
    referenced: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class RankReport:
    """What one rank sends rank 0 after writing, for the manifest: its files (relative to the
    directory the components were written in), an incremental save's item digests and the
    earlier files it references, and the packed item reports of DCP components written by
    kept plans (rank 0 writes their `.metadata`: layouts/dcp.py SavePlans)."""

    files: list[WrittenFile]
    digests: dict[str, str] = field(default_factory=dict)
    referenced: set[str] = field(default_factory=set)
    item_reports: dict[str, ItemReports] = field(default_factory=dict)


@dataclass(frozen=True)
class SaveRequest:
    """What one save records beside its files: the manifest's step, tokens and extra, and the
    world size it was saved at."""

    step: int
    tokens_seen: int | None
    extra: dict[str, Any]
    world_size: int


def write_components(backend: StorageBackend, name: str, captured: list[Captured],
                     storage: StorageSpec, world: World, progress: Progress,
                     incremental: IncrementalState | None = None,
                     plans: SavePlans | None = None) -> list[WrittenFile]:
    """Write this rank's files of every component through its layout; returns them relative
    to `name`.

    Components that need no collective (one process, or per-rank state) are written at the
    same time: on an object store each component's uploads would otherwise wait for the
    slowest file of the one before. Not where the I/O policy says otherwise
    (`IOPolicy.parallel_components`: in node memory, and compressed on a local disk, writing
    is CPU work that more threads than the writers of one component only time-slice).
    `plans`: the job's kept DCP plans, which components
    whose plans are unchanged write by without a collective (layouts/dcp.py).
    """
    recorder = FileRecorder()
    reuse = None
    if incremental is not None:
        previous = incremental.previous

        def reuse(directory: str) -> Any:
            return reuse_index(backend, previous, directory)

    io = storage_policy(backend.capabilities, storage)
    ctx = PlannedWriteContext(backend, name, world, recorder, compression_settings(storage),
                              io, reuse, plans)

    def write(item: Captured) -> WriteReport | None:
        report = LAYOUTS[item.task.layout].write(item, ctx)
        for path, data in item.blobs.items():
            recorder.add(backend.write_bytes(f"{name}/{path}", data))
        progress.update(item.nbytes)
        return report

    if len(captured) > 1 and io.parallel_components and all(
            world.process_group(item.task.collective) is None for item in captured):
        with ThreadPoolExecutor(len(captured), thread_name_prefix="statereg-component") as pool:
            reports = list(pool.map(write, captured))
    else:
        reports = [write(item) for item in captured]
    if incremental is not None:
        for item, report in zip(captured, reports, strict=True):
            if report is not None:
                incremental.digests.update(
                    {f"{item.task.directory}/{key}": d for key, d in report.digests.items()})
                incremental.referenced |= report.referenced
    prefix = f"{name}/"
    return [WrittenFile(f.path.removeprefix(prefix), f.size, f.checksum) for f in recorder.files()]


def build_manifest(spec: RegistrySpec, captured: list[Captured],
                   files: list[WrittenFile], step: int, tokens_seen: int | None,
                   extra: dict[str, Any], world_size: int,
                   writer: str | None = None) -> Manifest:
    """The manifest of `files` (relative to the directory the components were written in:
    the checkpoint's, or its `writer-<writer>/` directory, which the paths then start with)."""
    compression = compression_settings(spec.storage)
    top = f"{WRITER_DIR_PREFIX}{writer}/" if writer else ""
    components = {}
    for item in captured:
        task = item.task
        prefix = f"{task.component}/"
        mine = [f for f in files if f.path.startswith(prefix)]
        components[task.component] = ComponentRecord(
            kind=task.kind,
            sharing=task.sharing,
            format=task.format,
            files=[top + f.path for f in mine],
            tensors=len(item.tensors or {}),
            bytes=sum(f.size for f in mine),
            meta=item.meta,
        )
    return Manifest(
        # 1.1 unless there is a writer: what a 1.1 reader reads, byte for byte.
        format_version=FORMAT_VERSION if writer else PLAIN_FORMAT_VERSION,
        statereg_version=__version__,
        torch_version=torch.__version__,
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        step=step,
        tokens_seen=tokens_seen,
        extra=extra,
        world_size=world_size,
        spec=redacted_spec(spec),
        components=components,
        files=[FileRecord(path=top + f.path, size=f.size, checksum=f.checksum,
                          codec=file_codec(f.path, compression))
               for f in files],
        writer=writer,
    )


def _check_then_commit(backend: StorageBackend, name: str, manifest: Manifest,
                       claim: Claim | None, previous: Committed | None) -> None:
    """Commit, after checking what the manifest references is still there and intact."""
    if previous is not None and manifest.references:
        check_references(backend, previous, manifest.references)
    commit(backend, name, manifest, claim)


def _retain(backend: StorageBackend, spec: RegistrySpec, name: str) -> list[str]:
    """Apply retention after `name` committed. A failure is a warning, not the save's error:
    the checkpoint is committed, and a raise would tell the caller otherwise (and a retry of
    the step would be refused as already committed). The next save's retention tries again.
    """
    try:
        return apply_retention(backend, spec.save, name)
    except Exception as exc:
        logger.warning("%s is committed, but retention failed (%s); the next save's "
                       "retention tries again", backend.display(name), exc)
        return []


def save_checkpoint(backend: StorageBackend, spec: RegistrySpec, captured: list[Captured],
                    step: int, tokens_seen: int | None, extra: dict[str, Any],
                    world: World, plans: SavePlans | None = None) -> str:
    """Write, commit (rank 0, after every rank reported its files) and apply retention;
    returns the committed checkpoint's directory name, on every rank.

    Any rank's failure is raised on every rank, and then nothing is committed (and the
    directory's claim is released, so the same step can be saved again at once). `plans`:
    the job's DCP plans, kept from one save to the next (a Saver's), or None to plan afresh.
    """
    with claim_scope():
        return _save_checkpoint(backend, spec, captured, step, tokens_seen, extra, world,
                                plans)


def _save_checkpoint(backend: StorageBackend, spec: RegistrySpec,
                     captured: list[Captured], step: int, tokens_seen: int | None,
                     extra: dict[str, Any], world: World, plans: SavePlans | None) -> str:
    """The collectives, whatever the number of components, files and tensors: the claim's
    agreement (with each rank's DCP plan digests), the previous checkpoint (incremental
    saves only), every rank's reports to rank 0, and rank 0's outcome to every rank; DCP
    adds four per component only when a component's plans changed (see docs/distributed.md).
    The outcome is the failure or nothing, not the manifest: only rank 0 reads that (its
    log line), and sending it would cost every rank bytes that grow with the file count.
    """
    started = time.perf_counter()
    name = checkpoint_name(step)
    shown = backend.display(name)
    claim: Claim | None = None  # rank 0's, which commits
    writer: str | None = None
    digests: dict[str, str] = {}
    with caught() as claiming:
        if plans is not None:
            digests = plans.digest(captured, world.rank)
        if world.rank == 0:
            # Refuses a committed step or one another live save holds; clears leftovers of an
            # interrupted save of it. commit() checks the claim is still this save's.
            claim = claim_checkpoint(backend, name)
            if not claim.exclusive:
                # A second saver of this step may get past its claim on this store: every
                # file goes under this save's own writer directory, named by its claim's token.
                writer = claim.info.token
    gathered = world.gather_checked((digests, writer), claiming.error, f"save of {name}")
    writer = gathered[0][1]
    data_dir = f"{name}/{WRITER_DIR_PREFIX}{writer}" if writer else name
    if plans is not None:
        plans.decide([theirs for theirs, _ in gathered], world.rank)
    total = sum(c.nbytes for c in captured)
    incremental = None
    if spec.save.incremental:
        # Rank 0 picks the base and records it in its claim (retention keeps what a live
        # claim names); every rank references the same one.
        incremental = IncrementalState(world.from_leader(hold_previous, backend, claim))
    files: list[WrittenFile] = []
    with Progress(total, f"save {name}") as progress, caught() as writing:
        files = write_components(backend, data_dir, captured, spec.storage, world, progress,
                                 incremental, plans)
    error = writing.error
    report = None
    if error is None:
        report = RankReport(
            files,
            digests=incremental.digests if incremental is not None else {},
            referenced=incremental.referenced if incremental is not None else set(),
            item_reports=plans.outgoing if plans is not None else {})
    reports = world.gather_on_leader((None if error is None else describe(error), report))
    failure = commit_error = committed = None
    if world.rank == 0:
        assert reports is not None
        failed = {r: problem for r, (problem, _) in enumerate(reports) if problem is not None}
        if failed:
            lines = "; ".join(f"rank {r}: {msg}" for r, msg in sorted(failed.items()))
            failure = f"writing {shown} failed on {len(failed)} of {world.size} ranks ({lines})"
        else:
            request = SaveRequest(step, tokens_seen, extra, world.size)
            with caught() as committing:
                committed = _commit_reports(backend, spec, captured, name, request,
                                            [theirs for _, theirs in reports], claim=claim,
                                            incremental=incremental, plans=plans,
                                            writer=writer)
            commit_error = committing.error
            if commit_error is not None:
                failure = (f"committing {shown} failed on 1 of {world.size} ranks "
                           f"(rank 0: {describe(commit_error)})")
    failure = world.broadcast(failure)
    if error is not None:
        raise_own(error, f"writing {shown}", world.rank)
    if commit_error is not None:
        raise_own(commit_error, f"committing {shown}", world.rank)
    if failure is not None:
        raise StateregError(failure)
    if plans is not None:
        plans.commit()
    if world.rank == 0:  # once per job, not once per rank
        assert committed is not None
        deleted = _retain(backend, spec, name)
        elapsed = time.perf_counter() - started
        logger.info(
            "saved %s on %d rank(s): %d components, %d files, %s%s",
            shown, world.size, len(committed.manifest.components),
            len(committed.manifest.files), describe_rate(committed.manifest.total_bytes, elapsed),
            f"; retention removed {', '.join(deleted)}" if deleted else "",
        )
    return name


def _commit_reports(backend: StorageBackend, spec: RegistrySpec, captured: list[Captured],
                    name: str, request: SaveRequest, reports: list[RankReport], *,
                    claim: Claim | None, incremental: IncrementalState | None,
                    plans: SavePlans | None, writer: str | None) -> Committed:
    """On rank 0: the `.metadata` of components written by kept plans, then the manifest of
    every rank's files, committed."""
    written = plans.finish([r.item_reports for r in reports]) if plans else []
    prefix = f"{name}/{WRITER_DIR_PREFIX}{writer}/" if writer else f"{name}/"
    written = [WrittenFile(f.path.removeprefix(prefix), f.size, f.checksum) for f in written]
    every_file = sorted({f.path: f for r in reports for f in [*r.files, *written]}
                        .values(), key=lambda f: f.path)
    manifest = build_manifest(spec, captured, every_file, request.step, request.tokens_seen,
                              request.extra, request.world_size, writer)
    previous = incremental.previous if incremental is not None else None
    if incremental is not None:
        referenced = {path for r in reports for path in r.referenced}
        manifest = manifest.model_copy(update={
            "references": reference_records(previous, referenced),
            "digests": {k: v for r in reports for k, v in r.digests.items()},
        })
    _check_then_commit(backend, name, manifest, claim, previous)
    return Committed(name, manifest)
