"""Full tensors from sharded ones and back: the consolidation behind safetensors and torch files.

DCP writes each rank's shards where they are; the Hugging Face and torch formats hold one full
tensor per name. On save every rank sends the pieces it owns to rank 0, one file's worth at a
time, over statereg's own gloo group; on load every rank copies its own slice out of the full
tensor, so loading needs no collective and works at any world size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

from statereg.errors import CorruptCheckpointError
from statereg.formats.names import group_by_size
from statereg.state.protocols import TensorMeta


def tensor_meta(tensor: torch.Tensor) -> TensorMeta:
    """Global shape (a DTensor's full shape, not its shard's) and dtype."""
    return TensorMeta(tuple(tensor.shape), tensor.dtype)


def dcp_tensor_metas(metadata: Metadata) -> dict[str, TensorMeta]:
    """Shape and dtype of every tensor item of a DCP checkpoint's metadata."""
    return {
        fqn: TensorMeta(tuple(md.size), md.properties.dtype)
        for fqn, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }


def nbytes(meta: TensorMeta, dtype: torch.dtype | None = None) -> int:
    numel = 1
    for dim in meta.shape:
        numel *= dim
    return numel * (dtype or meta.dtype).itemsize


def plan_shards(metas: dict[str, TensorMeta], max_bytes: int) -> list[list[str]]:
    """Names grouped into files of at most `max_bytes`, in order; a larger tensor is alone."""
    return group_by_size(((name, nbytes(meta)) for name, meta in metas.items()), max_bytes)


def _local_piece(tensor: torch.Tensor, group_rank: int) -> tuple[tuple[int, ...], Any] | None:
    """(offsets, CPU copy) of the part of `tensor` this rank sends, or None if another rank does.

    A DTensor sends its shard unless it is a replica another rank also holds (only the first
    coordinate along each replicated mesh dimension sends). A plain tensor is the same on every
    rank (replicated, or DDP), so rank 0 of the group sends it.
    """
    if hasattr(tensor, "device_mesh"):
        dtensor = cast("DTensor", tensor)
        coordinate: Sequence[int] = dtensor.device_mesh.get_coordinate() or []
        for dim, placement in enumerate(dtensor.placements):
            if placement.is_replicate() and coordinate[dim] != 0:
                return None
        chunk = dtensor.__create_chunk_list__()[0]
        return tuple(chunk.offsets), _compact(dtensor.to_local().detach().cpu())
    if group_rank != 0:
        return None
    return (0,) * tensor.dim(), _compact(tensor.detach().cpu())


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` alone: a view into a larger storage would send all of that storage."""
    if tensor.untyped_storage().nbytes() > tensor.nbytes or not tensor.is_contiguous():
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def _slices(offsets: tuple[int, ...], shape: torch.Size) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offsets, shape, strict=True))


def gather_full(tensors: dict[str, torch.Tensor], names: list[str], group: Any,
                ) -> dict[str, torch.Tensor] | None:
    """Full CPU tensors of `names` on rank 0 of `group`, None on the other ranks.

    Collective over `group` (every rank calls it with the same names); `group` None: this
    process alone, whose tensors are already full.
    """
    if group is None:
        return {n: tensors[n].detach().cpu() for n in names}
    me = dist.get_rank(group)
    pieces = [(n, *piece) for n in names
              if (piece := _local_piece(tensors[n], me)) is not None]
    gathered: list[Any] | None = [None] * dist.get_world_size(group) if me == 0 else None
    dist.gather_object(pieces, gathered, dst=dist.get_global_rank(group, 0), group=group)
    if gathered is None:
        return None
    full = {n: torch.empty(tensors[n].shape, dtype=tensors[n].dtype) for n in names}
    filled = dict.fromkeys(names, 0)
    for rank_pieces in gathered:
        for name, offsets, local in rank_pieces:
            full[name][_slices(offsets, local.shape)].copy_(local)
            filled[name] += local.numel()
    short = [n for n in names if filled[n] != full[n].numel()]
    if short:
        raise CorruptCheckpointError(
            f"the ranks' shards of {', '.join(short[:5])} do not cover the full tensor; a "
            "placement other than Shard and Replicate (e.g. Partial) cannot be consolidated"
        )
    return full


def copy_full_into(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy `full` into `target`; a DTensor target takes only its own shard (no collective)."""
    if hasattr(target, "device_mesh"):
        dtarget = cast("DTensor", target)
        chunk = dtarget.__create_chunk_list__()[0]
        local = dtarget.to_local()
        local.copy_(full[_slices(tuple(chunk.offsets), local.shape)])
    else:
        target.copy_(full)


def owned(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors with storages of their own (safetensors refuses shared memory)."""
    seen: set[tuple[torch.device, int]] = set()
    result = {}
    for name, tensor in tensors.items():
        tensor = tensor.contiguous()
        key = (tensor.device, tensor.untyped_storage().data_ptr())
        if tensor.numel() and key in seen:
            tensor = tensor.clone()
        seen.add(key)
        result[name] = tensor
    return result
