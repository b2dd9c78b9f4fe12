"""`StateregSavePlanner`: DCP's default save planner, with a one-pass path for flat dicts.

Also `plan_digest`, by which ranks tell whether a save plans what the last one planned
(engine/layouts/dcp.py `SavePlans` reuses the plans then).
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import torch
import xxhash
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

# Exactly these types are whole local tensors to DCP (DTensor and ShardedTensor subclass Tensor).
PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


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

    def __init__(self, coordinator_only: frozenset[str] = frozenset()) -> None:
        """`coordinator_only`: keys of plain tensors every rank holds a copy of, which only the
        coordinator's plan writes, so that the stored tensor is one rank's copy (DCP's
        deduplication would otherwise pick each key's writer by balance, and a checkpoint
        could hold one buffer from one rank and the next from another)."""
        super().__init__()
        self._plain = False
        self._coordinator_only = coordinator_only

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: StorageMeta | None = None,
                       is_coordinator: bool = False) -> None:
        self._plain = all(type(key) is str and type(value) in PLAIN_TENSOR_TYPES
                          for key, value in state_dict.items())
        if not self._plain:
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
            return
        # What flatten_state_dict returns for a flat dict of tensors: itself, keys as paths.
        self.state_dict = dict(state_dict)
        self.mappings = {key: (key,) for key in state_dict}
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        plan = self._local_plan()
        if self._coordinator_only and not self.is_coordinator:
            plan = dataclasses.replace(plan, items=[
                item for item in plan.items if item.index.fqn not in self._coordinator_only])
            self.plan = plan
        return plan

    def _local_plan(self) -> SavePlan:
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
            return self._default_global_plan(all_plans)
        plan = all_plans[0]
        md: dict[str, Any] = {}
        shared: dict[int, TensorStorageMetadata] = {}
        for item in plan.items:
            data = item.tensor_data
            if item.type != WriteItemType.TENSOR or data is None or item.index.fqn in md:
                return self._default_global_plan(all_plans)  # not a plan of ours
            stored = shared.get(id(data))
            if stored is None:
                stored = shared[id(data)] = TensorStorageMetadata(
                    properties=data.properties, size=data.size, chunks=[data.chunk])
            md[item.index.fqn] = stored
        self.global_plan = all_plans
        self.metadata = Metadata(md, planner_data=dict(plan.planner_data or {}))
        return all_plans, self.metadata

    def _default_global_plan(self, all_plans: list[SavePlan],
                             ) -> tuple[list[SavePlan], Metadata]:
        """DCP's global plan, with `.metadata`'s entries in the order the state had, not in
        the order deduplication left: rank 0's items first, as its state dict listed them.
        A load fills each object in that order (AdamW's per-parameter state comes back as
        step, exp_avg, exp_avg_sq, as an uninterrupted run has it, not shuffled by which rank
        wrote which moment)."""
        plans, metadata = super().create_global_plan(all_plans)
        order: dict[str, int] = {}
        for plan in all_plans:
            for item in plan.items:
                order.setdefault(item.index.fqn, len(order))
        entries = metadata.state_dict_metadata
        metadata.state_dict_metadata = dict(sorted(
            entries.items(), key=lambda entry: order.get(entry[0], len(order))))
        return plans, metadata

    def resolve_data(self, write_item: WriteItem) -> Any:
        if self._plain:
            return self.state_dict[write_item.index.fqn]
        return super().resolve_data(write_item)


def plan_digest(plan: SavePlan) -> str:
    """A digest of a local save plan: equal digests on every rank, equal global plans."""
    return xxhash.xxh3_128_hexdigest(
        pickle.dumps((plan.items, plan.planner_data), protocol=pickle.HIGHEST_PROTOCOL))
