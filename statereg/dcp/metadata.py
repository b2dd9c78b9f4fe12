"""DCP's `.metadata`: its name, the item digests statereg adds to it, and reading it safely.

`.metadata` is a pickle; a raw `pickle.load` can run code, so it is read with an unpickler
that admits only DCP's metadata classes (and torch dtypes), then checked field by field
(`load_dcp_metadata`). Each item's xxh3_64 of its stored bytes is kept in the attribute
`ITEM_CHECKSUMS`, which plain DCP unpickles and ignores.
"""

from __future__ import annotations

import gc
import hashlib
import io
import pickle
from collections.abc import Generator, Sequence
from contextlib import contextmanager
from typing import Any, TypeGuard

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from statereg.errors import CorruptCheckpointError
from statereg.process_state import process_wide

# The attribute of DCP's Metadata holding each item's xxh3_64 (of its stored bytes), keyed by
# the same MetadataIndex objects as `storage_data` (pickle stores each key once). Plain DCP
# unpickles it as one more attribute and ignores it.
ITEM_CHECKSUMS = "statereg_item_checksums"


_ALLOWED_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only the classes DCP's `.metadata` is made of (and torch dtypes)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed in DCP metadata")


def metadata_digest(data: bytes) -> bytes:
    """What names `.metadata` bytes in this process's caches: a BLAKE2b digest, so that no
    crafted file can pass for bytes checked before (~0.1 ms for 600 tensors' metadata)."""
    return hashlib.blake2b(data, digest_size=16).digest()


# Digests of `.metadata` bytes that passed `_metadata_defect` in this process: a later load
# of the same checkpoint unpickles them again (DCP sets fields on the object) but skips the
# field walk (~2 ms for 600 tensors).
_checked_digests: dict[bytes, None] = {}
_CHECKED_KEPT = 256
process_wide(__name__, "_checked_digests", ".metadata bytes whose fields were checked: a later "
             "load of them skips the walk")


def load_dcp_metadata(data: bytes, source: str, digest: bytes | None = None) -> Metadata:
    """Unpickle DCP metadata bytes without running code from them, and check every field
    (unless these very bytes passed the check before in this process). `digest`:
    `metadata_digest(data)`, where the caller keeps it."""
    digest = digest or metadata_digest(data)
    checked = digest in _checked_digests
    try:
        with gc_paused():
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:
        raise CorruptCheckpointError(
            f"{source}: DCP metadata cannot be read safely ({exc}); the file is damaged or was "
            "not written by torch.distributed.checkpoint"
        ) from None
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"{source}: not a DCP Metadata object")
    defect = None if checked else _metadata_defect(metadata)
    if defect is not None:
        raise CorruptCheckpointError(
            f"{source}: DCP metadata is malformed ({defect}); the file is damaged or was not "
            "written by torch.distributed.checkpoint"
        )
    if not checked:
        if len(_checked_digests) >= _CHECKED_KEPT:
            _checked_digests.clear()
        _checked_digests[digest] = None
    return metadata


def _is_size(value: Any) -> TypeGuard[torch.Size]:
    return isinstance(value, torch.Size) and all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value)


def _metadata_defect(metadata: Metadata) -> str | None:
    """What in an unpickled Metadata is not what DCP writes, or None. The unpickler admits
    only DCP's classes, but a flipped byte can still rename a field or change its type (a
    Metadata without state_dict_metadata, a str where a dtype belongs); every reader of the
    metadata (loads, export, `inspect`) would then fail with an AttributeError or TypeError
    instead of naming the damaged file."""
    items = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(items, dict):
        return "state_dict_metadata is not a dict"
    for fqn, md in items.items():
        if not isinstance(fqn, str):
            return f"item name {fqn!r} is not a string"
        if isinstance(md, BytesStorageMetadata):
            continue
        if not isinstance(md, TensorStorageMetadata):
            return f"item {fqn!r} is a {type(md).__name__}"
        props = getattr(md, "properties", None)
        size = getattr(md, "size", None)
        chunks = getattr(md, "chunks", None)
        if not isinstance(props, TensorProperties) \
                or not isinstance(getattr(props, "dtype", None), torch.dtype):
            return f"item {fqn!r} has no tensor dtype"
        if not _is_size(size) or not isinstance(chunks, list):
            return f"item {fqn!r} has no valid size or chunks"
        for chunk in chunks:
            if not isinstance(chunk, ChunkStorageMetadata) \
                    or not _is_size(getattr(chunk, "offsets", None)) \
                    or not _is_size(getattr(chunk, "sizes", None)) \
                    or not len(chunk.offsets) == len(chunk.sizes) == len(size):
                return f"item {fqn!r} has a malformed chunk"
    storage = getattr(metadata, "storage_data", None)
    if storage is not None and not isinstance(storage, dict):
        return "storage_data is not a dict"
    for index, info in (storage or {}).items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str):
            return f"storage key {index!r} is not a MetadataIndex"
        if not isinstance(getattr(info, "relative_path", None), str) \
                or not all(isinstance(getattr(info, f, None), int) and getattr(info, f) >= 0
                           for f in ("offset", "length")):
            return f"storage of {index.fqn!r} has no valid file, offset or length"
    checksums = getattr(metadata, ITEM_CHECKSUMS, None)
    if checksums is not None and (not isinstance(checksums, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in checksums.values())):
        return f"{ITEM_CHECKSUMS} is not a dict of integers"
    return None


def item_checksums(metadata: Metadata) -> dict[MetadataIndex, int]:
    """Each item's xxh3_64 of its stored bytes, as the writer recorded them (empty for
    checkpoints written before statereg recorded them)."""
    checksums = getattr(metadata, ITEM_CHECKSUMS, None)
    return checksums if isinstance(checksums, dict) else {}


_DESCRIPTORS: dict[tuple[str, ...], tuple[str, ...]] = {}
process_wide(__name__, "_DESCRIPTORS", "one tuple per descriptor list, so pickle writes it once")


def shared_descriptors(descriptors: Sequence[str]) -> tuple[str, ...] | None:
    """One tuple object per distinct descriptor list: pickle writes it once, then refers to it."""
    if not descriptors:
        return None
    key = tuple(descriptors)
    return _DESCRIPTORS.setdefault(key, key)


@contextmanager
def gc_paused() -> Generator[None, None, None]:
    """Pickling or unpickling 100k items allocates objects that only live on: no gc passes."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
