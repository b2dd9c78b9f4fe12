"""Incremental saves: which stored item an unchanged tensor can point at instead of being written.

An item is named by `item_key` (its key, and a shard's offsets) and compared by
`tensor_digest` (xxh3_128 of its bytes, dtype and shape) against the `Reusable` records of an
earlier checkpoint (engine/incremental.py builds them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import xxhash
from torch.distributed.checkpoint.metadata import MetadataIndex


@dataclass(frozen=True)
class Reusable:
    """Where an earlier checkpoint stored an item, and the digest of its bytes."""

    digest: str
    path: str  # relative to the backend root
    offset: int
    length: int
    transforms: tuple[str, ...] = ()
    checksum: int | None = None  # xxh3_64 of the stored bytes, when the earlier save recorded it


def item_key(index: MetadataIndex) -> str:
    """A stable name for one stored item: its key and, for a shard, its offsets."""
    return index.fqn if index.offset is None else f"{index.fqn}@{list(index.offset)}"


def tensor_digest(tensor: torch.Tensor) -> str:
    """xxh3_128 of a tensor's bytes, with its dtype and shape (equal digests: equal tensors)."""
    data = tensor.detach().contiguous().view(-1).view(torch.uint8).numpy()
    # numpy's stubs give ndarray __buffer__ only on 3.12+:
    return f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}:" + \
        xxhash.xxh3_128_hexdigest(data)  # type: ignore[arg-type]
