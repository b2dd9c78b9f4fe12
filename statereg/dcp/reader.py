"""`BackendReader`: DCP's FileSystemReader reading through a StorageBackend, item by item checked.

What changes from DCP's reader: `.metadata` is read once and safely (metadata.py); data files
are read on several threads, each fetching only its items' bytes; a tensor item is read
straight into its destination (torchsave/read.py, device_reads.py for GPU tensors), every item is
checked against its recorded digest as it is read, and compressed items are decoded within
the bounds the metadata gives (codec.py). `SafeLoadPlanner` loads non-tensor items with
`weights_only=True`; `load_in_place` is `dcp.load` keeping what the planner adds.
"""

from __future__ import annotations

import io
import itertools
from collections.abc import Hashable, Mapping, MutableMapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from statereg.backends.checksum import Recorded, verify_stream
from statereg.backends.stores import ReadableStore, ReadOnlyStore
from statereg.backends.verified import VerifiedReads
from statereg.dcp import METADATA_NAME, codec, torchsave
from statereg.dcp.device_reads import DeviceLanding
from statereg.dcp.fs import BackendFileSystem, normalize_path
from statereg.dcp.metadata import item_checksums, load_dcp_metadata, metadata_digest
from statereg.dcp.quiet import single_process_dcp
from statereg.dcp.reuse import item_key
from statereg.dcp.torch_private import StorageInfo
from statereg.errors import CorruptCheckpointError
from statereg.process_state import process_wide

# What torch.save adds around a tensor's bytes (zip headers, the pickled tensor record).
_TORCH_SAVE_OVERHEAD = 64 * 1024
# Largest non-tensor item (pickled object) a compressed frame may inflate to.
MAX_OBJECT_BYTES = 1 << 30


# A destination tensor read in place, and its bytes where it is in this process's memory.
_Target = tuple[torch.Tensor, memoryview | None]


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

    # DCP's reader declares the concrete FileSystem; this one is always statereg's own:
    fs: BackendFileSystem  # type: ignore[assignment]
    path: str  # BackendFileSystem.init_path returns a str

    def __init__(self, backend: ReadableStore, path: str, thread_count: int = 2,
                 records: Mapping[str, Recorded] | None = None) -> None:
        super().__init__(path)
        if records is None and isinstance(backend, VerifiedReads):
            records = backend.records
        sizes = {p: r.size for p, r in records.items()} if records is not None else None
        self.fs = BackendFileSystem(backend, sizes=sizes)
        self.path = path
        # Files read at once: the I/O policy's read_threads (engine/io_policy.py).
        self.thread_count = thread_count
        self.records = records
        self._backend = backend
        self._metadata_bytes: bytes | None = None
        self._metadata_digest = b""
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
        # Destinations are resolved here, before the reader threads start: each torch call
        # hands the GIL over (detach, view, narrow), and in a reader thread every hand-over
        # waits for the other reader (measured: a fifth of a warm load's reader time).
        targets = {id(item): self._target(item, planner) for item in plan.items}
        try:
            if self.thread_count <= 1 or len(per_file) <= 1:
                for relative_path, items in per_file.items():
                    self._read_file(backend, relative_path, items, planner, landing, targets)
            else:
                with ThreadPoolExecutor(min(self.thread_count, len(per_file)),
                                        thread_name_prefix="statereg-read") as pool:
                    pending = [pool.submit(self._read_file, backend, relative_path, items,
                                           planner, landing, targets)
                               for relative_path, items in per_file.items()]
                    for job in pending:
                        job.result()
        finally:
            landing.finish()
        done: Future = Future()
        done.set_result(None)
        return done

    def _target(self, req: ReadItem, planner: LoadPlanner) -> _Target | None:
        """The destination of a tensor item, with its bytes (None where it has none in this
        process's memory); None for an object item."""
        if req.type == LoadItemType.BYTE_IO:
            return None
        try:
            target = planner.resolve_tensor(req).detach()
        except torchsave.RECORD_ERRORS as exc:
            raise self._unreadable(req, exc) from None
        return target, torchsave.byte_view(target)

    def _read_file(self, backend: ReadOnlyStore, relative_path: str, items: list[ReadItem],
                   planner: LoadPlanner, landing: DeviceLanding,
                   targets: Mapping[int, _Target | None]) -> None:
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
                    self._read_item(stream, req, planner, landing, targets[id(req)])
                except torchsave.RECORD_ERRORS as exc:
                    raise self._unreadable(req, exc) from None

    def _unreadable(self, req: ReadItem, exc: Exception) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self.describe_item(req.storage_index)} cannot be read ({type(exc).__name__}: "
            f"{exc}); the file is damaged: load an earlier checkpoint")

    def _read_item(self, stream: Any, req: ReadItem, planner: LoadPlanner,
                   landing: DeviceLanding, resolved: _Target | None) -> None:
        """One item: verified, decoded within its recorded bounds, into its destination
        (`resolved`: the tensor read in place and its bytes, from `_target`)."""
        info: StorageInfo = self.storage_data[req.storage_index]
        expected = self._checksums.get(req.storage_index) if self.records is not None else None
        if resolved is not None and not info.transform_descriptors:
            target, view = resolved
            hasher = xxhash.xxh3_64() if expected is not None else None
            if torchsave.read_into(stream, info.offset, info.length, target, hasher, landing,
                                   view):
                if hasher is not None and expected is not None \
                        and hasher.intdigest() != expected:
                    _check_item(self.describe_item(req.storage_index), expected,
                                hasher.intdigest())
                planner.commit_tensor(req, target)
                return
        where = self.describe_item(req.storage_index)
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
            bound = self.decoded_bound(req.storage_index)
            if (resolved is not None and resolved[1] is not None
                    and _decode_in_place(info.transform_descriptors, blob, bound, where,
                                         resolved[0], resolved[1])):
                planner.commit_tensor(req, resolved[0])
                return
            blob = codec.decode(info.transform_descriptors, blob, bound, where)
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(blob))
            return
        target = resolved[0] if resolved is not None else planner.resolve_tensor(req).detach()
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
            self._metadata_digest = metadata_digest(self._metadata_bytes)
        # A fresh object each time (DCP sets fields on it), the same bytes checked once.
        metadata = load_dcp_metadata(self._metadata_bytes, self._backend.display(meta_path),
                                     self._metadata_digest)
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
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


def _check_item(where: str, expected: int, actual: int) -> None:
    if actual != expected:
        raise CorruptCheckpointError(
            f"{where}: its bytes hash to {actual:016x}, the checkpoint recorded "
            f"{expected:016x}; the file is damaged: load an earlier checkpoint"
        )


# Local load plans by `SafeLoadPlanner.plan_key`, for a later load of the same checkpoint into
# the same targets (DCP's planning takes ~20 us a tensor).
_load_plans: dict[Hashable, LoadPlan] = {}
_LOAD_PLANS_KEPT = 16
process_wide(__name__, "_load_plans", "DCP's local load plan, kept for a later load of the same "
             "checkpoint into the same targets")


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except non-tensor items load with `weights_only=True`, and
    the local plan is made once per `plan_key`: a key that names the checkpoint's `.metadata`
    bytes and every target's name, type, shape and dtype, which are all a plan depends on."""

    def __init__(self, plan_key: Hashable | None = None, **options: Any) -> None:
        super().__init__(**options)  # DefaultLoadPlanner's; plan_key is for the defaults
        self.plan_key = plan_key

    def create_local_plan(self) -> LoadPlan:
        plan = _load_plans.get(self.plan_key) if self.plan_key is not None else None
        if plan is not None:
            return plan
        planned_for = self.state_dict
        if self.metadata is not None and (
                not self.flatten_state_dict
                or not self.metadata.state_dict_metadata.keys() - self.state_dict.keys()):
            # DefaultLoadPlanner's, less its check for keys from before torch 2.4, which only
            # applies where the checkpoint holds keys the state does not.
            plan = _local_plan(self.state_dict, self.metadata, not self.allow_partial_load)
        else:
            plan = super().create_local_plan()
        # DCP swaps in other keys for a checkpoint from before torch 2.4: not kept.
        if self.plan_key is not None and self.state_dict is planned_for:
            if len(_load_plans) >= _LOAD_PLANS_KEPT:
                _load_plans.pop(next(iter(_load_plans)), None)  # the oldest goes
            _load_plans[self.plan_key] = plan
        return plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        length = len(value.getbuffer())
        obj = torchsave.load(value, 0, length, f"item {read_item.dest_index.fqn!r}")
        if self.flatten_state_dict:
            _set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _local_plan(state: dict[str, Any], metadata: Metadata, strict: bool) -> LoadPlan:
    """DCP's `create_default_local_load_plan`, item for item, with the common case made
    directly: a plain tensor stored whole, as one chunk of its own shape, is one read of
    that chunk (DCP's resharding sweep costs ~15 us a tensor). Everything else, and any
    error (a missing key, another size), is DCP's own."""
    stored = metadata.state_dict_metadata
    items: list[ReadItem] = []
    for fqn, obj in state.items():
        md = stored.get(fqn)
        if type(obj) in _PLAIN_TENSORS and type(md) is TensorStorageMetadata \
                and len(md.chunks) == 1:
            chunk, size = md.chunks[0], obj.size()
            if (md.size == size and chunk.sizes == size and not any(chunk.offsets)
                    and 0 not in size):  # DCP reads nothing for an empty tensor
                zeros = chunk.offsets
                items.append(ReadItem(type=LoadItemType.TENSOR,
                                      dest_index=MetadataIndex(fqn, zeros, 0),
                                      dest_offsets=zeros,
                                      storage_index=MetadataIndex(fqn, zeros, 0),
                                      storage_offsets=zeros, lengths=size))
                continue
        items += create_default_local_load_plan({fqn: obj}, metadata, strict).items
    return LoadPlan(items)


def load_in_place(state: dict[str, Any], reader: BackendReader,
                  planner: DefaultLoadPlanner) -> None:
    """`dcp.load` into `state`, keeping the entries `planner.set_up_planner` adds to it.

    dcp.load hands the planner a copy of `state`; a planner that fills in the keys itself
    (loading everything a checkpoint holds) fills the copy, which DefaultLoadPlanner keeps as
    its public `state_dict`. Public API only (the in-place private `_load_state_dict` changed
    its signature across releases).
    """
    with single_process_dcp():
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
        if isinstance(container, MutableMapping):
            container = container.setdefault(key, empty)
        else:
            assert isinstance(key, int)  # a list's index (see the docstring)
            container.extend([None] * (key + 1 - len(container)))
            if container[key] is None:
                container[key] = empty
            container = container[key]
    last = path[-1]
    if isinstance(last, int):
        container.extend([None] * (last + 1 - len(container)))
    container[last] = value


def _decode_in_place(descriptors: Sequence[str], blob: bytes, bound: int, where: str,
                     target: torch.Tensor, view: memoryview) -> bool:
    """Decode a compressed tensor item straight into `target` (`view`: its bytes), without
    a buffer of the whole record; False where the item is not the plain case (`target` may
    then hold part of it: the caller decodes it whole and overwrites)."""
    if tuple(descriptors) == (codec.ZSTD_DESCRIPTOR,):
        stream = codec.frame_stream(blob, bound, where)
        if stream is None or not torchsave.read_into(stream, 0, stream.size, target,
                                                     view=view):
            return False
        stream.finish()
        return True
    return codec.decode_into(descriptors, blob, view, where,
                             lambda prefix, suffix: torchsave.frames(prefix, suffix, target))
