"""`BackendWriter`: DCP's FileSystemWriter writing through a StorageBackend.

What changes from DCP's writer: the file system is built once with its options; no
`checkpoint_id` and no fsync fallback (`sync_files=False`: our streams are durable before
they report); the per-file loop is statereg's (each tensor one `torch.save` record, its
CRC-32s computed by torchsave/ or, in memory, left out; every item's stored bytes hashed as
written, a failure in any writer thread raised); items an incremental save finds unchanged
are referenced, not written; `.metadata` is written in place, with every item's digest
(`ITEM_CHECKSUMS`).
`CompressingTransforms` encodes items one by one (codec.py).
"""

from __future__ import annotations

import collections
import dataclasses
import io
import itertools
import pickle
import posixpath
import queue
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from statereg.backends.base import StorageBackend
from statereg.backends.checksum import FileRecorder
from statereg.dcp import METADATA_NAME, codec
from statereg.dcp.fs import BackendFileSystem
from statereg.dcp.metadata import ITEM_CHECKSUMS, gc_paused, shared_descriptors
from statereg.dcp.reuse import Reusable, item_key, tensor_digest
from statereg.dcp.torch_private import storage_info
from statereg.dcp.torchsave import save_record


@dataclass
class WriteReport:
    """What one BackendWriter did in one save, filled as DCP drives it (`BackendWriter.report`).

    DCP's `dcp.save` returns only the global metadata, so the writer keeps what statereg needs
    after it here, in one object, instead of in loose attributes.
    """

    written: list[WriteResult] = field(default_factory=list)
    """This rank's write results (`write_data`)."""
    finished: list[list[WriteResult]] = field(default_factory=list)
    """On the coordinator: every rank's results `.metadata` was made of (`finish`); a later
    save of the same plan sends only their differences (ItemReports)."""
    digests: dict[str, str] = field(default_factory=dict)
    """Incremental saves: each tensor item's digest, by `item_key`."""
    referenced: set[str] = field(default_factory=set)
    """Incremental saves: the earlier checkpoints' files this save's items point into."""


class BackendWriter(FileSystemWriter):
    """DCP storage writer into `path` (relative to the backend root), one fresh directory.

    What it did is in `report` (a WriteReport) once `dcp.save` returns.
    """

    # DCP's writer declares the concrete FileSystem; this one is always statereg's own:
    fs: BackendFileSystem  # type: ignore[assignment]

    def __init__(self, backend: StorageBackend, path: str, recorder: FileRecorder,
                 thread_count: int = 1,
                 compression: codec.CompressionSettings | None = None,
                 reuse: Mapping[str, Reusable] | None = None, *, crcs: bool = True,
                 around_cache: bool = False) -> None:
        # sync_files=False: our streams are made durable by the backend before they are
        # reported (DCP's own fsync falls back to a machine-wide os.sync() on remote streams).
        super().__init__(path, sync_files=False, thread_count=thread_count, overwrite=False)
        # `crcs` (zip CRC-32s in tensor records: torchsave/crc_stream.py) and `around_cache` (files
        # written around the page cache) are the I/O policy's (engine/io_policy.py).
        self.fs = BackendFileSystem(backend.for_writing(around_cache), recorder)
        self.path = path
        self.crcs = crcs
        self.compressor = CompressingTransforms(compression) if compression is not None else None
        # Incremental saves: items whose digest matches `reuse` are referenced, not written.
        self.reuse = reuse
        self.report = WriteReport()

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Rank i's files are `__{i}_{n}.distcp`, as DCP names them; the prefix travels as a
        # plain string (DCP's own holder is a private class).
        return [dataclasses.replace(plan, storage_data=f"__{i}_") for i, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        """Write this rank's items into up to `thread_count` files; the first failure raises.

        DCP's version runs extra writer threads whose exceptions are printed and lost, and then
        commits metadata without their files, and it makes a file per thread even for a thread
        with no items (on an object store, a request and a manifest entry each).

        Each thread writes one file. Uncompressed, each file's items are fixed first (DCP's
        split: equal bytes, so equal time); compressed, every thread takes the next item, the
        largest first, when it is done with one: encoding speed varies by item, and with fixed
        items one thread was left encoding alone for a fifth of an fp32 save
        (benchmarks/results/journal.md, "Compressed saves: every writer busy to the end").
        """
        prefix = plan.storage_data
        results: queue.Queue = queue.Queue()
        errors: list[BaseException] = []
        items = plan.items
        if self.reuse is not None:
            reused, items = self._reference_unchanged(planner, items)
            results.put(reused)
        buckets = [b for b in _split_into_files(self.thread_count, items) if b]
        if self.compressor is not None and len(buckets) > 1:
            shared = collections.deque(_in_file_order(items))
            sources = [shared] * len(buckets)
        else:
            sources = [collections.deque(bucket) for bucket in buckets]

        def drain(number: int) -> None:
            try:
                name = f"{prefix}{number}.distcp"
                results.put(self._write_file(planner, self.fs.concat_path(self.path, name),
                                             name, sources[number]))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=drain, args=(number,), name=f"statereg-write-{number}")
                   for number in range(1, len(sources))]
        for thread in threads:
            thread.start()
        if sources:
            drain(0)
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        self.report.written = [wr for _ in range(results.qsize()) for wr in results.get_nowait()]
        done: Future = Future()
        done.set_result(self.report.written)
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
            tensor = planner.resolve_data(item)
            assert isinstance(tensor, torch.Tensor)  # not BYTE_IO: DCP resolves a tensor
            digest = self.report.digests[key] = tensor_digest(tensor)
            old = self.reuse.get(key)
            if old is None or old.digest != digest:
                kept.append(item)
                continue
            self.report.referenced.add(old.path)
            relative = relative_paths.get(old.path)
            if relative is None:  # one string per file: `.metadata` pickles it once
                relative = relative_paths[old.path] = posixpath.relpath(old.path, self.path)
            results.append(WriteResult(
                index=item.index, size_in_bytes=old.length,
                storage_data=(storage_info(relative, old.offset, old.length,
                                           shared_descriptors(old.transforms)),
                              old.checksum)))
        return results, kept

    def _write_file(self, planner: SavePlanner, file_name: str, storage_key: str,
                    source: collections.deque[WriteItem]) -> list[WriteResult]:
        """One DCP file of the items taken from `source` until it is empty (none: no file, so
        a writer that found the shared items taken leaves a gap in the numbers); what DCP's
        writer does, each tensor item one torch.save record.

        Each result's storage data is (DCP's StorageInfo, the item's xxh3_64); `finish`
        splits them into `.metadata`'s storage_data and ITEM_CHECKSUMS.
        """
        results: list[WriteResult] = []
        item = _take(source)
        if item is None:
            return results
        with self.fs.create_stream(file_name, "wb") as file_stream:
            while item is not None:
                data = planner.resolve_data(item)
                offset = file_stream.tell()
                stream = HashingTee(file_stream)
                descriptors: tuple[str, ...]
                target, descriptors = stream, ()
                if self.compressor is not None:
                    target, descriptors = self.compressor.encoder(item, stream)
                if item.type == WriteItemType.BYTE_IO:
                    assert isinstance(data, io.BytesIO)  # DCP resolves BYTE_IO items to these
                    target.write(data.getbuffer())
                else:
                    assert isinstance(data, torch.Tensor)
                    tensor = data.detach().cpu()
                    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
                        tensor = tensor.clone()  # torch.save would write the whole storage
                    # An encoder wants the tensor's bytes in one write (codec.EncodingStream).
                    save_record(tensor, target, sliced=target is stream, crcs=self.crcs)
                if target is not stream:
                    target.close()
                length = file_stream.tell() - offset
                results.append(WriteResult(
                    index=item.index, size_in_bytes=length,
                    storage_data=(storage_info(storage_key, offset, length,
                                               shared_descriptors(descriptors)),
                                  stream.hasher.intdigest())))
                item = _take(source)
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Write `.metadata`: `metadata`'s tensors with where this save put each item and the
        digest of its bytes (always this save's results, also when the plan was reused)."""
        self.report.finished = results
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
                gc_paused():
            # Plain pickle, as DCP writes it: item locations are pickled by field name.
            pickle.dump(metadata, out)


class HashingTee(io.RawIOBase):
    """Passes one item's bytes on to the file's stream, hashing them on the way."""

    def __init__(self, stream: io.IOBase) -> None:
        super().__init__()
        self._stream = stream
        self.hasher = xxhash.xxh3_64()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        # Written first: the copy reads the bytes from memory, the hash from the CPU's cache.
        written = self._stream.write(data)
        self.hasher.update(data)
        return written


def _item_size(item: WriteItem) -> int:
    assert item.tensor_data is not None
    return item.tensor_data.size.numel() * item.tensor_data.properties.dtype.itemsize


def _in_file_order(items: list[WriteItem]) -> list[WriteItem]:
    """Objects first, then tensors, largest first: the order items go into files."""
    return ([i for i in items if i.type == WriteItemType.BYTE_IO]
            + sorted((i for i in items if i.type != WriteItemType.BYTE_IO), key=_item_size,
                     reverse=True))


def _split_into_files(count: int, items: list[WriteItem]) -> list[list[WriteItem]]:
    """DCP's split of one rank's items into `count` files: objects round-robin, then tensors,
    largest first, each into the file with the fewest bytes so far."""
    buckets: list[list[WriteItem]] = [[] for _ in range(count)]
    sizes = [0] * count
    objects = 0
    for item in _in_file_order(items):
        if item.type == WriteItemType.BYTE_IO:
            buckets[objects % count].append(item)
            objects += 1
            continue
        smallest = sizes.index(min(sizes))
        buckets[smallest].append(item)
        sizes[smallest] += _item_size(item)
    return buckets


def _take(source: collections.deque[WriteItem]) -> WriteItem | None:
    """The next item of `source`, or None once it is empty (threads may share it)."""
    try:
        return source.popleft()
    except IndexError:
        return None


class CompressingTransforms:
    """Compresses each DCP item on its own: float tensors by planes (if asked), others zstd."""

    def __init__(self, settings: codec.CompressionSettings) -> None:
        self.settings = settings

    def encoder(self, write_item: WriteItem, raw_stream: io.RawIOBase,
                ) -> tuple[Any, tuple[str, ...]]:
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
