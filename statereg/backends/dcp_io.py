"""Glue that lets torch.distributed.checkpoint read and write through a StorageBackend.

We reuse DCP's FileSystemWriter/Reader (planning, file splitting, the on-storage format) and
replace the filesystem underneath, for three reasons:
- every file is checksummed while it is written and reported to a FileRecorder;
- the backend is built once with its options (DCP's `reset(checkpoint_id)` would rebuild an
  fsspec filesystem without them);
- `.metadata` is written in place (no tmp + rename, which object stores cannot do atomically)
  and read back with a restricted unpickler, since a raw `pickle.load` can run code.
The per-file loops are ours too (DCP's are private API): each tensor item is a `torch.save`
record, written with torch.save itself, and read straight into its destination (torchsave.py).
Every item's stored bytes are hashed as they are written (xxh3_64) and the digests kept in
`.metadata` (`ITEM_CHECKSUMS`), which the manifest's checksum covers: a load checks each item
as it reads it, at no extra I/O, and never trusts a byte the manifest does not vouch for.
Private torch names come from torch_private.py only; `.metadata` is pickled the way DCP
pickles it, item locations by field name, so it never depends on a private class's field order.
"""

from __future__ import annotations

import dataclasses
import gc
import io
import itertools
import os
import pickle
import posixpath
import queue
import threading
import warnings
from array import array
from collections.abc import Generator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import (
    FileSystemBase,
    FileSystemReader,
    FileSystemWriter,
)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from statereg.backends import codec, torchsave
from statereg.backends.base import StorageBackend
from statereg.backends.checksum import (
    FileRecorder,
    HashingWriter,
    Recorded,
    VerifiedReads,
    verify_stream,
)
from statereg.backends.device_reads import DeviceLanding
from statereg.backends.torch_private import StorageInfo, storage_info
from statereg.errors import CorruptCheckpointError

METADATA_NAME = ".metadata"
# The attribute of DCP's Metadata holding each item's xxh3_64 (of its stored bytes), keyed by
# the same MetadataIndex objects as `storage_data` (pickle stores each key once). Plain DCP
# unpickles it as one more attribute and ignores it.
ITEM_CHECKSUMS = "statereg_item_checksums"
# What torch.save adds around a tensor's bytes (zip headers, the pickled tensor record).
_TORCH_SAVE_OVERHEAD = 64 * 1024
# Largest non-tensor item (pickled object) a compressed frame may inflate to.
MAX_OBJECT_BYTES = 1 << 30

# DCP warns on every single-process save/load; statereg chooses single-process on purpose.
warnings.filterwarnings(
    "ignore",
    message="torch.distributed is disabled, unavailable or uninitialized",
    module=r"torch\.distributed\.checkpoint",
)

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


def load_dcp_metadata(data: bytes, source: str) -> Metadata:
    """Unpickle DCP metadata bytes without running code from them."""
    try:
        with _gc_paused():
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:
        raise CorruptCheckpointError(
            f"{source}: DCP metadata cannot be read safely ({exc}); the file is damaged or was "
            "not written by torch.distributed.checkpoint"
        ) from None
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"{source}: not a DCP Metadata object")
    defect = _metadata_defect(metadata)
    if defect is not None:
        raise CorruptCheckpointError(
            f"{source}: DCP metadata is malformed ({defect}); the file is damaged or was not "
            "written by torch.distributed.checkpoint"
        )
    return metadata


def _is_size(value: Any) -> bool:
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


def normalize_path(path: str) -> str:
    """Resolve '..' (items an incremental save references); never above the backend root."""
    if "/../" not in f"/{path}":
        return path
    resolved = posixpath.normpath(path)
    if resolved == ".." or resolved.startswith(("../", "/")):
        raise CorruptCheckpointError(
            f"DCP metadata refers to {path!r}, outside the checkpoint root; refusing to read it"
        )
    return resolved


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
    return f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}:" + \
        xxhash.xxh3_128_hexdigest(data)


class BackendFileSystem(FileSystemBase):
    """DCP's FileSystemBase over a StorageBackend; paths are relative to the backend root."""

    def __init__(self, backend: StorageBackend, recorder: FileRecorder | None = None,
                 sizes: dict[str, int] | None = None) -> None:
        self.backend = backend
        self.recorder = recorder
        self.sizes = sizes or {}  # file sizes known from the manifest, by path

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        path = normalize_path(os.fspath(path))
        if "r" in mode:
            with self.backend.open_read(path, self.sizes.get(path)) as stream:
                yield stream
            return
        on_done = self.recorder.add if self.recorder is not None else None
        writer: HashingWriter = self.backend.open_write(path, on_done)
        try:
            yield writer
        except BaseException:
            writer.abort()
            raise
        writer.close()

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return f"{os.fspath(path)}/{suffix}"

    def init_path(self, path: str | os.PathLike) -> str:
        return os.fspath(path)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        raise NotImplementedError("statereg's DCP glue never renames (object stores cannot)")

    def mkdir(self, path: str | os.PathLike) -> None:
        self.backend.makedirs(os.fspath(path))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False

    def exists(self, path: str | os.PathLike) -> bool:
        return self.backend.exists(os.fspath(path))

    def rm_file(self, path: str | os.PathLike) -> None:
        self.backend.remove_file(os.fspath(path))


class BackendWriter(FileSystemWriter):
    """DCP storage writer into `path` (relative to the backend root), one fresh directory."""

    def __init__(self, backend: StorageBackend, path: str, recorder: FileRecorder,
                 thread_count: int = 1,
                 compression: codec.CompressionSettings | None = None,
                 reuse: Mapping[str, Reusable] | None = None) -> None:
        # sync_files=False: our streams are made durable by the backend before they are
        # reported (DCP's own fsync falls back to a machine-wide os.sync() on remote streams).
        super().__init__(path, sync_files=False, thread_count=thread_count, overwrite=False)
        self.fs = BackendFileSystem(backend, recorder)
        self.path = path
        self.compressor = CompressingTransforms(compression) if compression is not None else None
        # Incremental saves: items whose digest matches `reuse` are referenced, not written.
        self.reuse = reuse
        self.digests: dict[str, str] = {}
        self.referenced: set[str] = set()
        # What this save wrote (this rank's results) and, on the coordinator, every rank's
        # results `.metadata` was made of: a later save of the same plan sends only their
        # differences (ItemReports).
        self.written: list[WriteResult] = []
        self.finished: list[list[WriteResult]] = []

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Rank i's files are `__{i}_{n}.distcp`, as DCP names them; the prefix travels as a
        # plain string (DCP's own holder is a private class).
        return [dataclasses.replace(plan, storage_data=f"__{i}_") for i, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        """Write this rank's items into up to `thread_count` files; the first failure raises.

        DCP's version runs extra writer threads whose exceptions are printed and lost, and then
        commits metadata without their files, and it makes a file per thread even for a thread
        with no items (on an object store, a request and a manifest entry each).
        """
        prefix = plan.storage_data
        pending: queue.Queue = queue.Queue()
        results: queue.Queue = queue.Queue()
        errors: list[BaseException] = []
        items = plan.items
        if self.reuse is not None:
            reused, items = self._reference_unchanged(planner, items)
            results.put(reused)
        for number, bucket in enumerate(b for b in _split_into_files(self.thread_count, items)
                                        if b):
            name = f"{prefix}{number}.distcp"
            pending.put((self.fs.concat_path(self.path, name), name, bucket))

        def drain_queue() -> None:
            try:
                while True:
                    try:
                        file_name, storage_key, bucket = pending.get_nowait()
                    except queue.Empty:
                        return
                    results.put(self._write_file(planner, file_name, storage_key, bucket))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=drain_queue, name=f"statereg-write-{i}")
                   for i in range(1, min(self.thread_count, pending.qsize()))]
        for thread in threads:
            thread.start()
        drain_queue()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        self.written = [wr for _ in range(results.qsize()) for wr in results.get_nowait()]
        done: Future = Future()
        done.set_result(self.written)
        return done

    def _reference_unchanged(self, planner: SavePlanner, items: list[WriteItem],
                             ) -> tuple[list[WriteResult], list[WriteItem]]:
        """Results pointing at the reusable copies of unchanged items, and the items to write."""
        assert self.reuse is not None
        results, kept = [], []
        relative_paths: dict[str, str] = {}
        for item in items:
            if item.type == WriteItemType.BYTE_IO:
                kept.append(item)
                continue
            key = item_key(item.index)
            digest = self.digests[key] = tensor_digest(planner.resolve_data(item))
            old = self.reuse.get(key)
            if old is None or old.digest != digest:
                kept.append(item)
                continue
            self.referenced.add(old.path)
            relative = relative_paths.get(old.path)
            if relative is None:  # one string per file: `.metadata` pickles it once
                relative = relative_paths[old.path] = posixpath.relpath(old.path, self.path)
            results.append(WriteResult(
                index=item.index, size_in_bytes=old.length,
                storage_data=(storage_info(relative, old.offset, old.length,
                                           _shared_descriptors(old.transforms)),
                              old.checksum)))
        return results, kept

    def _write_file(self, planner: SavePlanner, file_name: str, storage_key: str,
                    items: list[WriteItem]) -> list[WriteResult]:
        """One DCP file: what DCP's writer does; each tensor item is one torch.save record.

        Each result's storage data is (DCP's StorageInfo, the item's xxh3_64); `finish`
        splits them into `.metadata`'s storage_data and ITEM_CHECKSUMS.
        """
        results = []
        ordered = ([i for i in items if i.type == WriteItemType.BYTE_IO]
                   + [i for i in items if i.type != WriteItemType.BYTE_IO])
        with self.fs.create_stream(file_name, "wb") as file_stream:
            for item in ordered:
                data = planner.resolve_data(item)
                offset = file_stream.tell()
                stream = _HashingTee(file_stream)
                target, descriptors = stream, ()
                if self.compressor is not None:
                    target, descriptors = self.compressor.encoder(item, stream)
                if item.type == WriteItemType.BYTE_IO:
                    target.write(data.getbuffer())
                else:
                    tensor = data.detach().cpu()
                    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
                        tensor = tensor.clone()  # torch.save would write the whole storage
                    torch.save(tensor, target)
                if target is not stream:
                    target.close()
                length = file_stream.tell() - offset
                results.append(WriteResult(
                    index=item.index, size_in_bytes=length,
                    storage_data=(storage_info(storage_key, offset, length,
                                               _shared_descriptors(descriptors)),
                                  stream.hasher.intdigest())))
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Write `.metadata`: `metadata`'s tensors with where this save put each item and the
        digest of its bytes (always this save's results, also when the plan was reused)."""
        self.finished = results
        metadata.version = "1.0.0"
        metadata.storage_data = {}
        checksums: dict[MetadataIndex, int] = {}
        for wr in itertools.chain.from_iterable(results):
            metadata.storage_data[wr.index], checksum = wr.storage_data
            if checksum is not None:
                checksums[wr.index] = checksum
        setattr(metadata, ITEM_CHECKSUMS, checksums)
        metadata.storage_meta = StorageMeta(checkpoint_id=self.path, save_id=self.save_id)
        with self.fs.create_stream(self.fs.concat_path(self.path, METADATA_NAME), "wb") as out, \
                _gc_paused():
            # Plain pickle, as DCP writes it: item locations are pickled by field name.
            pickle.dump(metadata, out)


class _HashingTee(io.RawIOBase):
    """Passes one item's bytes on to the file's stream, hashing them on the way."""

    def __init__(self, stream: io.IOBase) -> None:
        super().__init__()
        self._stream = stream
        self.hasher = xxhash.xxh3_64()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.hasher.update(data)
        return self._stream.write(data)


@dataclass(frozen=True)
class ItemReports:
    """One rank's write results of one DCP save, in its plan's item order, packed for the
    coordinator that writes `.metadata`.

    Each file name and descriptor list travels once; each item is four integers of location
    (file, offset, length, descriptor) and its xxh3_64. `locations` is None when they equal
    those of the rank's previous save of the same plan (uncompressed items of unchanged
    shapes land where they landed before): then only the digests travel, 8 bytes per item.
    """

    paths: tuple[str, ...]
    descriptors: tuple[tuple[str, ...] | None, ...]
    locations: array | None  # 4 per item: path id, offset, length, descriptor id
    checksums: array  # xxh3_64 of each item's stored bytes
    unchecked: tuple[int, ...] = ()  # items without a digest (reused from an older save)

    def to_send(self, previous: ItemReports | None) -> ItemReports:
        """These reports, without the locations when `previous` (the last save's) had them."""
        if (previous is not None and previous.paths == self.paths
                and previous.descriptors == self.descriptors
                and previous.locations == self.locations):
            return dataclasses.replace(self, locations=None)
        return self


def pack_results(indices: Sequence[MetadataIndex], results: Sequence[WriteResult],
                 ) -> ItemReports:
    """`results` (one per item of a plan whose items are `indices`) as ItemReports."""
    position = {index: n for n, index in enumerate(indices)}
    if len(results) != len(position):
        raise ValueError(f"{len(results)} write results for a plan of {len(position)} items")
    ordered: list[Any] = [None] * len(results)
    for wr in results:  # in plan order: ids then do not depend on which thread wrote first
        ordered[position[wr.index]] = wr.storage_data
    locations = array("Q", bytes(32 * len(results)))
    checksums = array("Q", bytes(8 * len(results)))
    paths: dict[str, int] = {}
    descriptors: dict[tuple[str, ...] | None, int] = {}
    unchecked = []
    for n, (info, checksum) in enumerate(ordered):
        locations[4 * n] = paths.setdefault(info.relative_path, len(paths))
        locations[4 * n + 1] = info.offset
        locations[4 * n + 2] = info.length
        key = tuple(info.transform_descriptors) if info.transform_descriptors else None
        locations[4 * n + 3] = descriptors.setdefault(key, len(descriptors))
        if checksum is None:
            unchecked.append(n)
        else:
            checksums[n] = checksum
    return ItemReports(tuple(paths), tuple(descriptors), locations, checksums, tuple(unchecked))


def unpack_results(indices: Sequence[MetadataIndex], reports: ItemReports,
                   previous: ItemReports | None) -> tuple[list[WriteResult], ItemReports]:
    """The write results `reports` stand for, and the reports whole (locations filled in
    from `previous`, the same rank's last reports, when they did not travel)."""
    if len(reports.checksums) != len(indices):
        raise ValueError(f"item reports of {len(reports.checksums)} items for a plan of "
                         f"{len(indices)} items")
    if reports.locations is None:
        if previous is None or previous.locations is None:
            raise ValueError("item reports without locations, and no earlier ones to take "
                             "them from")
        reports = dataclasses.replace(reports, locations=previous.locations)
    locations = reports.locations
    assert locations is not None
    unchecked = set(reports.unchecked)
    descriptors = [_shared_descriptors(d) if d else None for d in reports.descriptors]
    results = []
    for n, index in enumerate(indices):
        path, offset, length, descriptor = locations[4 * n:4 * n + 4]
        results.append(WriteResult(
            index=index, size_in_bytes=length,
            storage_data=(storage_info(reports.paths[path], offset, length,
                                       descriptors[descriptor]),
                          None if n in unchecked else reports.checksums[n])))
    return results, reports


_DESCRIPTORS: dict[tuple[str, ...], tuple[str, ...]] = {}


def _shared_descriptors(descriptors: Sequence[str]) -> tuple[str, ...] | None:
    """One tuple object per distinct descriptor list: pickle writes it once, then refers to it."""
    if not descriptors:
        return None
    key = tuple(descriptors)
    return _DESCRIPTORS.setdefault(key, key)


@contextmanager
def _gc_paused() -> Generator[None, None, None]:
    """Pickling or unpickling 100k items allocates objects that only live on: no gc passes."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _item_size(item: WriteItem) -> int:
    assert item.tensor_data is not None
    return item.tensor_data.size.numel() * item.tensor_data.properties.dtype.itemsize


def _split_into_files(count: int, items: list[WriteItem]) -> list[list[WriteItem]]:
    """DCP's split of one rank's items into `count` files: objects round-robin, then tensors,
    largest first, each into the file with the fewest bytes so far."""
    buckets: list[list[WriteItem]] = [[] for _ in range(count)]
    sizes = [0] * count
    objects = [i for i in items if i.type == WriteItemType.BYTE_IO]
    tensors = sorted((i for i in items if i.type != WriteItemType.BYTE_IO), key=_item_size,
                     reverse=True)
    for number, item in enumerate(objects):
        buckets[number % count].append(item)
    for item in tensors:
        smallest = sizes.index(min(sizes))
        buckets[smallest].append(item)
        sizes[smallest] += _item_size(item)
    return buckets


class CompressingTransforms:
    """Compresses each DCP item on its own: float tensors by planes (if asked), others zstd."""

    def __init__(self, settings: codec.CompressionSettings) -> None:
        self.settings = settings

    def encoder(self, write_item: WriteItem, raw_stream: io.IOBase) -> tuple[Any, tuple[str]]:
        """The stream one item is written into, and the descriptor `.metadata` records."""
        settings = self.settings

        def zstd(prefix: bytes, body: memoryview | None, suffix: bytes, write: Any) -> None:
            codec.encode_zstd_parts(prefix, body, suffix, settings, write)

        if write_item.type == WriteItemType.BYTE_IO or write_item.tensor_data is None:
            return codec.EncodingStream(raw_stream, zstd), (codec.ZSTD_DESCRIPTOR,)
        dtype = write_item.tensor_data.properties.dtype
        body_size = write_item.tensor_data.chunk.sizes.numel() * dtype.itemsize
        layout = codec.float_layout(dtype) if settings.float_aware else None
        if layout is None or body_size < codec.MIN_PLANES_BYTES:
            return codec.EncodingStream(raw_stream, zstd, body_size), (codec.ZSTD_DESCRIPTOR,)
        size, rotate = layout

        def encode(prefix: bytes, body: memoryview | None, suffix: bytes, write: Any) -> None:
            if body is None:  # torch.save did not write the tensor in one piece: plane it all
                body, prefix = memoryview(prefix), b""
            codec.encode_planes(body, size, rotate, settings, write, prefix, suffix)

        return codec.EncodingStream(raw_stream, encode, body_size), (codec.PLANES_DESCRIPTOR,)


class BackendReader(FileSystemReader):
    """DCP storage reader from `path` under the backend root, with safe metadata loading.

    With `records` (the manifest's files, by path from the backend root) every item is
    checked as it is read: its stored bytes against its ITEM_CHECKSUMS digest, before they
    are decoded, or (read straight into a tensor) as they arrive. Items without a digest
    (checkpoints from before digests, or incremental items referencing one) are in
    `unchecked_files()`, which the caller verifies whole before the load. Without `records`
    (verify="off", or a directory without a manifest) nothing is checked. Over a
    `VerifiedReads` backend the records default to its own, so any reader built on a
    verified backend (export, inspect, copy) checks what it reads.
    """

    def __init__(self, backend: StorageBackend, path: str, thread_count: int | None = None,
                 records: Mapping[str, Recorded] | None = None) -> None:
        super().__init__(path)
        if records is None and isinstance(backend, VerifiedReads):
            records = backend.records
        sizes = {p: r.size for p, r in records.items()} if records is not None else None
        self.fs = BackendFileSystem(backend, sizes=sizes)
        self.path = path
        self.thread_count = thread_count or backend.default_io_threads
        self.records = records
        self._backend = backend
        self._metadata_bytes: bytes | None = None
        self._metadata: Metadata | None = None
        self._checksums: dict[MetadataIndex, int] = {}

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool,
                              *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._metadata = metadata
        self._checksums = item_checksums(metadata)

    def file_path(self, relative_path: str) -> str:
        """A data file's path from the backend root ('..' of incremental items resolved)."""
        return normalize_path(self.fs.concat_path(self.path, relative_path))

    def unchecked_files(self, metadata: Metadata) -> list[str]:
        """Data files (from the backend root) holding items with no recorded digest."""
        checksums = item_checksums(metadata)
        return sorted({self.file_path(info.relative_path)
                       for index, info in metadata.storage_data.items()
                       if index not in checksums})

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        # DCP reads one file after another on the caller's thread; files are independent, so
        # read (and decompress) them on `thread_count` threads.
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path,
                                []).append(item)
        # What this load reads in all decides whether a local disk keeps it in the page cache
        # (storage.read_cache), not each file's share of it.
        backend = self._backend.for_reading(
            sum(self.storage_data[item.storage_index].length for item in plan.items))
        landing = DeviceLanding()  # tensors on a GPU arrive through page-locked slices
        try:
            if self.thread_count <= 1 or len(per_file) <= 1:
                for relative_path, items in per_file.items():
                    self._read_file(backend, relative_path, items, planner, landing)
            else:
                with ThreadPoolExecutor(min(self.thread_count, len(per_file)),
                                        thread_name_prefix="statereg-read") as pool:
                    pending = [pool.submit(self._read_file, backend, relative_path, items,
                                           planner, landing)
                               for relative_path, items in per_file.items()]
                    for job in pending:
                        job.result()
        finally:
            landing.finish()
        done: Future = Future()
        done.set_result(None)
        return done

    def _read_file(self, backend: StorageBackend, relative_path: str, items: list[ReadItem],
                   planner: LoadPlanner, landing: DeviceLanding) -> None:
        """DCP's per-file read, except only the items' bytes are fetched (one ranged read per
        run of adjacent items on an object store), tensors are read straight into their
        destination, and every item is checked against its digest as it is read."""
        path = self.file_path(relative_path)
        if self.records is not None and path not in self.records:
            raise CorruptCheckpointError(
                f"{self._backend.display(self.path)}/{METADATA_NAME} refers to "
                f"{self._backend.display(path)}, which the manifest does not list; refusing "
                "to read it: the checkpoint is damaged or was altered"
            )
        ordered = sorted(items, key=lambda r: self.storage_data[r.storage_index].offset)
        ranges = _contiguous_runs([self.storage_data[r.storage_index] for r in ordered])
        with backend.open_ranges(path, ranges, self.fs.sizes.get(path)) as stream:
            for req in ordered:
                try:
                    self._read_item(stream, req, planner, landing)
                except torchsave.RECORD_ERRORS as exc:
                    raise CorruptCheckpointError(
                        f"{self.describe_item(req.storage_index)} cannot be read "
                        f"({type(exc).__name__}: {exc}); the file is damaged: load an earlier "
                        "checkpoint"
                    ) from None

    def _read_item(self, stream: Any, req: ReadItem, planner: LoadPlanner,
                   landing: DeviceLanding) -> None:
        """One item: verified, decoded within its recorded bounds, into its destination."""
        info: StorageInfo = self.storage_data[req.storage_index]
        where = self.describe_item(req.storage_index)
        expected = self._checksums.get(req.storage_index) if self.records is not None else None
        if req.type != LoadItemType.BYTE_IO and not info.transform_descriptors:
            target = planner.resolve_tensor(req).detach()
            hasher = xxhash.xxh3_64() if expected is not None else None
            if torchsave.read_into(stream, info.offset, info.length, target, hasher, landing):
                if hasher is not None:
                    _check_item(where, expected, hasher.intdigest())
                planner.commit_tensor(req, target)
                return
        # Everything else is read whole first (bounded by its recorded length) and checked
        # before a byte of it is decoded.
        stream.seek(info.offset)
        blob = stream.read(info.length)
        if len(blob) != info.length:
            raise CorruptCheckpointError(
                f"{where} is truncated: {len(blob)} of its {info.length} bytes are there; load "
                "an earlier checkpoint"
            )
        if expected is not None:
            _check_item(where, expected, xxhash.xxh3_64_intdigest(blob))
        if info.transform_descriptors:
            blob = codec.decode(info.transform_descriptors, blob,
                                self.decoded_bound(req.storage_index), where)
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(blob))
            return
        target = planner.resolve_tensor(req).detach()
        source = io.BytesIO(blob)
        if not torchsave.read_into(source, 0, len(blob), target, landing=landing):
            tensor = torchsave.load(source, 0, len(blob), where)
            if not isinstance(tensor, torch.Tensor):
                raise CorruptCheckpointError(f"{where}: holds no tensor; the file is damaged")
            tensor = _narrow(tensor, req.storage_offsets, req.lengths)
            if target.size() != tensor.size():
                raise CorruptCheckpointError(
                    f"{where}: stored shape {tuple(tensor.shape)}, expected "
                    f"{tuple(target.shape)}")
            target.copy_(tensor)
        planner.commit_tensor(req, target)

    def verify_unchecked(self, metadata: Metadata) -> None:
        """Read whole, in bounded blocks, every data file holding items without a digest, and
        check it against the manifest (a checkpoint from before item digests)."""
        if self.records is None:
            return
        for path in self.unchecked_files(metadata):
            record = self.records.get(path)
            if record is None:
                raise CorruptCheckpointError(
                    f"{self._backend.display(self.path)}/{METADATA_NAME} refers to "
                    f"{self._backend.display(path)}, which the manifest does not list; "
                    "refusing to read it: the checkpoint is damaged or was altered"
                )
            with self._backend.open_read(path) as stream:
                verify_stream(self._backend.display(path), record, stream)

    def describe_item(self, index: MetadataIndex) -> str:
        """The file holding an item, and the item, for error messages."""
        info = self.storage_data.get(index)
        path = self.file_path(info.relative_path) if info else self.path
        name = item_key(index) if index.offset is not None and any(index.offset) else index.fqn
        return f"{self._backend.display(path)} (item {name!r})"

    def decoded_bound(self, index: MetadataIndex) -> int:
        """The most bytes a compressed item may decode to, from the checkpoint's metadata."""
        stored = self._metadata.state_dict_metadata.get(index.fqn) if self._metadata else None
        if stored is None or isinstance(stored, BytesStorageMetadata):
            return MAX_OBJECT_BYTES
        element = stored.properties.dtype.itemsize
        for chunk in stored.chunks:
            if index.offset is None or tuple(chunk.offsets) == tuple(index.offset):
                return chunk.sizes.numel() * element + _TORCH_SAVE_OVERHEAD
        return stored.size.numel() * element + _TORCH_SAVE_OVERHEAD

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # Read once: statereg checks keys against it before dcp.load reads it again.
        meta_path = self.fs.concat_path(self.path, METADATA_NAME)
        if self._metadata_bytes is None:
            self._metadata_bytes = self._backend.read_bytes(meta_path)
        metadata = load_dcp_metadata(self._metadata_bytes, self._backend.display(meta_path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _contiguous_runs(infos: Sequence[StorageInfo]) -> list[tuple[int, int]]:
    """The (start, end) byte runs of items sorted by offset, adjacent items joined: what a
    reader of these items fetches, and nothing between them."""
    runs: list[tuple[int, int]] = []
    for info in infos:
        start, end = info.offset, info.offset + info.length
        if runs and start <= runs[-1][1]:
            runs[-1] = (runs[-1][0], max(runs[-1][1], end))
        else:
            runs.append((start, end))
    return runs


def item_checksums(metadata: Metadata) -> dict[MetadataIndex, int]:
    """Each item's xxh3_64 of its stored bytes, as the writer recorded them (empty for
    checkpoints written before statereg recorded them)."""
    checksums = getattr(metadata, ITEM_CHECKSUMS, None)
    return checksums if isinstance(checksums, dict) else {}


def _check_item(where: str, expected: int, actual: int) -> None:
    if actual != expected:
        raise CorruptCheckpointError(
            f"{where}: its bytes hash to {actual:016x}, the checkpoint recorded "
            f"{expected:016x}; the file is damaged: load an earlier checkpoint"
        )


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except non-tensor items load with `weights_only=True`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        length = len(value.getbuffer())
        obj = torchsave.load(value, 0, length, f"item {read_item.dest_index.fqn!r}")
        if self.flatten_state_dict:
            _set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def load_in_place(state: dict[str, Any], reader: BackendReader, planner: LoadPlanner) -> None:
    """`dcp.load` into `state`, keeping the entries `planner.set_up_planner` adds to it.

    dcp.load hands the planner a copy of `state`; a planner that fills in the keys itself
    (loading everything a checkpoint holds) fills the copy, which DefaultLoadPlanner keeps as
    its public `state_dict`. Public API only (the in-place private `_load_state_dict` changed
    its signature across releases).
    """
    dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
    state.update(planner.state_dict)


def _narrow(tensor: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int],
            ) -> torch.Tensor:
    """The part of a stored chunk a read asks for (DCP's private narrow_tensor_by_index)."""
    for dim, (start, length) in enumerate(zip(offsets, lengths, strict=True)):
        if length < tensor.size(dim):
            tensor = tensor.narrow(dim, start, length)
    return tensor


def _set_element(root: dict[str, Any], path: Sequence[str | int], value: Any) -> None:
    """Put `value` at `path` in a nested state dict, creating dicts and lists on the way.

    What DCP's private `set_element` does with the planner's flattening mappings: a str key
    indexes a dict, an int a list (grown with None).
    """
    container: Any = root
    for key, following in itertools.pairwise(path):
        empty: Any = {} if isinstance(following, str) else []
        if isinstance(container, Mapping):
            container = container.setdefault(key, empty)
        else:
            container.extend([None] * (key + 1 - len(container)))
            if container[key] is None:
                container[key] = empty
            container = container[key]
    last = path[-1]
    if isinstance(last, int):
        container.extend([None] * (last + 1 - len(container)))
    container[last] = value

