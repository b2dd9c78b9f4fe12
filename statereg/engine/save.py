"""Execute a save: capture state, (optionally stage it), write every file, then commit."""

from __future__ import annotations

import json
import logging
import time
from array import array
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

import statereg
from statereg.backends.base import StorageBackend
from statereg.backends.checksum import FileRecorder, WrittenFile, new_hasher
from statereg.backends.codec import CompressionSettings
from statereg.backends.dcp_io import BackendWriter
from statereg.engine.checkpoints import Committed, checkpoint_name, latest_committed
from statereg.engine.claims import Claim, claim_checkpoint, claim_scope
from statereg.engine.incremental import reference_records, reuse_index
from statereg.engine.jsonstate import encode_state
from statereg.engine.plan import DCP_EXTRA_NAME, CheckpointPlan, ComponentPlan
from statereg.engine.publish import commit
from statereg.engine.report import Progress, describe_rate
from statereg.engine.retention import apply_retention
from statereg.engine.world import World, attempt
from statereg.errors import (
    CheckpointMismatchError,
    SpecError,
)
from statereg.formats.files import MODEL_FILE_FORMATS, encode_object, write_model_files
from statereg.schemas.manifest import FORMAT_VERSION, ComponentRecord, FileRecord, Manifest
from statereg.schemas.spec import RegistrySpec, StorageSpec
from statereg.state.factory import Adapter
from statereg.state.model import ModelAdapter
from statereg.state.optimizer import OptimizerAdapter

logger = logging.getLogger("statereg")


@dataclass
class CapturedComponent:
    """One component's state at save time on this rank: tensors for DCP, small files as bytes."""

    plan: ComponentPlan
    tensors: dict[str, Any] | None = None
    dcp_dir: str = ""
    dcp_group: Any = None  # the process group of the DCP collective; None: this rank alone
    blobs: dict[str, bytes] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in (self.tensors or {}).values() if isinstance(t, torch.Tensor))


def _dcp_group(cplan: ComponentPlan, world: World) -> Any:
    if cplan.sharing == "per_group":
        return world.groups[cplan.group]
    return None if cplan.sharing == "global" else world.group


def _writes(cplan: ComponentPlan, world: World) -> bool:
    """Whether this rank takes part in writing the component."""
    if cplan.sharing == "per_group" and cplan.format == "json":
        return world.group_rank(cplan.group) == 0
    return world.rank in cplan.writers


def capture(plan: CheckpointPlan, adapters: dict[str, Adapter], world: World,
            ) -> list[CapturedComponent]:
    """Read the state this rank writes. Tensors are referenced, not copied."""
    captured = []
    for cplan in plan.components:
        adapter = adapters.get(cplan.name)
        if adapter is None or not _writes(cplan, world):
            continue
        group_id = world.group_id(cplan.group) if cplan.sharing == "per_group" else None
        directory = cplan.directory(group_id)
        item = CapturedComponent(cplan, dcp_dir=directory, dcp_group=_dcp_group(cplan, world))
        where = f"component {cplan.name!r}"
        if isinstance(adapter, ModelAdapter):
            item.tensors, item.meta = adapter.capture()
        elif isinstance(adapter, OptimizerAdapter):
            item.tensors, extra = adapter.capture()
            leader = world.rank == 0 if group_id is None else world.group_rank(cplan.group) == 0
            if leader:
                item.blobs[f"{directory}/{DCP_EXTRA_NAME}"] = encode_state(extra, where)
        elif cplan.format == "dcp":
            item.tensors = adapter.capture()
        else:
            item.blobs[cplan.state_file(world.rank, group_id)] = encode_object(
                cplan.format, adapter.capture(), where)
        captured.append(item)
    return captured


def state_digest(spec: RegistrySpec, captured: list[CapturedComponent]) -> tuple[str, dict]:
    """A digest of what every rank must agree on: the declaration and the shared key sets."""
    keys = {
        c.plan.name: sorted(c.tensors)
        for c in captured
        if c.tensors is not None and c.plan.sharing in ("sharded", "replicated")
    }
    hasher = new_hasher()
    hasher.update(json.dumps([redacted_spec(spec), keys], sort_keys=True).encode())
    return hasher.hexdigest(), keys


def check_consistency(world: World, spec: RegistrySpec, captured: list[CapturedComponent]) -> None:
    """Every rank must save the same declaration and key sets; else name the rank and keys.

    Mismatched key sets would make DCP's collectives wait forever.
    """
    digest, keys = state_digest(spec, captured)
    digests = world.all_gather(digest)
    if len(set(digests)) == 1:
        return
    all_keys = world.all_gather(keys)
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


def _replica_digests(captured: list[CapturedComponent]) -> dict[str, dict[str, int]]:
    """xxh3_64 of each tensor's bytes, per `replicated` component declared with validate."""
    digests: dict[str, dict[str, int]] = {}
    for item in captured:
        if not item.plan.validate or item.tensors is None:
            continue
        mine = digests.setdefault(item.plan.name, {})
        for key, tensor in item.tensors.items():
            if isinstance(tensor, torch.Tensor):
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


def check_replicas(world: World, captured: list[CapturedComponent]) -> None:
    """For `replicated` components declared with validate: every rank's copy must be equal.

    A single process has no other copy to compare. Ranks exchange one digest per component,
    and the per-tensor digests (to name the tensor) only when those differ.
    """
    if world.size <= 1:
        return
    hashes = _replica_digests(captured)
    summaries = world.all_gather({comp: _combined(d) for comp, d in hashes.items()})
    if all(summary == summaries[0] for summary in summaries):
        return
    gathered = world.all_gather(hashes)
    for comp, mine in gathered[0].items():
        for key, digest in mine.items():
            differ = [r for r, theirs in enumerate(gathered) if theirs[comp][key] != digest]
            if differ:
                raise CheckpointMismatchError(
                    f"component {comp!r} is declared replicated, but tensor {key!r} differs "
                    f"between rank 0 and rank(s) {differ}; nothing was saved. Synchronize the "
                    "replicas (e.g. broadcast from rank 0) or declare the component sharded"
                )


def _like(original: torch.Tensor, local_copy: torch.Tensor) -> torch.Tensor:
    """`local_copy` as the same kind of tensor as `original` (a DTensor keeps its layout)."""
    if hasattr(original, "_local_tensor"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local_copy, original.device_mesh, original.placements,
                                  run_check=False, shape=original.shape,
                                  stride=original.stride())
    return local_copy


class StagingArea:
    """Host buffers that hold a copy of the tensors while a background save writes them.

    Buffers are allocated on the first save and reused while shapes and dtypes stay the same,
    so repeated async saves do not grow memory.
    """

    def __init__(self, pinned: bool = False) -> None:
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}
        # Page-locked memory only helps (and only exists) with CUDA.
        self._pin = pinned and torch.cuda.is_available()

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())

    def stage(self, captured: list[CapturedComponent], stream: Any = None,
              ) -> list[CapturedComponent]:
        """The components with every tensor copied into its reused buffer.

        `stream`: the CUDA stream to copy on. Staging on a background thread passes the
        training loop's stream, taken when save() was called, so the copies follow the
        loop's work on the device; None copies on the current stream.
        """
        staged = []
        with torch.cuda.stream(stream):
            for item in captured:
                if item.tensors is None:
                    staged.append(item)
                    continue
                copies: dict[str, Any] = {}
                for key, tensor in item.tensors.items():
                    if not isinstance(tensor, torch.Tensor):
                        copies[key] = tensor
                        continue
                    slot = (item.plan.name, key)
                    local = getattr(tensor, "_local_tensor", tensor)
                    buf = self._buffers.get(slot)
                    if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
                        buf = torch.empty(local.shape, dtype=local.dtype, device="cpu",
                                          pin_memory=self._pin)
                        self._buffers[slot] = buf
                    buf.copy_(local.detach(), non_blocking=self._pin)
                    copies[key] = _like(tensor, buf)
                staged.append(replace(item, tensors=copies))
            if self._pin:
                torch.cuda.current_stream().synchronize()
        return staged


def loop_stream() -> Any:
    """The calling thread's current CUDA stream, or None where CUDA is not in use."""
    return torch.cuda.current_stream() if torch.cuda.is_initialized() else None


def redacted_spec(spec: RegistrySpec) -> dict[str, Any]:
    """The declaration as JSON data, with every storage option value hidden."""
    options = {k: "<redacted>" for k in spec.storage.options}
    storage = spec.storage.model_copy(update={"options": options})
    blank = spec.model_copy(update={"storage": storage})
    return blank.model_dump(mode="json", by_alias=True)


def check_extra(extra: dict[str, Any] | None) -> dict[str, Any]:
    """`extra` must survive JSON unchanged, since the manifest stores it."""
    extra = dict(extra or {})
    for key, value in extra.items():
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            raise SpecError(
                f"save(extra=...): value of {key!r} ({type(value).__name__}) is not plain JSON; "
                "pass numbers, strings, lists or dicts (e.g. float(loss))"
            ) from None
        if not isinstance(key, str):
            raise SpecError(f"save(extra=...): key {key!r} must be a string")
    return extra


def _prepare_directory(backend: StorageBackend, name: str) -> Claim:
    """Refuse a committed step, or one another live save holds; claim the directory for this
    save and clear leftovers of an interrupted save of the same step (see claims.py).

    The claim is handed to commit(), which checks it is still this save's and releases it."""
    return claim_checkpoint(backend, name)


def compression_settings(storage: StorageSpec) -> CompressionSettings | None:
    """The codec settings tensor files are written with, or None for uncompressed files."""
    declared = storage.compression
    if declared is None or declared.codec == "none":
        return None
    return CompressionSettings(level=declared.level, threads=declared.threads,
                               float_aware=declared.float_aware)


def file_codec(path: str, settings: CompressionSettings | None) -> str:
    """What the manifest records for a file: DCP data files carry compressed items."""
    if settings is None or not path.endswith(".distcp"):
        return "none"
    return "zstd+planes" if settings.float_aware else "zstd"


# Exactly these types are whole local tensors to DCP (DTensor and ShardedTensor subclass Tensor).
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def _whole_tensor_index(fqn: str, offsets: torch.Size) -> MetadataIndex:
    """MetadataIndex(fqn, offsets, 0), sharing `offsets` (its __init__ copies it per index).

    Index hint 0: the tensor's one chunk, as DCP's global plan would set it.
    """
    index = MetadataIndex(fqn, None, 0)
    object.__setattr__(index, "offset", offsets)  # frozen: set as its own __init__ does
    return index


class StateregSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, with a fast path for a flat dict of plain tensors.

    statereg's model and optimizer components are flat `name -> tensor` dicts of whole
    tensors. For them flattening is the identity, each tensor is one item, and a single
    plan (one process) has nothing to deduplicate or to validate for overlaps, so the plan
    and metadata are built directly, each tensor visited once. Tensors of one shape and
    dtype share their write data and storage metadata (nothing changes either after
    planning), so `.metadata` pickles each shape once instead of once per tensor. The plan
    and metadata equal DefaultSavePlanner's.
    Anything else (nested state, DTensor, objects) and plans gathered from several ranks
    take DefaultSavePlanner's path: deduplication and validation across ranks stay.
    """

    def __init__(self) -> None:
        super().__init__()
        self._plain = False

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: StorageMeta | None = None,
                       is_coordinator: bool = False) -> None:
        self._plain = all(type(key) is str and type(value) in _PLAIN_TENSOR_TYPES
                          for key, value in state_dict.items())
        if not self._plain:
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
            return
        # What flatten_state_dict returns for a flat dict of tensors: itself, keys as paths.
        self.state_dict = dict(state_dict)
        self.mappings = {key: (key,) for key in state_dict}
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        if not self._plain:
            return super().create_local_plan()
        shared: dict[tuple[Any, ...], TensorWriteData] = {}
        items = []
        for fqn, tensor in self.state_dict.items():
            size = tensor.size()
            key = (size, tensor.dtype, tensor.layout, tensor.requires_grad, tensor.is_pinned())
            data = shared.get(key)
            if data is None:
                offsets = torch.Size([0] * len(size))
                data = shared[key] = TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=size),
                    properties=TensorProperties.create_from_tensor(tensor), size=size)
            items.append(WriteItem(index=_whole_tensor_index(fqn, data.chunk.offsets),
                                   type=WriteItemType.TENSOR, tensor_data=data))
        self.plan = SavePlan(items, planner_data=self.mappings)
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        if not (self._plain and len(all_plans) == 1):
            return super().create_global_plan(all_plans)
        plan = all_plans[0]
        md: dict[str, Any] = {}
        shared: dict[int, TensorStorageMetadata] = {}
        for item in plan.items:
            data = item.tensor_data
            if item.type != WriteItemType.TENSOR or data is None or item.index.fqn in md:
                return super().create_global_plan(all_plans)  # not a plan of ours
            stored = shared.get(id(data))
            if stored is None:
                stored = shared[id(data)] = TensorStorageMetadata(
                    properties=data.properties, size=data.size, chunks=[data.chunk])
            md[item.index.fqn] = stored
        self.global_plan = all_plans
        self.metadata = Metadata(md, planner_data=dict(plan.planner_data or {}))
        return all_plans, self.metadata

    def resolve_data(self, write_item: WriteItem) -> Any:
        if self._plain:
            return self.state_dict[write_item.index.fqn]
        return super().resolve_data(write_item)


@dataclass
class IncrementalState:
    """One rank's view of an incremental save: what it may reference, what it did reference."""

    previous: Committed | None
    digests: dict[str, str] = field(default_factory=dict)
    referenced: set[str] = field(default_factory=set)


def write_components(backend: StorageBackend, name: str, captured: list[CapturedComponent],
                     storage: StorageSpec, progress: Progress,
                     incremental: IncrementalState | None = None) -> list[WrittenFile]:
    """Write this rank's files of every component; returns them relative to `name`.

    Components that need no collective (one process, or per-rank state) are written at the
    same time: on an object store each component's uploads would otherwise wait for the
    slowest file of the one before.
    """
    recorder = FileRecorder()
    compression = compression_settings(storage)

    def write(item: CapturedComponent) -> BackendWriter | None:
        writer = None
        if item.tensors is not None and item.plan.format in MODEL_FILE_FORMATS:
            write_model_files(backend, f"{name}/{item.dcp_dir}", item.plan.format, item.tensors,
                              item.dcp_group, item.plan.max_shard_size, recorder.add)
        elif item.tensors is not None:
            reuse = (reuse_index(backend, incremental.previous, item.dcp_dir)
                     if incremental is not None else None)
            writer = BackendWriter(backend, f"{name}/{item.dcp_dir}", recorder,
                                   thread_count=storage.io_threads or backend.default_io_threads,
                                   compression=compression,
                                   reuse=reuse)
            dcp.save(item.tensors, storage_writer=writer, planner=StateregSavePlanner(),
                     process_group=item.dcp_group, no_dist=item.dcp_group is None)
        for path, data in item.blobs.items():
            recorder.add(backend.write_bytes(f"{name}/{path}", data))
        progress.update(item.tensor_bytes + sum(len(b) for b in item.blobs.values()))
        return writer

    if len(captured) > 1 and all(item.dcp_group is None for item in captured):
        with ThreadPoolExecutor(len(captured), thread_name_prefix="statereg-component") as pool:
            writers = list(pool.map(write, captured))
    else:
        writers = [write(item) for item in captured]
    if incremental is not None:
        for item, writer in zip(captured, writers, strict=True):
            if writer is not None:
                incremental.digests.update(
                    {f"{item.dcp_dir}/{key}": d for key, d in writer.digests.items()})
                incremental.referenced |= writer.referenced
    prefix = f"{name}/"
    return [WrittenFile(f.path.removeprefix(prefix), f.size, f.checksum) for f in recorder.files()]


def build_manifest(spec: RegistrySpec, captured: list[CapturedComponent],
                   files: list[WrittenFile], step: int, tokens_seen: int | None,
                   extra: dict[str, Any], world_size: int) -> Manifest:
    compression = compression_settings(spec.storage)
    components = {}
    for item in captured:
        prefix = f"{item.plan.name}/"
        mine = [f for f in files if f.path.startswith(prefix)]
        components[item.plan.name] = ComponentRecord(
            kind=item.plan.kind,
            sharing=item.plan.sharing,
            format=item.plan.format,
            files=[f.path for f in mine],
            tensors=len(item.tensors or {}),
            bytes=sum(f.size for f in mine),
            meta=item.meta,
        )
    return Manifest(
        format_version=FORMAT_VERSION,
        statereg_version=statereg.__version__,
        torch_version=torch.__version__,
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        step=step,
        tokens_seen=tokens_seen,
        extra=extra,
        world_size=world_size,
        spec=redacted_spec(spec),
        components=components,
        files=[FileRecord(path=f.path, size=f.size, checksum=f.checksum,
                          codec=file_codec(f.path, compression))
               for f in files],
    )


def save_checkpoint(backend: StorageBackend, spec: RegistrySpec, captured: list[CapturedComponent],
                    step: int, tokens_seen: int | None, extra: dict[str, Any],
                    world: World) -> Committed:
    """Write, commit (rank 0, after every rank reported its files) and apply retention.

    Any rank's failure is raised on every rank, and then nothing is committed (and the
    directory's claim is released, so the same step can be saved again at once).
    """
    with claim_scope():
        return _save_checkpoint(backend, spec, captured, step, tokens_seen, extra, world)


def _save_checkpoint(backend: StorageBackend, spec: RegistrySpec,
                     captured: list[CapturedComponent], step: int, tokens_seen: int | None,
                     extra: dict[str, Any], world: World) -> Committed:
    started = time.perf_counter()
    name = checkpoint_name(step)
    error = None
    claim: Claim | None = None  # rank 0's, which commits
    if world.rank == 0:
        claim, error = attempt(_prepare_directory, backend, name)
    world.agree(error, f"save of {name}")
    total = sum(c.tensor_bytes + sum(len(b) for b in c.blobs.values()) for c in captured)
    incremental = (IncrementalState(latest_committed(backend))
                   if spec.save.incremental else None)
    with Progress(total, f"save {name}") as progress:
        files, error = attempt(write_components, backend, name, captured, spec.storage,
                                progress, incremental)
    world.agree(error, f"writing {backend.display(name)}")
    reports = world.all_gather((files, incremental and (incremental.digests,
                                                        incremental.referenced)))
    committed: Committed | None = None
    deleted: list[str] = []
    if world.rank == 0:
        every_file = sorted({f.path: f for rank, _ in reports for f in rank}.values(),
                            key=lambda f: f.path)
        manifest = build_manifest(spec, captured, every_file, step, tokens_seen, extra,
                                  world.size)
        if incremental is not None:
            referenced = {path for _, (_, paths) in reports for path in paths}
            manifest = manifest.model_copy(update={
                "references": reference_records(incremental.previous, referenced),
                "digests": {k: v for _, (digests, _) in reports for k, v in digests.items()},
            })
        _, error = attempt(commit, backend, name, manifest, claim)
        committed = Committed(name, manifest)
    world.agree(error, f"committing {backend.display(name)}")
    committed = world.broadcast(committed)
    if world.rank == 0:
        deleted = apply_retention(backend, spec.save)
    elapsed = time.perf_counter() - started
    logger.info(
        "saved %s: %d components, %d files, %s%s",
        backend.display(name), len(committed.manifest.components), len(committed.manifest.files),
        describe_rate(committed.manifest.total_bytes, elapsed),
        f"; retention removed {', '.join(deleted)}" if deleted else "",
    )
    return committed
