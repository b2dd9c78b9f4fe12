"""One tensor's `torch.save` record from torch's own zip writer, its CRC-32s computed here.

torch computes each zip record's CRC-32 with miniz at ~2.7-5 GB/s, one pass of its own over
every byte before the write: in a memory-tier save, a third of the CPU time
(benchmarks/results/journal.md, "CRC-32s at the speed of the copy"). Here torch's zip writer
runs with its CRC turned off, and the pieces it writes pass through `CrcRecords`, which
computes each record's CRC-32 with ISA-L (the maintained `isal` package, ~8 GB/s per core
here; the standard library's zlib where it is not installed) slice by slice, while the slice
is in cache for the write and the hashes after it, and writes it into the data descriptor,
the central directory and the serialization id exactly where torch would have.
`writer_checked()` compares the bytes with `torch.save`'s on small probes once per process;
where they differ (a torch whose zip writer changed) it warns once and every record is
written by `torch.save` itself.

torch's zip writer (miniz in streaming mode) writes each record as separate pieces: a local
header (sizes and CRC zero), the name, the extra field (alignment padding), the data (absent
for an empty storage), then a data descriptor with the CRC and sizes; after the last record,
the central directory and the end records (past 4 GiB, zip64: the extra field in two pieces,
24-byte descriptors). `CrcRecords` follows those pieces and refuses (`Unexpected`) anything
else, before any byte of the unexpected piece is passed on.

With `crcs=False` (a memory root: `IOPolicy.record_crcs`, engine/io_policy.py) every CRC-32
stays zero, as `torch.save` writes under `torch.serialization.set_crc32_options(False)`:
torch.load and DCP read such records (neither checks a record's CRC-32: a flipped payload
byte loads silently), and statereg checks every item's bytes with its own xxh3 digest, so
in memory the CRC pass buys nothing (benchmarks/results/journal.md, "Memory saves into kept
mappings, without CRC-32s").
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
from statereg.dcp.torchsave import layout
from statereg.dcp.torchsave.layout import (
    CENTRAL,
    CENTRAL_HEADER,
    DESCRIPTOR,
    ID_DIGITS,
    ID_RECORD,
    LOCAL,
    LOCAL_HEADER,
    SLICE,
    STORAGE_PREFIX,
    Unexpected,
    crc32,
    hash_combine,
)
from statereg.process_state import process_wide


class CrcRecords(io.RawIOBase):
    """Receives torch's zip writer's pieces with zero CRCs; writes them to `out` with the
    right ones. `finish()` after the writer's end of file passes on the central directory.

    `payload` is the tensor storage's size in bytes, so its record is told from the others
    by name and size, never by guessing; `sliced` hands the payload on in `SLICE` pieces
    (False for an encoder that wants it in one write); with `crcs` False the pieces pass
    unchanged (every CRC-32 zero, as torch wrote them), still checked for their shape.
    """

    def __init__(self, out: Any, payload: int, sliced: bool = True, crcs: bool = True) -> None:
        super().__init__()
        self._out = out
        self._payload = payload
        self._sliced = sliced
        self._crcs_on = crcs
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
            if bytes(piece[:4]) == CENTRAL:
                self._state = "trailer"
                self._trailer += piece
                return size
            if size != LOCAL_HEADER.size or bytes(piece[:4]) != LOCAL:
                raise Unexpected(f"a local header, got {size} bytes")
            fields = LOCAL_HEADER.unpack(piece)
            # miniz writes an empty record with no data descriptor (flag bit 3 clear), its
            # CRC and sizes zero in the header: nothing to fill in.
            self._empty = not fields[3] & 0x08
            if self._empty and fields[7:10] != (0, 0, 0):
                raise Unexpected("an empty record or a data descriptor")
            self._name_length, self._extra_length = fields[-2], fields[-1]
            self._state = "name"
        elif state == "name":
            if size != self._name_length:
                raise Unexpected("the record's name")
            self._name = bytes(piece).decode()
            self._crc = self._size = 0
            self._state = "extra" if self._extra_length else self._after_extra()
        elif state == "extra":
            # A zip64 record's extra field comes in two pieces: its zip64 sizes, then the
            # alignment padding.
            if size > self._extra_length:
                raise Unexpected("the record's extra field")
            self._extra_length -= size
            if not self._extra_length:
                self._state = self._after_extra()
        elif state == "data":
            if self._name.startswith(STORAGE_PREFIX) and size != self._payload:
                raise Unexpected(f"{self._payload} bytes of storage, got {size}")
            if size >= 8 and bytes(piece[:4]) == DESCRIPTOR:
                # torch folds the CRC of every written piece that starts like a data
                # descriptor into the id, data that happens to, included: so does this.
                self._combined = hash_combine(self._combined,
                                               struct.unpack_from("<I", piece, 4)[0])
            self._state = "descriptor"
            if self._name == ID_RECORD:
                piece = self._serialization_id(piece)
            self._size = size
            self._crc = write_payload(piece, self._out, self._sliced, self._crcs_on)
            return size
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
        if self._name.startswith(STORAGE_PREFIX) and self._payload != 0:
            raise Unexpected(f"{self._payload} bytes of storage, got an empty record")
        self._crcs.append((self._name, 0))
        return "header"

    def _descriptor(self, piece: memoryview) -> int:
        size = len(piece)
        if size not in (16, 24) or bytes(piece[:4]) != DESCRIPTOR:
            raise Unexpected(f"a data descriptor, got {size} bytes")
        sizes = struct.unpack_from("<II" if size == 16 else "<QQ", piece, 8)
        if sizes != (self._size, self._size):
            raise Unexpected(f"a descriptor for {self._size} bytes, got sizes {sizes}")
        patched = bytearray(piece)
        struct.pack_into("<I", patched, 4, self._crc)
        self._crcs.append((self._name, self._crc))
        self._combined = hash_combine(self._combined, self._crc)
        self._state = "header"
        self._out.write(patched)
        return size

    def _serialization_id(self, piece: memoryview) -> memoryview:
        """torch's id is 20 digits of the record names' hash, then 20 of the CRCs' (all zero
        as torch saw them): the second half is computed again from the real CRCs."""
        text = bytes(piece)
        if len(text) != ID_DIGITS or not text.isdigit():
            raise Unexpected("a 40-digit serialization id")
        if not self._crcs_on:
            return piece
        return memoryview(text[:20] + b"%020d" % self._combined)

    def finish(self) -> None:
        """Write the central directory and end records, each entry's CRC filled in."""
        if self._state != "trailer":
            raise Unexpected("the central directory")
        trailer, offset = self._trailer, 0
        for name, crc in self._crcs:
            if bytes(trailer[offset:offset + 4]) != CENTRAL:
                raise Unexpected(f"the central directory entry of {name}")
            fields = CENTRAL_HEADER.unpack_from(trailer, offset)
            name_length, extra_length, comment_length = fields[12], fields[13], fields[14]
            start = offset + CENTRAL_HEADER.size
            if bytes(trailer[start:start + name_length]).decode() != name:
                raise Unexpected(f"the central directory entry of {name}")
            struct.pack_into("<I", trailer, offset + 16, crc)
            offset = start + name_length + extra_length + comment_length
        self._out.write(trailer)


def storage_bytes(tensor: torch.Tensor, nbytes: int) -> memoryview:
    """The bytes of the storage `tensor` covers exactly (what torch.save writes)."""
    # torch's stubs require a stride here; the 3-argument form is valid (contiguous):
    flat = torch.empty(0, dtype=torch.uint8).set_(  # type: ignore[call-overload]
        tensor.untyped_storage(), 0, (nbytes,))
    return memoryview(flat.numpy()).cast("B")


def write_payload(data: memoryview, out: Any, sliced: bool, crcs: bool) -> int:
    """Write `data` to `out` and return its CRC-32 (0 without `crcs`): with `sliced`, in
    SLICE pieces, each CRC'd just before its write (still in cache); else in one write."""
    if not sliced or len(data) <= SLICE:
        out.write(data)
        return crc32(data) if crcs else 0
    crc = 0
    for start in range(0, len(data), SLICE):
        part = data[start:start + SLICE]
        if crcs:
            crc = crc32(part, crc)
        out.write(part)
    return crc


def save_crc_records(tensor: torch.Tensor, out: Any, sliced: bool, crcs: bool = True) -> None:
    """`tensor`'s record through torch's writer and `CrcRecords` into `out`."""
    records = CrcRecords(out, tensor.untyped_storage().nbytes(), sliced, crcs)
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


def save_without_crcs(tensor: torch.Tensor, out: Any) -> None:
    """torch.save's bytes with its CRC-32 option off, from torch's writer alone."""
    writer = torch_private.zip_writer_without_crc(out)
    torch_private.save_into_zip(tensor, writer, pickle)
    writer.write_end_of_file()


_checked: bool | None = None
_check_lock = threading.Lock()
process_wide(__name__, "_checked", "whether this torch's zip writer writes torch.save's bytes, "
             "probed once")


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


_INSTEAD = "every record is written by torch.save itself"


def _probe() -> bool:
    if not torch_private.ZIP_WRITER_AVAILABLE:
        layout.warn_fallback("torch.save's private zip writer (torch._C.PyTorchFileWriter, "
                             "torch.serialization._save) is missing", _INSTEAD)
        return False
    if not torch.serialization.get_crc32_options():
        return False  # this process asked torch.save for records without CRC-32s
    probes = [torch.arange(300, dtype=torch.float32), torch.ones(3, 5, dtype=torch.bfloat16),
              torch.zeros(0, dtype=torch.int64), torch.arange(7, dtype=torch.uint8)]
    try:
        for probe in probes:
            expected, ours = io.BytesIO(), io.BytesIO()
            torch.save(probe, expected)
            save_crc_records(probe, ours, sliced=True)
            if ours.getvalue() != expected.getvalue():
                layout.warn_fallback(f"a record of {probe.dtype} {tuple(probe.shape)} "
                                     "differs from torch.save's bytes", _INSTEAD)
                return False
    except (Unexpected, RuntimeError, TypeError, AttributeError, struct.error) as exc:
        layout.warn_fallback(f"writing a probe failed ({type(exc).__name__}: {exc})", _INSTEAD)
        return False
    return True
