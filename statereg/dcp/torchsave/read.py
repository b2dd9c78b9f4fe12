"""Where a tensor's bytes lie inside one `torch.save` record, so a load can read them in place.

DCP stores every tensor item as a `torch.save` zip. Loading one through `torch.load` allocates
a tensor, reads into it and then copies it into the destination: two passes over memory for
every byte. When the record is the plain case (one contiguous, little-endian storage of the
expected dtype, stored uncompressed), its payload can instead be `readinto` the destination
directly. Anything else returns None and the caller keeps DCP's `torch.load` path, so this is
an optimisation, never a second format.

The payload is found by walking the record's local headers from its start (front to back,
as a cold cache reads best), every size checked against its zip data descriptor; any layout
that walk does not expect is read through the standard library's `zipfile` (central
directory, zip64) instead. `data.pkl` is read with an unpickler that admits only what a plain
tensor record holds.

Reads can be verified as they go: `read_into` feeds every byte of the record, in order, to a
hasher (the bytes before the payload, the payload from the destination's memory, the rest of
the record), so the caller checks the record's digest without a second pass. `load`, the
fallback, first bounds what the record may allocate by its own size (`check_bounded`), so a
hostile record cannot make `torch.load` allocate gigabytes from a few bytes.

`reads_checked()` compares in-place reads of small `torch.save` probes with `torch.load`
once per process; where they differ (one warning), and under `STATEREG_PLAIN_TORCH_SAVE=1`,
`read_into` and `frames` decline every record, so every load goes through `load`.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import sys
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from typing import IO, Any, Union

import torch

from statereg.dcp.device_reads import DeviceLanding
from statereg.dcp.torchsave.layout import (
    DESCRIPTOR,
    DESCRIPTOR32,
    DESCRIPTOR64,
    LOCAL_HEADER,
    SMALL_RECORDS,
    STORAGE_DTYPES,
    plain_torch_save,
    warn_fallback,
)
from statereg.errors import CorruptCheckpointError
from statereg.process_state import BytesBounded, process_wide

# Every typed storage class torch.save names, for bounding what a record declares.
_SCANNED_STORAGE_DTYPES = {**STORAGE_DTYPES, "ComplexFloatStorage": torch.complex64,
                           "ComplexDoubleStorage": torch.complex128}
# How much of a record's start is read to find its payload (its header takes ~1 KiB).
_HEAD_BYTES = 4096
# Bytes hashed per read when a record's framing is hashed.
_HASH_BLOCK = 1 << 20
# A tensor read with a hasher is read and hashed in slices of this size (fits in L2 cache).
_HASH_SLICE = 1 << 20
# What reading a damaged or hostile record can raise, from zipfile, pickle or torch.
RECORD_ERRORS = (pickle.UnpicklingError, zipfile.BadZipFile, EOFError, ValueError, TypeError,
                 KeyError, IndexError, AttributeError, AssertionError, RuntimeError,
                 struct.error, UnicodeDecodeError, OverflowError, MemoryError)


class _NotPlain(Exception):
    """The record is not the plain one-storage tensor this module reads in place."""


@dataclass(frozen=True)
class _Rebuilt:
    dtype: torch.dtype
    key: str
    numel: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild(storage: tuple[torch.dtype, str, int], storage_offset: int, size: Any,
             stride: Any, *_: Any) -> _Rebuilt:
    dtype, key, numel = storage
    return _Rebuilt(dtype, key, numel, storage_offset, tuple(size), tuple(stride))


class _TensorRecordUnpickler(pickle.Unpickler):
    """Reads `data.pkl` of a plain tensor record into a `_Rebuilt`, and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name in STORAGE_DTYPES:
            return STORAGE_DTYPES[name]
        raise _NotPlain(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> tuple[torch.dtype, str, int]:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and pid[3] == "cpu" and isinstance(pid[1], torch.dtype)):
            raise _NotPlain("storage reference")
        return pid[1], str(pid[2]), int(pid[4])


# What the record readers take: a binary file, or a raw stream over one (codec.FrameStream).
Stream = Union[IO[bytes], io.RawIOBase]  # noqa: UP007 - a runtime alias on Python 3.10


class RecordWindow(io.RawIOBase):
    """`length` bytes of `base` from `offset`, seekable from either end (zipfile needs both)."""

    def __init__(self, base: Stream, offset: int, length: int) -> None:
        super().__init__()
        self.base, self.offset, self.length = base, offset, length
        self.pos = 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        start = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.length}[whence]
        self.pos = max(0, min(self.length, start + pos))
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")[:self.length - self.pos]
        self.base.seek(self.offset + self.pos)
        # typing.IO lacks readinto; callers pass io streams:
        got = self.base.readinto(view) or 0  # type: ignore[union-attr]
        self.pos += got
        return got


def _read_exact(stream: RecordWindow, start: int, size: int) -> bytes:
    stream.seek(start)
    data = stream.read(size)
    if data is None or len(data) != size:
        raise _NotPlain("short read")
    return data


def _check_layout(record: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """The payload's size in bytes if `record` is a plain tensor of `dtype` and `shape`."""
    numel = 1
    for dim in shape:
        numel *= dim
    if (not isinstance(record, _Rebuilt) or record.dtype != dtype or record.size != shape
            or record.storage_offset != 0 or record.numel != numel
            or record.stride != _contiguous_strides(shape)):
        raise _NotPlain("layout")
    return numel * dtype.itemsize


def _skip_descriptor(head: bytes, at: int, size: int) -> int:
    """Where the next record starts after a member of `size` bytes ending at `at`."""
    if head[at:at + 4] != DESCRIPTOR:
        raise _NotPlain("data descriptor")
    if DESCRIPTOR32.unpack_from(head, at)[2:] == (size, size):
        return at + DESCRIPTOR32.size
    if DESCRIPTOR64.unpack_from(head, at)[2:] == (size, size):
        return at + DESCRIPTOR64.size
    raise _NotPlain("data descriptor sizes")


def _walk_head(head: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[int, int]:
    """(start, size) of the payload, from the first bytes of a record alone.

    torch.save writes data.pkl, three tiny records, then the storage, each with its sizes in
    a descriptor after its data; walking them in order reads the record front to back, which
    a cold cache's readahead serves, where the central directory sits after the payload.
    Every size is checked against its descriptor; anything unexpected raises _NotPlain.
    """
    pos, record, order = 0, None, None
    while True:
        fields = LOCAL_HEADER.unpack_from(head, pos)
        flags, method, csize, name_len, extra_len = fields[3], fields[4], fields[8], \
            fields[10], fields[11]
        # zipfile's private constant, not in typeshed:
        if fields[0] != zipfile.stringFileHeader or method != zipfile.ZIP_STORED:  # type: ignore[attr-defined]
            raise _NotPlain("local header")
        start = pos + LOCAL_HEADER.size + name_len + extra_len
        member = head[pos + LOCAL_HEADER.size:start - extra_len].decode("utf-8").split("/", 1)[-1]
        if record is not None and member == f"data/{record.key}":
            if order != sys.byteorder.encode():
                raise _NotPlain("byte order")
            return start, _check_layout(record, dtype, shape)
        if member == "data.pkl":
            pickled = io.BytesIO(head[start:])
            record = _TensorRecordUnpickler(pickled).load()
            size = pickled.tell()
        elif member in SMALL_RECORDS:
            size = head.find(DESCRIPTOR, start) - start if flags & 8 else csize
            if size < 0:
                raise _NotPlain("unterminated record")
            if member == "byteorder":
                order = head[start:start + size]
        else:
            raise _NotPlain(member)
        pos = _skip_descriptor(head, start + size, size) if flags & 8 else start + size


# What a walk of a record's head raises where the record is not the plain case.
_WALK_ERRORS = (_NotPlain, pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError,
                IndexError, struct.error, UnicodeDecodeError)
# Per (dtype, shape): the bytes before the payload of the last record walked, and its
# (start, size). _walk_head reads nothing past the payload's start, so a record whose first
# `start` bytes are the same has the same answer: the records of one layout (torch.save
# writes them alike) are walked once, then compared.
# Kept by their bytes (a head is ~0.7 KB, ~1 KB with its objects): a model of 20,000
# distinct small shapes keeps all of them. A cap of 4,096 walks had each load of such a
# model walk nearly every record again (benchmarks/results/journal.md, "Many small tensors").
_walks = BytesBounded()  # (dtype, shape) -> (head, payload start, payload bytes)
process_wide(__name__, "_walks", "each tensor layout's record head is walked once, then compared")
_WALK_BYTES_KEPT = 32 << 20
_WALK_OVERHEAD = 256


def _walked(head: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[int, int]:
    """_walk_head's answer, from _walks when the record starts as the last one of its layout."""
    key = (dtype, shape)
    known = _walks.get(key)
    if known is not None and head.startswith(known[0]):
        return known[1], known[2]
    start, nbytes = _walk_head(head, dtype, shape)
    _walks.keep(key, (head[:start], start, nbytes), _WALK_OVERHEAD + start, _WALK_BYTES_KEPT)
    return start, nbytes


def _payload(stream: Stream, offset: int, length: int, dtype: torch.dtype,
             shape: tuple[int, ...]) -> tuple[int, bool, bytes] | None:
    """Offset in `stream` of the raw bytes of the record at [offset, offset+length), if plain;
    whether a data descriptor after them must confirm their size; and the bytes read from the
    record's start to find them (its first `_HEAD_BYTES`, or none: the caller reads those
    again where it needs them)."""
    stream.seek(offset)
    head = stream.read(min(length, _HEAD_BYTES))
    if len(head) == min(length, _HEAD_BYTES):
        try:
            start, nbytes = _walked(head, dtype, shape)
            if start + nbytes + DESCRIPTOR32.size <= length:
                return offset + start, True, head
        except _WALK_ERRORS:
            pass
    window = RecordWindow(stream, offset, length)
    try:  # the zip's central directory, at the record's end: any layout torch may write
        archive = zipfile.ZipFile(window)
        names = {info.filename.split("/", 1)[-1]: info for info in archive.infolist()}
        for name in ("data.pkl", "byteorder"):
            if name not in names or names[name].compress_type != zipfile.ZIP_STORED:
                raise _NotPlain(name)
        order = _member(window, names["byteorder"])
        if order.decode("ascii", "replace") != sys.byteorder:
            raise _NotPlain("byte order")
        record = _TensorRecordUnpickler(io.BytesIO(_member(window, names["data.pkl"]))).load()
        nbytes = _check_layout(record, dtype, shape)
        data = names.get(f"data/{record.key}")
        if data is None or data.compress_type != zipfile.ZIP_STORED or data.file_size != nbytes:
            raise _NotPlain("payload")
        return offset + _member_start(window, data), False, b""
    except (_NotPlain, zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ValueError,
            TypeError, KeyError, IndexError, struct.error):
        return None


def frames(prefix: bytes, suffix: bytes, target: torch.Tensor) -> bool:
    """Whether `prefix`, then `target`'s bytes, then `suffix` is the plain record of `target`
    (its dtype and shape), with the payload exactly between the two: a decoder can then
    write the payload straight into `target`. The walk of `_payload`, on bytes in memory;
    False under `STATEREG_PLAIN_TORCH_SAVE=1` or where this torch failed `reads_checked`."""
    if plain_torch_save() or not reads_checked():
        return False
    try:
        start, nbytes = _walked(prefix, target.dtype, tuple(target.shape))
        if start != len(prefix) or nbytes != target.nbytes:
            return False
        _skip_descriptor(suffix[:DESCRIPTOR64.size] + bytes(DESCRIPTOR64.size), 0, nbytes)
    except _WALK_ERRORS:
        return False
    return True


def _member_start(window: RecordWindow, info: zipfile.ZipInfo) -> int:
    header = LOCAL_HEADER.unpack(_read_exact(window, info.header_offset, LOCAL_HEADER.size))
    # zipfile's private constant, not in typeshed:
    if header[0] != zipfile.stringFileHeader:  # type: ignore[attr-defined]
        raise _NotPlain("local header")
    start = info.header_offset + LOCAL_HEADER.size + header[10] + header[11]
    if start + info.file_size > window.length:
        raise _NotPlain("member past the record")
    return start


def _member(window: RecordWindow, info: zipfile.ZipInfo) -> bytes:
    if info.file_size > 1 << 20:
        raise _NotPlain("member too large")
    return _read_exact(window, _member_start(window, info), info.file_size)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))


def hash_range(stream: Stream, start: int, end: int, hasher: Any) -> None:
    """Feed bytes [start, end) of `stream` to `hasher`, in bounded reads."""
    stream.seek(start)
    while start < end:
        block = stream.read(min(_HASH_BLOCK, end - start))
        if not block:
            raise EOFError(f"stream ended {end - start} bytes before the record's end")
        hasher.update(block)
        start += len(block)


def byte_view(tensor: torch.Tensor) -> memoryview | None:
    """The bytes of a contiguous tensor in this process's memory, writable; None otherwise."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.is_quantized \
            or tensor.is_sparse:
        return None
    # numpy's stubs give ndarray __buffer__ only on 3.12+:
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def read_into(stream: Stream, offset: int, length: int, target: torch.Tensor,
              hasher: Any = None, landing: DeviceLanding | None = None,
              view: memoryview | None = None) -> bool:
    """Fill `target` from the torch.save record at [offset, offset+length) of `stream`.

    Returns False when the record or the target is not the plain case (the caller then uses
    `load`); `target` may then hold some of the record's bytes, which the caller overwrites.
    A CUDA `target` is filled through `landing`'s page-locked slices (none: not the plain
    case); its copies may still be in flight on return, until `landing.finish()`. `view` is
    `byte_view(target)` where the caller has it (it saves a reader thread the torch calls).
    With `hasher`, every byte of the record passes through it in order when True is
    returned. Raises EOFError if the stream ends before the record does. Always False under
    `STATEREG_PLAIN_TORCH_SAVE=1` and where this torch failed `reads_checked`.
    """
    if plain_torch_save() or not reads_checked():
        return False
    return _read_into(stream, offset, length, target, hasher, landing, view)


def _read_into(stream: Stream, offset: int, length: int, target: torch.Tensor,
               hasher: Any, landing: DeviceLanding | None, view: memoryview | None) -> bool:
    on_device = target.device.type != "cpu"
    if ((on_device and (landing is None or not target.is_cuda)) or not target.is_contiguous()
            or target.numel() == 0 or target.is_quantized or target.is_sparse):
        return False
    found = _payload(stream, offset, length, target.dtype, tuple(target.shape))
    if found is None:
        return False
    start, check_descriptor, head = found
    # The head already read holds the bytes before the payload, and all of a small record:
    # those are hashed and copied from memory instead of read again.
    lead, nbytes = start - offset, target.nbytes
    whole = lead + nbytes <= len(head)
    if hasher is not None:
        if lead <= len(head):
            hasher.update(head[:lead])
        else:
            hash_range(stream, offset, start, hasher)
    if on_device:
        assert landing is not None
        stream.seek(start)
        landing.fill(target.detach(), lambda view: _read_exactly(stream, view), hasher)
        whole = False
        stream.seek(start + nbytes)
    else:
        data = view if view is not None else byte_view(target)
        assert data is not None  # a CPU target is contiguous and plain (checked above)
        if whole:
            data[:] = head[lead:lead + nbytes]
            if hasher is not None:
                hasher.update(data)
        else:
            # The payload's first bytes are in the head: copied from it, and the reads go on
            # from the head's end. Seeking back to the payload instead made every record's
            # reads go backwards once, which resets the kernel's readahead of the file (a cold
            # load then read the disk at half its rate without a readahead thread).
            ahead = max(0, min(len(head) - lead, nbytes))
            data[:ahead] = head[lead:lead + ahead]
            if hasher is not None:
                hasher.update(data[:ahead])
            stream.seek(start + ahead)
            # With a hasher, read in slices and hash each while it is still in the CPU's
            # cache: hashing the whole tensor afterwards would read it from memory again.
            step = _HASH_SLICE if hasher is not None else len(data)
            for at in range(ahead, len(data), step):
                _read_exactly(stream, data[at:at + step])
                if hasher is not None:
                    hasher.update(data[at:at + step])
    # The rest of the record (data descriptor, central directory): one read, bounded.
    rest = length - lead - nbytes
    tail = head[lead + nbytes:] if whole else _read_upto(stream, min(rest, _HASH_BLOCK))
    if whole and len(tail) < min(rest, DESCRIPTOR64.size):
        # The head ended inside the descriptor (the stream is at the head's end): without
        # the rest of it, ~1 in 250 tensors of 1-4 KB was declined and loaded by torch.load.
        tail += _read_upto(stream, min(rest - len(tail), _HASH_BLOCK))
    if check_descriptor:
        try:
            _skip_descriptor(tail[:DESCRIPTOR64.size] + bytes(DESCRIPTOR64.size), 0, nbytes)
        except (_NotPlain, struct.error):
            return False  # not what the header walk assumed: the caller reloads it whole
    if hasher is not None:
        hasher.update(tail)
        if rest > len(tail):
            hash_range(stream, start + nbytes + len(tail), offset + length, hasher)
    return True


_reads_usable: bool | None = None
process_wide(__name__, "_reads_usable", "whether the in-place reader reads what torch.load "
             "does, probed once")


def reads_checked() -> bool:
    """Whether records `torch.save` writes on this torch, read in place, hold what
    `torch.load` reads from them: checked once per process on probes of several dtypes and
    sizes (one whose payload starts like a data descriptor). Where one is not read in place,
    or differs, one warning, and every record is read by `torch.load`."""
    global _reads_usable
    if _reads_usable is None:  # two threads may both probe: the same answer
        _reads_usable = _probe_reads()
    return _reads_usable


def _probe_reads() -> bool:
    probes = [torch.arange(300, dtype=torch.float32), torch.ones(3, 5, dtype=torch.bfloat16),
              torch.tensor([*DESCRIPTOR, *range(12)], dtype=torch.uint8),
              torch.arange(6000, dtype=torch.int64).reshape(60, 100)]
    for probe in probes:
        record = io.BytesIO()
        record.write(b"lead")  # a record inside a file, as DCP's are
        torch.save(probe, record)
        length = record.tell() - 4
        target = torch.empty_like(probe)
        try:
            ok = _read_into(record, 4, length, target, None, None, None)
            expected = torch.load(RecordWindow(record, 4, length),  # type: ignore[arg-type]
                                  map_location="cpu", weights_only=True)
        except RECORD_ERRORS as exc:
            why = f"reading a probe failed ({type(exc).__name__}: {exc})"
        else:
            if ok and torch.equal(target.view(torch.uint8), expected.view(torch.uint8)):
                continue
            why = (f"a record of {probe.dtype} {tuple(probe.shape)} "
                   f"{'reads otherwise than torch.load' if ok else 'is not read in place'}")
        warn_fallback(why, "every record is read by torch.load")
        return False
    return True


def _read_upto(stream: Stream, size: int) -> bytes:
    """`size` bytes from `stream`'s position; EOFError if it ends first."""
    data = stream.read(size)
    while len(data) < size:
        more = stream.read(size - len(data))
        if not more:
            raise EOFError(f"stream ended {size - len(data)} bytes before the record's end")
        data += more
    return data


def _read_exactly(stream: Stream, view: memoryview) -> None:
    """Fill `view` from `stream`; EOFError if the stream ends first."""
    while view:
        # typing.IO lacks readinto; callers pass io streams:
        got = stream.readinto(view)  # type: ignore[union-attr]
        if not got:
            raise EOFError(f"stream ended {len(view)} bytes before the tensor's end")
        view = view[got:]


class _Placeholder:
    """Stands for any object data.pkl builds while `check_bounded` scans it: accepts every
    construction and container operation, runs nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass


class _StorageScan(pickle.Unpickler):
    """Walks a record's data.pkl only to add up the bytes of the storages it declares."""

    def __init__(self, file: IO[bytes]) -> None:
        super().__init__(file)
        self.nbytes = 0

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in _SCANNED_STORAGE_DTYPES:
            return _SCANNED_STORAGE_DTYPES[name]
        if module in ("torch", "torch.storage") and name == "UntypedStorage":
            return torch.uint8  # dtypes without a typed storage class (uint16, float8, ...)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        return _Placeholder

    def persistent_load(self, pid: Any) -> None:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], torch.dtype) and type(pid[4]) is int and pid[4] >= 0):
            raise _NotPlain("storage reference")
        self.nbytes += pid[4] * pid[1].itemsize


def check_bounded(record: RecordWindow, length: int) -> None:
    """Raise ValueError unless the torch.save record in `record` (`length` bytes) stores every
    member uncompressed within itself and declares no storage larger than itself: what
    torch.load will allocate is then bounded by the record's size.

    data.pkl is read as stored, not through zipfile, which would refuse a record written
    without CRC-32s (crc_stream.py, in memory), as torch.load does not."""
    archive = zipfile.ZipFile(record)
    pickled = None
    for info in archive.infolist():
        if info.compress_type != zipfile.ZIP_STORED or info.file_size > length:
            raise ValueError(f"member {info.filename!r} is compressed or larger than the record")
        if info.filename.split("/", 1)[-1] == "data.pkl":
            pickled = info
    if pickled is None:
        raise ValueError("no data.pkl")
    try:
        stored = _read_exact(record, _member_start(record, pickled), pickled.file_size)
    except _NotPlain as exc:
        raise ValueError(f"data.pkl lies outside the record ({exc})") from None
    scan = _StorageScan(io.BytesIO(stored))
    try:
        scan.load()
    except (_NotPlain, *RECORD_ERRORS) as exc:
        raise ValueError(f"data.pkl does not unpickle ({type(exc).__name__}: {exc})") from None
    if scan.nbytes > length:
        raise ValueError(f"it declares {scan.nbytes} bytes of storage in a record of {length}")


def load(stream: IO[bytes], offset: int, length: int, where: str) -> Any:
    """`torch.load` (weights only, onto the CPU) of the record at [offset, offset+length).

    Bounded by the record's size first (`check_bounded`); anything a damaged or hostile
    record makes zipfile, pickle or torch raise is a CorruptCheckpointError naming `where`.
    """
    try:
        check_bounded(RecordWindow(stream, offset, length), length)
        # torch.load accepts any file-like object; its annotation says IO[bytes]:
        return torch.load(RecordWindow(stream, offset, length), map_location="cpu",  # type: ignore[arg-type]
                          weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CorruptCheckpointError(
            f"{where} holds a pickled object outside the weights-only allow-list "
            f"({str(exc).splitlines()[0] if str(exc) else exc!r}); refusing to load it"
        ) from None
    except RECORD_ERRORS as exc:
        raise CorruptCheckpointError(
            f"{where}: not a readable torch.save record ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); the file is damaged or was not "
            "written by statereg: load an earlier checkpoint"
        ) from None
