"""Execute a load in two phases: check and prepare every selected component, then apply.

Nothing live is modified until every component has been checked against the checkpoint, so
a mismatch in one component leaves all of them as they were.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp

from statereg.backends.base import StorageBackend
from statereg.backends.checksum import checksum_of, new_hasher
from statereg.backends.dcp_io import BackendReader, SafeLoadPlanner
from statereg.engine.checkpoints import Committed
from statereg.engine.plan import DCP_EXTRA_NAME, CheckpointPlan, ComponentPlan
from statereg.engine.report import Progress, describe_rate
from statereg.engine.world import World, attempt
from statereg.errors import CheckpointMismatchError, CorruptCheckpointError, SpecError
from statereg.formats.files import MODEL_FILE_FORMATS, decode_object, prepare_model_files
from statereg.formats.tensors import dcp_tensor_metas
from statereg.schemas.manifest import ComponentRecord, FileRecord
from statereg.schemas.spec import Format
from statereg.state.factory import Adapter
from statereg.state.model import ModelAdapter, TensorMeta
from statereg.state.objects import ObjectAdapter
from statereg.state.optimizer import OptimizerAdapter

logger = logging.getLogger("statereg")

VerifyMode = Literal["off", "fast", "full"]


@dataclass(frozen=True)
class KeyReport:
    """How one model's keys met a foreign source's tensors (stored names, after prefix rules)."""

    loaded: tuple[str, ...]
    missing: tuple[str, ...]  # in the model, not in the source: they keep their values
    unexpected: tuple[str, ...]  # in the source, not in the model: ignored

    def __str__(self) -> str:
        def some(keys: tuple[str, ...]) -> str:
            return ", ".join(keys[:5]) + (f" (and {len(keys) - 5} more)" if len(keys) > 5 else "")

        return (f"{len(self.loaded)} loaded, {len(self.missing)} missing"
                + (f" [{some(self.missing)}]" if self.missing else "")
                + f", {len(self.unexpected)} unexpected"
                + (f" [{some(self.unexpected)}]" if self.unexpected else ""))


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
    keys: dict[str, KeyReport] = field(default_factory=dict)  # foreign sources, per component


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


def verify_files(backend: StorageBackend, name: str, files: list[FileRecord],
                 mode: VerifyMode) -> None:
    """fast: every file exists with its recorded size; full: also every checksum.

    Paths are relative to checkpoint `name`, or to the root when `name` is empty.
    """
    if mode == "off":
        return
    # One listing of the checkpoint gives every size: on an object store, one request per
    # thousand files instead of one HEAD per file.
    listed = {f.path: f.size for f in backend.walk(name)} if name and mode == "fast" else None
    for record in files:
        path = f"{name}/{record.path}" if name else record.path
        if mode == "full":
            try:
                data = backend.read_bytes(path)
            except FileNotFoundError:
                data = None
            size = None if data is None else len(data)
        elif listed is not None:
            size = listed.get(path)
        else:
            try:
                size = backend.size(path)
            except FileNotFoundError:
                size = None
        if size is None:
            raise CorruptCheckpointError(
                f"{backend.display(path)} is missing; the manifest lists it "
                f"({record.size} bytes). The checkpoint is damaged: load an earlier one"
            )
        if size != record.size:
            raise CorruptCheckpointError(
                f"{backend.display(path)} has {size} bytes, the manifest recorded "
                f"{record.size}; the file is truncated or damaged: load an earlier checkpoint"
            )
        if mode == "full":
            check_checksum(backend.display(path), record, data)


def check_checksum(where: str, record: FileRecord, data: bytes) -> None:
    """Raise CorruptCheckpointError unless `data` has the checksum the manifest recorded."""
    hasher = new_hasher()
    hasher.update(data)
    if checksum_of(hasher) != record.checksum:
        raise CorruptCheckpointError(
            f"{where}: checksum {checksum_of(hasher)} differs from the manifest's "
            f"{record.checksum}; the file is damaged: load an earlier checkpoint"
        )


def stored_tensor_metas(reader: BackendReader) -> dict[str, TensorMeta]:
    return dcp_tensor_metas(reader.read_metadata())


def _read_state(backend: StorageBackend, path: str, fmt: Format = "json") -> Any:
    return decode_object(fmt, backend.read_bytes(path), backend.display(path))


def _dcp_target(cplan: ComponentPlan, world: World) -> tuple[str, Any]:
    """(directory, process group) of a DCP component for this rank."""
    if cplan.sharing == "per_group":
        return cplan.directory(world.group_id(cplan.group)), world.groups[cplan.group]
    return cplan.directory(), world.group


def _prepare_dcp(backend: StorageBackend, ckpt: str, cplan: ComponentPlan,
                 record: ComponentRecord, adapter: Adapter | None, strict: bool,
                 world: World, sizes: dict[str, int] | None = None) -> Callable[[], None]:
    directory, group = _dcp_target(cplan, world)
    reader = BackendReader(backend, f"{ckpt}/{directory}", sizes=sizes)

    def load_into(targets: dict[str, Any]) -> None:
        dcp.load(targets, storage_reader=reader, planner=SafeLoadPlanner(),
                 process_group=group, no_dist=group is None)

    if isinstance(adapter, ModelAdapter):
        targets = adapter.load_targets(stored_tensor_metas(reader), record.meta, strict)
        return lambda: (load_into(targets), adapter.after_load(targets, record.meta))
    if isinstance(adapter, OptimizerAdapter):
        extra = _read_state(backend, f"{ckpt}/{directory}/{DCP_EXTRA_NAME}")
        opt_targets = adapter.load_targets(stored_tensor_metas(reader), extra)
        return lambda: (load_into(opt_targets), adapter.apply(opt_targets, extra))
    if adapter is None:
        raise SpecError(
            f"component {cplan.name!r} (format dcp) has no object to load into; pass it to "
            "CheckpointManager(...) or exclude it"
        )
    state = adapter.capture()
    return lambda: (load_into(state), adapter.restore(state))


def _read_per_rank(backend: StorageBackend, ckpt: str, cplan: ComponentPlan,
                   record: ComponentRecord, adapter: Adapter | None, saved_size: int,
                   world: World) -> Any:
    """This rank's state of a per_rank component, applying the world-size-change policy."""
    if saved_size == world.size:
        return _read_state(backend, f"{ckpt}/{cplan.state_file(world.rank)}", cplan.format)
    policy = cplan.on_world_size_change
    if policy == "error":
        raise CheckpointMismatchError(
            f"component {cplan.name!r} holds per-rank state of {saved_size} ranks, this job "
            f"has {world.size} (checkpoint={saved_size}, current={world.size}): the world "
            "size changed (or num_workers / seeds differ per rank). Resume with "
            f"{saved_size} ranks, exclude the component, or declare on_world_size_change: "
            "reset | reshard (see docs/distributed.md)"
        )
    if policy == "reset":
        logger.warning("%s: world size changed (%d -> %d); %r keeps its fresh state",
                       backend.display(ckpt), saved_size, world.size, cplan.name)
        return None
    if adapter is None or not hasattr(adapter, "reshard"):
        raise SpecError(
            f"component {cplan.name!r} declares on_world_size_change: reshard, which needs its "
            "object at load time; pass it to CheckpointManager(...) before load()"
        )
    states = [_read_state(backend, f"{ckpt}/{cplan.state_file(r)}", cplan.format)
              for r in range(saved_size)]
    return adapter.reshard(states, world.rank, world.size)


def _prepare(backend: StorageBackend, ckpt: str, cplan: ComponentPlan, record: ComponentRecord,
             adapter: Adapter | None, strict: bool, saved_size: int, world: World,
             sizes: dict[str, int] | None = None) -> tuple[Callable[[], None], Any]:
    """Check one component and return (apply, state held for a not-yet-attached object)."""
    cplan = replace(cplan, format=record.format)  # the manifest says how it was written
    if record.format == "dcp":
        return _prepare_dcp(backend, ckpt, cplan, record, adapter, strict, world, sizes), None
    if record.kind == "model" and record.format in MODEL_FILE_FORMATS:
        return prepare_model_files(backend, f"{ckpt}/{cplan.directory()}", cplan.name, record,
                                   adapter, strict), None
    if record.sharing == "per_rank":
        state = _read_per_rank(backend, ckpt, cplan, record, adapter, saved_size, world)
        if state is None:
            return (lambda: None), None
    else:
        group_id = world.group_id(cplan.group) if cplan.sharing == "per_group" else None
        path = cplan.state_file(world.rank, group_id)
        if path not in record.files:
            raise CheckpointMismatchError(
                f"{backend.display(ckpt)}: component {cplan.name!r} has no {path} "
                f"(it has {', '.join(record.files)}); were the process groups different?"
            )
        state = _read_state(backend, f"{ckpt}/{path}", cplan.format)
    if adapter is None:
        return (lambda: None), state
    if isinstance(adapter, ObjectAdapter):
        adapter.check_ready()
    return (lambda: adapter.restore(state)), None


def _check_group_layouts(backend: StorageBackend, committed: Committed, plan: CheckpointPlan,
                         names: list[str], world: World) -> None:
    """per_group copies are matched to groups by lowest rank: the set of groups must match.

    A group may gain or lose members (DCP reshards within it), but a new group would find no
    copy and a vanished one would leave its copy behind: both are refused, on every rank.
    """
    grouped = [plan.component(n) for n in names if plan.component(n).sharing == "per_group"]
    if not grouped:
        return
    group_names = sorted({c.group for c in grouped})
    mine, error = attempt(lambda: {g: world.group_id(g) for g in group_names})
    world.agree(error, f"checking the process groups against {backend.display(committed.name)}")
    everyone = world.all_gather(mine)
    saved_size = committed.manifest.world_size
    for cplan in grouped:
        # Files are <component>/group_<lowest rank>/...
        saved = sorted({p.split("/")[1] for p in committed.manifest.components[cplan.name].files})
        current = sorted({ids[cplan.group] for ids in everyone})
        if saved != current:
            raise CheckpointMismatchError(
                f"{backend.display(committed.name)}: component {cplan.name!r} (sharing per_group, "
                f"group {cplan.group!r}) holds {len(saved)} group copies ({', '.join(saved)}) "
                f"saved on {saved_size} ranks; this job has {len(current)} {cplan.group!r} "
                f"groups ({', '.join(current)}) on {world.size} ranks (checkpoint={saved_size}, "
                f"current={world.size}). A copy belongs to the group whose lowest rank saved "
                "it: build the same groups (e.g. the same pipeline stages), or exclude the "
                "component (see docs/distributed.md)"
            )


def _verify_share(backend: StorageBackend, committed: Committed, files: list[FileRecord],
                  mode: VerifyMode, world: World) -> None:
    """Each rank verifies every world.size-th file, so the work is spread over the ranks."""
    verify_files(backend, committed.name, files[world.rank::world.size], mode)
    references = committed.manifest.references
    verify_files(backend, "", references[world.rank::world.size], mode)


def load_checkpoint(backend: StorageBackend, committed: Committed, plan: CheckpointPlan,
                    adapters: dict[str, Adapter], names: list[str], world: World,
                    strict: bool = True, verify: VerifyMode = "fast",
                    ) -> tuple[LoadResult, dict[str, Any]]:
    """Load `names` from a committed checkpoint into their adapters, on every rank.

    Returns the result and the states of components whose objects are not attached yet.
    Any rank's failure is raised on every rank, before anything is modified where possible.
    """
    started = time.perf_counter()
    manifest = committed.manifest
    selected_files = {p for n in names for p in manifest.components[n].files}
    files = [f for f in manifest.files if f.path in selected_files]
    _, error = attempt(_verify_share, backend, committed, files, verify, world)
    world.agree(error, f"verifying {backend.display(committed.name)}")
    _check_group_layouts(backend, committed, plan, names, world)
    steps: list[tuple[str, Callable[[], None]]] = []
    pending: dict[str, Any] = {}

    # Sizes the manifest records (checked above unless verify is off) spare a request per file.
    sizes = {f"{committed.name}/{f.path}": f.size for f in files} if verify != "off" else None

    def prepare_all() -> None:
        for name in names:
            apply, state = _prepare(backend, committed.name, plan.component(name),
                                    manifest.components[name], adapters.get(name), strict,
                                    manifest.world_size, world, sizes)
            steps.append((name, apply))
            if state is not None:
                pending[name] = state

    _, error = attempt(prepare_all)
    world.agree(error, f"checking {backend.display(committed.name)}")
    nbytes = sum(f.size for f in files)

    def apply_all() -> None:
        with Progress(nbytes, f"load {committed.name}") as progress, torch.no_grad():
            for name, apply in steps:
                apply()
                progress.update(manifest.components[name].bytes)

    _, error = attempt(apply_all)
    world.agree(error, f"loading {backend.display(committed.name)}")
    elapsed = time.perf_counter() - started
    logger.info("loaded %s: %s (%s)", backend.display(committed.name),
                describe_rate(nbytes, elapsed), ", ".join(names))
    result = LoadResult(
        step=manifest.step,
        tokens_seen=manifest.tokens_seen,
        extra=dict(manifest.extra),
        path=backend.display(committed.name),
        components=tuple(names),
    )
    return result, pending
