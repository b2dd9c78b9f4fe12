"""One tensor's `torch.save` record, byte for byte, with its CRC-32s computed by statereg.

torch computes each zip record's CRC-32 with miniz at ~2.7-5 GB/s, one pass of its own over
every byte before the write: in a memory-tier save, a third of the CPU time
(docs/performance.md, "CRC-32s at the speed of the copy"). Here torch's zip writer runs with
its CRC turned off, and the pieces it writes pass through `CrcRecords`, which computes each
record's CRC-32 with ISA-L (the maintained `isal` package, ~8 GB/s per core here; the standard
library's zlib where it is not installed) slice by slice, while the slice is in cache for the
write and the hashes after it, and writes it into the data descriptor, the central directory
and the serialization id exactly where torch would have. The bytes equal `torch.save`'s:
`writer_checked()` compares both on small probes once per process and falls back to
`torch.save` if they ever differ (a torch that changes its zip writer), and
tests/backends/test_records.py compares them over dtypes, shapes and sizes. A tensor of
less than 64 KiB is written by torch.save itself: there torch's CRC-32 costs less than
handing its ~40 pieces through `CrcRecords` (150 against 300 us a record).

torch's zip writer (miniz in streaming mode) writes each record as separate pieces: a local
header (sizes and CRC zero), the name, the extra field (alignment padding), the data (absent
for an empty storage), then a data descriptor with the CRC and sizes; after the last record,
the central directory and the end records (past 4 GiB, zip64: the extra field in two pieces,
24-byte descriptors). This module follows those pieces and refuses
(`_Unexpected`) anything else, before any byte of the unexpected piece is passed on.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import struct
import threading
from typing import Any

import torch

from statereg.dcp import torch_private
from statereg.errors import StateregError

try:
    from isal.isal_zlib import crc32
except ImportError:  # a platform without isal's wheels: the standard library's, ~5x slower
    from zlib import crc32

_LOCAL = b"PK\x03\x04"
_DESCRIPTOR = b"PK\x07\x08"
_CENTRAL = b"PK\x01\x02"
_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")
_CENTRAL_HEADER = struct.Struct("<4s4B4HL2L5H2L")
_ID_RECORD = "archive/.data/serialization_id"
_STORAGE_PREFIX = "archive/data/"
# Payload bytes handed on per write: the CRC, the hashes and the write each read a slice
# while it is still in the CPU's cache.
SLICE = 1 << 20
# Tensors of fewer bytes go through torch.save itself, its CRC-32s included (save_record).
# Below 64 KiB an encoder never needs the tensor's bytes as a write of their own (codec.py).
_SMALL_RECORD = 64 * 1024
_U64 = (1 << 64) - 1


class _Unexpected(StateregError):
    """torch's zip writer wrote a piece this module does not expect (a torch whose writer
    changed after `writer_checked()` passed: not seen; the save fails, nothing is committed)."""

    def __init__(self, expected: str) -> None:
        super().__init__(
            f"torch {torch.__version__}'s zip writer did not write {expected} where statereg "
            "expected it; the save was not committed. Report this with your torch version")


def _hash_combine(seed: int, value: int) -> int:
    """c10::hash_combine on 64 bits, which torch folds every record's CRC-32 into for the
    serialization id."""
    return seed ^ ((value + 0x9E3779B9 + ((seed << 6) & _U64) + (seed >> 2)) & _U64)


class CrcRecords(io.RawIOBase):
    """Receives torch's zip writer's pieces with zero CRCs; writes them to `out` with the
    right ones. `finish()` after the writer's end of file passes on the central directory.

    `payload` is the tensor storage's size in bytes, so its record is told from the others
    by name and size, never by guessing; `sliced` hands the payload on in `SLICE` pieces
    (False for an encoder that wants it in one write).
    """

    def __init__(self, out: Any, payload: int, sliced: bool = True) -> None:
        super().__init__()
        self._out = out
        self._payload = payload
        self._sliced = sliced
        self._state = "header"
        self._name_length = self._extra_length = 0
        self._name = ""
        self._empty = False
        self._crc = self._size = 0
        self._crcs: list[tuple[str, int]] = []
        self._combined = 0
        self._trailer = bytearray()
        self._discarding = False

    def discard(self) -> None:
        """Drop whatever the writer still writes (its end of file after a failed save)."""
        self._discarding = True

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        piece = memoryview(data).cast("B")
        size = len(piece)
        if self._discarding:
            return size
        state = self._state
        if state == "header":
            if bytes(piece[:4]) == _CENTRAL:
                self._state = "trailer"
                self._trailer += piece
                return size
            if size != _LOCAL_HEADER.size or bytes(piece[:4]) != _LOCAL:
                raise _Unexpected(f"a local header, got {size} bytes")
            fields = _LOCAL_HEADER.unpack(piece)
            # miniz writes an empty record with no data descriptor (flag bit 3 clear), its
            # CRC and sizes zero in the header: nothing to fill in.
            self._empty = not fields[3] & 0x08
            if self._empty and fields[7:10] != (0, 0, 0):
                raise _Unexpected("an empty record or a data descriptor")
            self._name_length, self._extra_length = fields[-2], fields[-1]
            self._state = "name"
        elif state == "name":
            if size != self._name_length:
                raise _Unexpected("the record's name")
            self._name = bytes(piece).decode()
            self._crc = self._size = 0
            self._state = "extra" if self._extra_length else self._after_extra()
        elif state == "extra":
            # A zip64 record's extra field comes in two pieces: its zip64 sizes, then the
            # alignment padding.
            if size > self._extra_length:
                raise _Unexpected("the record's extra field")
            self._extra_length -= size
            if not self._extra_length:
                self._state = self._after_extra()
        elif state == "data":
            if self._name.startswith(_STORAGE_PREFIX) and size != self._payload:
                raise _Unexpected(f"{self._payload} bytes of storage, got {size}")
            if size >= 8 and bytes(piece[:4]) == _DESCRIPTOR:
                # torch folds the CRC of every written piece that starts like a data
                # descriptor into the id, data that happens to, included: so does this.
                self._combined = _hash_combine(self._combined,
                                               struct.unpack_from("<I", piece, 4)[0])
            self._state = "descriptor"
            if self._name == _ID_RECORD:
                piece = self._serialization_id(piece)
            self._size = size
            if self._sliced and size > SLICE:
                for start in range(0, size, SLICE):
                    part = piece[start:start + SLICE]
                    self._crc = crc32(part, self._crc)
                    self._out.write(part)
                return size
            self._crc = crc32(piece)
        elif state == "descriptor":
            return self._descriptor(piece)
        else:
            self._trailer += piece
            return size
        self._out.write(piece)
        return size

    def _after_extra(self) -> str:
        if not self._empty:
            return "data"
        if self._name.startswith(_STORAGE_PREFIX) and self._payload != 0:
            raise _Unexpected(f"{self._payload} bytes of storage, got an empty record")
        self._crcs.append((self._name, 0))
        return "header"

    def _descriptor(self, piece: memoryview) -> int:
        size = len(piece)
        if size not in (16, 24) or bytes(piece[:4]) != _DESCRIPTOR:
            raise _Unexpected(f"a data descriptor, got {size} bytes")
        sizes = struct.unpack_from("<II" if size == 16 else "<QQ", piece, 8)
        if sizes != (self._size, self._size):
            raise _Unexpected(f"a descriptor for {self._size} bytes, got sizes {sizes}")
        patched = bytearray(piece)
        struct.pack_into("<I", patched, 4, self._crc)
        self._crcs.append((self._name, self._crc))
        self._combined = _hash_combine(self._combined, self._crc)
        self._state = "header"
        self._out.write(patched)
        return size

    def _serialization_id(self, piece: memoryview) -> memoryview:
        """torch's id is 20 digits of the record names' hash, then 20 of the CRCs' (all zero
        as torch saw them): the second half is computed again from the real CRCs."""
        text = bytes(piece)
        if len(text) != 40 or not text.isdigit():
            raise _Unexpected("a 40-digit serialization id")
        return memoryview(text[:20] + b"%020d" % self._combined)

    def finish(self) -> None:
        """Write the central directory and end records, each entry's CRC filled in."""
        if self._state != "trailer":
            raise _Unexpected("the central directory")
        trailer, offset = self._trailer, 0
        for name, crc in self._crcs:
            if bytes(trailer[offset:offset + 4]) != _CENTRAL:
                raise _Unexpected(f"the central directory entry of {name}")
            fields = _CENTRAL_HEADER.unpack_from(trailer, offset)
            name_length, extra_length, comment_length = fields[12], fields[13], fields[14]
            start = offset + _CENTRAL_HEADER.size
            if bytes(trailer[start:start + name_length]).decode() != name:
                raise _Unexpected(f"the central directory entry of {name}")
            struct.pack_into("<I", trailer, offset + 16, crc)
            offset = start + name_length + extra_length + comment_length
        self._out.write(trailer)


def save_record(tensor: torch.Tensor, out: Any, sliced: bool = True) -> None:
    """Write `torch.save(tensor)`'s bytes to `out`, its CRC-32s computed here (see above).

    `tensor` is a CPU tensor whose storage it covers exactly (the writer clones any other).
    Anything but a plain strided tensor (a subclass, a sparse or quantized one, whose records
    this module has not been checked against) goes to torch.save itself.
    """
    plain = (type(tensor) is torch.Tensor and tensor.layout == torch.strided
             and not tensor.is_quantized)
    if not plain or not writer_checked():
        torch.save(tensor, out)
        return
    if (tensor.untyped_storage().nbytes() < _SMALL_RECORD
            and torch.serialization.get_crc32_options()):
        # The same bytes (writer_checked), in half the time: for a small tensor, torch's own
        # CRC-32 costs less than passing its ~40 pieces through CrcRecords one by one.
        buffer = io.BytesIO()
        torch.save(tensor, buffer)
        out.write(buffer.getbuffer())
        out.flush()
        return
    _save_crc_records(tensor, out, sliced)


def _save_crc_records(tensor: torch.Tensor, out: Any, sliced: bool) -> None:
    records = CrcRecords(out, tensor.untyped_storage().nbytes(), sliced)
    writer = torch_private.zip_writer_without_crc(records)
    try:
        torch_private.save_into_zip(tensor, writer, pickle)
    except BaseException:
        # torch's writer finishes the archive when it is dropped, writing into `records`
        # from a destructor, where a second error would abort the process: finish it now,
        # into nothing.
        records.discard()
        with contextlib.suppress(Exception):  # its own complaint about the failed write
            writer.write_end_of_file()
        raise
    writer.write_end_of_file()
    records.finish()
    out.flush()  # as torch.save ends


_checked: bool | None = None
_check_lock = threading.Lock()


def writer_checked() -> bool:
    """Whether this torch's zip writer, driven by `CrcRecords`, writes `torch.save`'s bytes:
    checked once per process on probes of several dtypes and sizes (an empty one too). A
    process that turned torch.save's CRC-32 off (`set_crc32_options(False)`) before its first
    save keeps torch.save: its records then have no CRCs, as that process asked."""
    global _checked
    if _checked is None:
        with _check_lock:
            if _checked is None:
                _checked = _probe()
    return _checked


def _probe() -> bool:
    if not torch_private.ZIP_WRITER_AVAILABLE:
        return False
    probes = [torch.arange(300, dtype=torch.float32), torch.ones(3, 5, dtype=torch.bfloat16),
              torch.zeros(0, dtype=torch.int64), torch.arange(7, dtype=torch.uint8)]
    try:
        for probe in probes:
            expected, ours = io.BytesIO(), io.BytesIO()
            torch.save(probe, expected)
            _save_crc_records(probe, ours, sliced=True)
            if ours.getvalue() != expected.getvalue():
                return False
    except (_Unexpected, RuntimeError, TypeError, AttributeError, struct.error):
        return False
    return True
