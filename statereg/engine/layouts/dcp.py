"""The `dcp` layout: tensors through torch.distributed.checkpoint, one directory per copy.

The task names the directory (the component's, a group's, or a rank's own) and the
collective DCP plans over; an optimizer's param groups and scalar state go to a JSON
sidecar written by the task's leader.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
)
from torch.futures import Future

from statereg.backends.checksum import FileRecorder, WrittenFile
from statereg.backends.stores import ReadableStore
from statereg.dcp import METADATA_NAME
from statereg.dcp.metadata import load_dcp_metadata, metadata_digest
from statereg.dcp.planner import PLAIN_TENSOR_TYPES, StateregSavePlanner, plan_digest
from statereg.dcp.quiet import single_process_dcp
from statereg.dcp.reader import BackendReader, SafeLoadPlanner
from statereg.dcp.reports import ItemReports, pack_results, unpack_results
from statereg.dcp.torch_private import dcp_load
from statereg.dcp.writer import BackendWriter, WriteReport
from statereg.engine.layouts.base import (
    Captured,
    Prepared,
    ReadContext,
    WriteContext,
    key_report,
    nothing,
    require_object,
)
from statereg.engine.plan import WORLD, LoadTask, Task
from statereg.engine.world import World, caught, unwrap_alone
from statereg.errors import SpecError
from statereg.formats.jsonstate import decode_state, encode_state
from statereg.formats.names import SIDECAR_NAME
from statereg.formats.tensors import dcp_tensor_metas
from statereg.schemas.manifest import ComponentRecord, FileRecord
from statereg.state.model import describe, is_plain_tensor
from statereg.state.protocols import TensorMeta, TensorState


@dataclass
class _KeptPlan:
    """One component's plans from its last committed save, on this rank."""

    digests: list[str]  # every member's local plan digest, in rank order
    plan: SavePlan  # this rank's final plan (its items and its file prefix)
    reports: ItemReports  # this rank's write results, packed
    # The coordinator's alone: the global `.metadata` (its tensors, not its locations), each
    # member's final item indices and last reports.
    metadata: Metadata | None = None
    members: list[list[MetadataIndex]] = field(default_factory=list)
    member_reports: list[ItemReports] = field(default_factory=list)


class SavePlans:
    """DCP save plans of one job, reused while every rank plans what it planned last time.

    Before its writes, a save digests each rank's local plan of every DCP component over the
    whole world or alone (`digest`); engine/save_steps.py gathers the digests with the claim's
    agreement, one collective for all components. A component whose digests on every rank
    equal those of its last committed save skips DCP's planning collectives: each rank
    writes its kept final plan, sends its packed write results to the coordinator with the
    save's file reports (`outgoing`), and the coordinator writes `.metadata` from its kept
    global metadata and those results (`finish`). The digests always are the new save's.
    Anything else (a first save, changed shapes, a named group's component) runs dcp.save
    and is kept for the next save once this one commits. Kept per job, keyed by component,
    never by class: several components and jobs save in one process.
    """

    def __init__(self) -> None:
        self._kept: dict[str, _KeptPlan] = {}
        self._planners: dict[str, StateregSavePlanner] = {}
        self._digests: dict[str, list[str]] = {}
        self._learned: dict[str, _KeptPlan] = {}
        self._writers: dict[str, BackendWriter] = {}
        self._alone: set[str] = set()  # components this rank saves with no collective
        self.outgoing: dict[str, ItemReports] = {}

    def digest(self, captured: list[Captured], rank: int) -> dict[str, str]:
        """This rank's local plan digest of each DCP component it can reuse plans of."""
        self._planners, self._digests, self._learned = {}, {}, {}
        self._writers, self._alone, self.outgoing = {}, set(), {}
        digests = {}
        for item in captured:
            task = item.task
            if task.layout != "dcp" or item.tensors is None or task.collective not in (None,
                                                                                       WORLD):
                continue
            if task.collective is None:
                self._alone.add(task.component)
            planner = StateregSavePlanner(item.coordinator_only)
            # DCP's coordinator (rank 0 of the world, or this rank alone) also plans objects.
            planner.set_up_planner(item.tensors,
                                   is_coordinator=task.collective is None or rank == 0)
            digests[task.component] = plan_digest(planner.create_local_plan())
            self._planners[task.component] = planner
        return digests

    def decide(self, gathered: list[dict[str, str]], rank: int) -> list[str]:
        """Given every rank's `digest`, the components this save reuses plans of."""
        reused = []
        for component in list(self._planners):
            digests = ([gathered[rank][component]] if component in self._alone
                       else [theirs.get(component, "") for theirs in gathered])
            self._digests[component] = digests
            kept = self._kept.get(component)
            if kept is not None and kept.digests == digests:
                reused.append(component)
            else:
                self._planners.pop(component)
        return reused

    def writes_again(self, component: str) -> bool:
        return component in self._planners

    def write_again(self, component: str, writer: BackendWriter) -> None:
        """Write this rank's items of `component` by its kept plan (no collective)."""
        kept, planner = self._kept[component], self._planners[component]
        writer.set_up_storage_writer(planner.is_coordinator)
        writer.prepare_local_plan(planner.plan)  # the directory, as DCP's writer makes it
        writer.write_data(planner.finish_plan(kept.plan), planner).wait()
        reports = pack_results([item.index for item in kept.plan.items], writer.report.written)
        self._learned[component] = dataclasses.replace(kept, reports=reports)
        if component in self._alone:
            self._write_metadata(component, writer, [reports.to_send(kept.reports)])
        else:
            self.outgoing[component] = reports.to_send(kept.reports)
            self._writers[component] = writer

    def learn(self, component: str, planner: StateregSavePlanner,
              writer: BackendWriter) -> None:
        """Keep what dcp.save planned for `component`, for the next save of the same plans."""
        digests = self._digests.get(component)
        if digests is None:
            return
        kept = _KeptPlan(digests, planner.plan,
                         pack_results([item.index for item in planner.plan.items],
                                      writer.report.written))
        if planner.is_coordinator:
            # Its tensors and planner data; locations and digests are each save's own.
            kept.metadata = dataclasses.replace(planner.metadata, storage_data=None)
            kept.members = [[item.index for item in plan.items] for plan in planner.global_plan]
            kept.member_reports = [pack_results(indices, results) for indices, results
                                   in zip(kept.members, writer.report.finished, strict=True)]
        self._learned[component] = kept

    def finish(self, gathered: list[dict[str, ItemReports]]) -> list[WrittenFile]:
        """On the coordinator: write the `.metadata` of every component written again, from
        every rank's reports; returns the files written."""
        recorder = FileRecorder()
        for component, writer in self._writers.items():
            writer.fs.recorder = recorder  # the write reports are sent: record these apart
            self._write_metadata(component, writer, [theirs[component] for theirs in gathered])
        return recorder.files()

    def _write_metadata(self, component: str, writer: BackendWriter,
                        reports: list[ItemReports]) -> None:
        kept = self._kept[component]
        assert kept.metadata is not None
        results, whole = [], []
        for indices, theirs, last in zip(kept.members, reports, kept.member_reports,
                                         strict=True):
            items, full = unpack_results(indices, theirs, last)
            results.append(items)
            whole.append(full)
        # A copy: finish() sets the new locations and digests on it, never on the kept one.
        writer.finish(dataclasses.replace(kept.metadata), results)
        self._learned[component].member_reports = whole

    def commit(self) -> None:
        """The save committed: keep what it planned and wrote for the next one."""
        self._kept.update(self._learned)
        self._learned = {}


@dataclass
class PlannedWriteContext(WriteContext):
    """A WriteContext with the job's kept DCP save plans (engine/save_steps.py builds it)."""

    plans: SavePlans | None = None


class DCPLayout:
    needs_object = True

    """Saves and loads a tensor-state component through DCP, as its task says."""

    def capture(self, task: Task, adapter: TensorState) -> Captured:
        state = adapter.capture()
        _check_items(task, state.tensors)
        item = Captured(task, tensors=state.tensors, meta=state.meta)
        if task.collective is not None:
            # Plain buffers (not DTensor shards) are one rank's copy: the coordinator's.
            item.coordinator_only = frozenset(
                key for key in state.buffers if type(state.tensors[key]) in PLAIN_TENSOR_TYPES)
        if task.leader and state.sidecar is not None:
            item.blobs[f"{task.directory}/{SIDECAR_NAME}"] = encode_state(
                state.sidecar, f"component {task.component!r}")
        return item

    def write(self, item: Captured, ctx: WriteContext) -> WriteReport:
        task = item.task
        group = ctx.world.process_group(task.collective)
        writer = BackendWriter(ctx.backend, f"{ctx.name}/{task.directory}", ctx.recorder,
                               thread_count=ctx.io.write_threads,
                               compression=ctx.compression,
                               reuse=ctx.reuse(task.directory) if ctx.reuse else None,
                               crcs=ctx.io.record_crcs, around_cache=ctx.io.write_around_cache)
        plans = ctx.plans if isinstance(ctx, PlannedWriteContext) else None
        if plans is not None and plans.writes_again(task.component):
            plans.write_again(task.component, writer)
            return writer.report
        planner = StateregSavePlanner(item.coordinator_only)
        with single_process_dcp():
            dcp.save(item.tensors, storage_writer=writer, planner=planner,
                     process_group=group, no_dist=group is None)
        if plans is not None:
            plans.learn(task.component, planner, writer)
        return writer.report

    def prepare(self, task: LoadTask, record: ComponentRecord, adapter: TensorState | None,
                ctx: ReadContext) -> Prepared:
        if task.policy == "reset":
            return Prepared(nothing)
        directory = f"{ctx.name}/{task.directory}"
        group = ctx.world.process_group(task.collective)
        # Every rank of the collective needs these alike: one reads, the others receive, and
        # before anything that may fail on one rank only (the next step agrees on that).
        sidecar_bytes = None
        if f"{task.directory}/{SIDECAR_NAME}" in record.files:
            sidecar_bytes = ctx.read_once(f"{directory}/{SIDECAR_NAME}", task.collective)
        metadata = ctx.read_once(f"{directory}/{METADATA_NAME}", task.collective)
        reader = GroupReader(ctx.backend, directory, ctx.records, metadata, ctx.world, group,
                             ctx.io.read_threads, ctx.io.broadcast_reads)
        found = None
        with caught() as checking:
            found = _checked_targets(task, record, adapter, ctx, reader, sidecar_bytes)
        error = checking.error
        if group is None:
            if error is not None:
                raise error
        else:
            # One exchange: a failure on any rank, and whether every rank needs the same items
            # (then each data file is read by one rank and broadcast: GroupReader).
            prints = ctx.world.gather_checked(None if found is None else found[4], error,
                                              f"checking component {task.component!r}", group)
            reader.shared = len(prints) > 1 and prints[0] is not None and len(set(prints)) == 1
        adapter, sidecar, stored, targets, fingerprint = found
        # The same checkpoint into the same targets again: DCP's plan is made once.
        plan_key = None if fingerprint is None else (reader.metadata_digest, fingerprint)

        def apply() -> None:
            # Shared reads plan on each rank alone (their plans are equal); otherwise DCP
            # plans over the collective and each rank reads the items it needs.
            alone = reader.shared or group is None
            try:
                with single_process_dcp():
                    dcp_load(targets, storage_reader=reader, planner=SafeLoadPlanner(plan_key),
                             process_group=None if alone else group, no_dist=alone)
            except BaseException as exc:
                inner = unwrap_alone(exc) if alone else exc
                if inner is exc:
                    raise
                raise inner from None  # this rank's own error, as a collective load raises it
            adapter.apply(targets, record.meta, sidecar)

        return Prepared(apply, keys=key_report(adapter, stored, record.meta, targets))


def _check_items(task: Task, tensors: Any) -> None:
    """Refuse, before any file is written, a state DCP would store but not load back: a tensor
    that is not a plain dense one (quantized, sparse, nested, a subclass), or state whose top
    level is not a dict of names."""
    where = f"component {task.component!r} ({task.kind}, format dcp)"
    if not isinstance(tensors, dict) or not all(isinstance(k, str) for k in tensors):
        raise SpecError(
            f"{where}: state_dict() must return a dict keyed by strings for format dcp, got "
            f"{type(tensors).__name__}; declare format: torch or json for other shapes"
        )
    pending: list[tuple[str, Any]] = list(tensors.items())
    while pending:
        key, value = pending.pop()
        if isinstance(value, dict):
            pending.extend((f"{key}.{k}", v) for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            pending.extend((f"{key}.{i}", v) for i, v in enumerate(value))
        elif isinstance(value, torch.Tensor) and not is_plain_tensor(value):
            raise SpecError(
                f"{where}: entry {key!r} is {describe(value)}, which DCP cannot store as a "
                "tensor item that loads back; declare the component format: torch (one "
                "torch.save file, loaded with weights_only=True), or convert it to a dense "
                "tensor in state_dict()"
            )


def _checked_targets(task: LoadTask, record: ComponentRecord, adapter: TensorState | None,
                     ctx: ReadContext, reader: GroupReader, sidecar_bytes: bytes | None,
                     ) -> tuple[TensorState, dict[str, Any] | None, dict[str, TensorMeta],
                                dict[str, Any], str | None]:
    """The adapter, sidecar, stored tensor metas, load targets and their fingerprint."""
    adapter = require_object(task, adapter)
    sidecar = None
    if sidecar_bytes is not None:
        path = f"{ctx.name}/{task.directory}/{SIDECAR_NAME}"
        sidecar = decode_state(sidecar_bytes, ctx.backend.display(path))
    metadata = reader.read_metadata()
    # Items saved without a digest (before statereg recorded them) are checked by
    # reading their files whole now, before anything live changes.
    reader.verify_unchecked(metadata)
    stored = dcp_tensor_metas(metadata)
    targets = adapter.load_targets(stored, record.meta, ctx.strict, sidecar)
    return adapter, sidecar, stored, targets, _fingerprint(targets)


def _fingerprint(targets: dict[str, Any]) -> str | None:
    """What ranks must hold alike for one rank's read of an item to serve them all: every
    target's name, type, shape and dtype. None when a target is a shard of a tensor
    (DTensor): each rank then needs items of its own."""
    described: list[tuple[Any, ...]] = []
    for key, value in targets.items():
        if isinstance(value, torch.Tensor):
            if type(value) not in PLAIN_TENSOR_TYPES:
                return None
            described.append((key, "tensor", tuple(value.shape), str(value.dtype)))
        else:
            described.append((key, type(value).__qualname__))
    return hashlib.sha256(repr(described).encode()).hexdigest()


def assign_files(sizes: Mapping[str, int], ranks: Sequence[int]) -> dict[str, int]:
    """Each file to one rank, balancing bytes: the largest file first, to the rank holding
    the fewest bytes so far (ties: the lower rank). Deterministic, so every rank computes it."""
    held = dict.fromkeys(ranks, 0)
    owners = {}
    for path in sorted(sizes, key=lambda p: (-sizes[p], p)):
        rank = min(ranks, key=lambda r: (held[r], r))
        owners[path] = rank
        held[rank] += sizes[path]
    return owners


class _KeepBytes:
    """The load planner, keeping each non-tensor item's bytes as they load, to send on."""

    def __init__(self, planner: LoadPlanner) -> None:
        self.planner = planner
        self.blobs: dict[tuple[MetadataIndex, MetadataIndex], bytes] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.planner, name)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        data = value.getvalue()
        self.blobs[(read_item.storage_index, read_item.dest_index)] = data
        self.planner.load_bytes(read_item, io.BytesIO(data))


class GroupReader(BackendReader):
    """BackendReader of one load task's directory for a rank of its collective.

    `.metadata` comes as bytes, read once for the collective (ReadContext.read_once). With
    `shared` set (every rank of the collective needs the same items: a replicated or global
    component, a group's copy) and `broadcast` (the I/O policy's `broadcast_reads`), each data
    file is read by one rank only (`assign_files`),
    checked item by item as any read is, and its items are broadcast from that rank over the
    collective's gloo group: the job reads each stored byte once. A failed read is raised
    on every rank before anything is sent (a damaged item: CorruptCheckpointError on all).
    """

    def __init__(self, backend: ReadableStore, path: str,
                 records: Mapping[str, FileRecord] | None, metadata: bytes, world: World,
                 group: Any, thread_count: int, broadcast: bool) -> None:
        super().__init__(backend, path, thread_count, records=records)
        self.source = backend
        self.broadcast = broadcast  # the I/O policy's broadcast_reads
        self.metadata_bytes = metadata
        self.metadata_digest = metadata_digest(metadata)  # read_metadata and the plan's key
        self.world = world
        self.group = group
        self.shared = False

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        where = self.source.display(f"{self.path}/{METADATA_NAME}")
        # A fresh object each time (DCP sets fields on it), the same bytes checked once.
        metadata = load_dcp_metadata(self.metadata_bytes, where, self.metadata_digest)
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        if not self.shared or not self.broadcast:
            return super().read_data(plan, planner)
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path,
                                []).append(item)
        sizes = {path: sum(self.storage_data[i.storage_index].length for i in items)
                 for path, items in per_file.items()}
        owners = assign_files(sizes, self.world.members(self.group))
        rank = self.world.rank
        mine = [i for path, items in per_file.items() if owners[path] == rank for i in items]
        keeper = _KeepBytes(planner)
        with caught() as reading:
            # A proxy: every other LoadPlanner method reaches `planner` through __getattr__.
            super().read_data(dataclasses.replace(plan, items=mine), cast(LoadPlanner, keeper))
        self.world.agree(reading.error, f"reading {self.source.display(self.path)}", self.group)
        for path in sorted(per_file):
            items = sorted(per_file[path], key=lambda i: self.storage_data[i.storage_index].offset)
            for item in items:
                self._send(item, owners[path], planner, keeper)
        done: Future = Future()
        done.set_result(None)
        return done

    def _send(self, item: ReadItem, owner: int, planner: LoadPlanner, keeper: _KeepBytes,
              ) -> None:
        """Broadcast one item from the rank that read it into the same place on the others."""
        mine = owner == self.world.rank
        if item.type == LoadItemType.BYTE_IO:
            key = (item.storage_index, item.dest_index)
            blob = self.world.broadcast(keeper.blobs.get(key), src=owner, group=self.group)
            if not mine:
                planner.load_bytes(item, io.BytesIO(blob))
            return
        target = planner.resolve_tensor(item).detach()
        if target.numel() == 0:
            buffer = None
        elif target.device.type == "cpu" and target.is_contiguous():
            buffer = target  # received in place
        else:
            buffer = target.cpu().contiguous() if mine else torch.empty(
                target.shape, dtype=target.dtype)
        if buffer is not None:
            dist.broadcast(buffer.reshape(-1).view(torch.uint8), src=owner, group=self.group)
            if not mine and buffer is not target:
                target.copy_(buffer)
        if not mine:
            planner.commit_tensor(item, target)
