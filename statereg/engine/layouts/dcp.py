"""The `dcp` layout: tensors through torch.distributed.checkpoint, one directory per copy.

The task names the directory (the component's, a group's, or a rank's own) and the
collective DCP plans over; an optimizer's param groups and scalar state go to a JSON
sidecar written by the task's leader.
"""

from __future__ import annotations

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
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from statereg.backends.dcp_io import BackendReader, BackendWriter, SafeLoadPlanner
from statereg.engine.layouts.base import (
    Captured,
    Prepared,
    ReadContext,
    WriteContext,
    key_report,
    nothing,
    require_object,
)
from statereg.engine.plan import LoadTask, Task
from statereg.formats.jsonstate import decode_state, encode_state
from statereg.formats.names import SIDECAR_NAME
from statereg.formats.tensors import dcp_tensor_metas
from statereg.schemas.manifest import ComponentRecord

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


class DCPLayout:
    """Saves and loads a tensor-state component through DCP, as its task says."""

    def capture(self, task: Task, adapter: Any) -> Captured:
        state = adapter.capture()
        item = Captured(task, tensors=state.tensors, meta=state.meta)
        if task.leader and state.sidecar is not None:
            item.blobs[f"{task.directory}/{SIDECAR_NAME}"] = encode_state(
                state.sidecar, f"component {task.component!r}")
        return item

    def write(self, item: Captured, ctx: WriteContext) -> BackendWriter:
        task = item.task
        group = ctx.world.process_group(task.collective)
        writer = BackendWriter(ctx.backend, f"{ctx.name}/{task.directory}", ctx.recorder,
                               thread_count=task.io_threads or ctx.backend.default_io_threads,
                               compression=ctx.compression,
                               reuse=ctx.reuse(task.directory) if ctx.reuse else None)
        dcp.save(item.tensors, storage_writer=writer, planner=StateregSavePlanner(),
                 process_group=group, no_dist=group is None)
        return writer

    def prepare(self, task: LoadTask, record: ComponentRecord, adapter: Any,
                ctx: ReadContext) -> Prepared:
        if task.policy == "reset":
            return Prepared(nothing)
        adapter = require_object(task, adapter)
        directory = f"{ctx.name}/{task.directory}"
        reader = BackendReader(ctx.backend, directory, records=ctx.records)
        sidecar = None
        if f"{task.directory}/{SIDECAR_NAME}" in record.files:
            path = f"{directory}/{SIDECAR_NAME}"
            sidecar = decode_state(ctx.backend.read_bytes(path), ctx.backend.display(path))
        metadata = reader.read_metadata()
        # Items saved without a digest (before statereg recorded them) are checked by
        # reading their files whole now, before anything live changes.
        reader.verify_unchecked(metadata)
        stored = dcp_tensor_metas(metadata)
        targets = adapter.load_targets(stored, record.meta, ctx.strict, sidecar)
        group = ctx.world.process_group(task.collective)

        def apply() -> None:
            dcp.load(targets, storage_reader=reader, planner=SafeLoadPlanner(),
                     process_group=group, no_dist=group is None)
            adapter.apply(targets, record.meta, sidecar)

        return Prepared(apply, keys=key_report(adapter, stored, record.meta, targets))
