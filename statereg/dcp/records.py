"""One tensor's `torch.save` record, byte for byte, with its CRC-32s computed by statereg.

torch computes each zip record's CRC-32 with miniz at ~2.7-5 GB/s, one pass of its own over
every byte before the write: in a memory-tier save, a third of the CPU time
(benchmarks/results/journal.md, "CRC-32s at the speed of the copy"). Here torch's zip writer
runs with its CRC turned off, and the pieces it writes pass through `CrcRecords`, which
computes each record's CRC-32 with ISA-L (the maintained `isal` package, ~8 GB/s per core
here; the standard library's zlib where it is not installed) slice by slice, while the slice
is in cache for the write and the hashes after it, and writes it into the data descriptor,
the central directory and the serialization id exactly where torch would have. The bytes
equal `torch.save`'s: `writer_checked()` compares both on small probes once per process and
falls back to `torch.save` if they ever differ (a torch that changes its zip writer), and
tests/backends/test_records.py compares them over dtypes, shapes and sizes.

A record of a tensor of a layout seen before (dtype, shape, strides, storage) is written from
that layout's template (`_Template`): the first record's bytes around the payload, with the
payload's CRC-32 and the serialization id filled in. torch's pickler and the ~40 pieces per
record through `CrcRecords` cost 150-300 us a tensor, which is most of a save of many small
tensors; a template costs ~20 us. `templates_checked()` probes it once per process.

torch's zip writer (miniz in streaming mode) writes each record as separate pieces: a local
header (sizes and CRC zero), the name, the extra field (alignment padding), the data (absent
for an empty storage), then a data descriptor with the CRC and sizes; after the last record,
the central directory and the end records (past 4 GiB, zip64: the extra field in two pieces,
24-byte descriptors). This module follows those pieces and refuses
(`_Unexpected`) anything else, before any byte of the unexpected piece is passed on.

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
import zipfile
from typing import Any, cast

import torch

from statereg.dcp import torch_private
from statereg.dcp.torchsave import RecordWindow
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
# Tensors of at most this many bytes are written from a template of their layout (_Template):
# past it, torch's per-record work is nothing beside the bytes' own, and records stay below
# zip64's limits.
_TEMPLATED_UP_TO = 64 << 20
_TEMPLATES_KEPT = 4096
_U64 = (1 << 64) - 1


class RecordError(ValueError):
    """A record `add_crcs` reads is not laid out as torch.save lays one out (what was
    expected is the message)."""


class _Unexpected(StateregError):
    """torch's zip writer wrote a piece this module does not expect (a torch whose writer
    changed after `writer_checked()` passed: not seen; the save fails, nothing is committed)."""

    def __init__(self, expected: str) -> None:
        self.expected = expected
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
            self._crc = _write_payload(piece, self._out, self._sliced, self._crcs_on)
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
        if not self._crcs_on:
            return piece
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


def save_record(tensor: torch.Tensor, out: Any, sliced: bool = True,
                crcs: bool = True) -> None:
    """Write `torch.save(tensor)`'s bytes to `out`, its CRC-32s computed here (see above), or
    left zero with `crcs` False.

    `tensor` is a CPU tensor whose storage it covers exactly (the writer clones any other).
    Anything but a plain strided tensor (a subclass, a sparse or quantized one, whose records
    this module has not been checked against) goes to torch.save itself, with CRC-32s.
    """
    plain = (type(tensor) is torch.Tensor and tensor.layout == torch.strided
             and not tensor.is_quantized)
    if not plain or not writer_checked():
        torch.save(tensor, out)
        return
    nbytes = tensor.untyped_storage().nbytes()
    if (nbytes <= _TEMPLATED_UP_TO and not tensor.is_conj() and not tensor.is_neg()
            and not tensor.__dict__  # what else torch pickles with a tensor
            and templates_checked()):
        template = _template(tensor, nbytes, crcs)
        if template is not None:
            template.write(tensor, out, sliced)
            return
    _save_crc_records(tensor, out, sliced, crcs)


class _Template:
    """torch.save's record of every tensor of one layout (dtype, shape, strides, storage
    offset and size), made from the record CrcRecords wrote for the first such tensor.

    Two such records differ only in the payload (the storage's bytes), its CRC-32 (in its
    data descriptor and its central directory entry), and the serialization id, whose second
    half folds that CRC-32 in, with the id record's own CRC-32: `write` sends the bytes before
    the payload as they are, the payload in slices (its CRC-32 computed on the way, as
    CrcRecords does), then the bytes after it with those five fields filled in. A template
    made without CRC-32s (`crcs` False) keeps them all zero, its id folding zeros as torch's
    writer then does. torch's
    pickler and ~40 pieces through Python per record are spared: ~20 us a record instead of
    150-300 us. A record of another shape (zip64, the id before the payload, a second
    storage) raises _Unexpected and its layout keeps the plain path. The first record of a
    layout is serialized twice (once to make the template), which a save of the same shapes
    pays once per process.
    """

    def __init__(self, record: bytes, payload: int, crcs: bool = True) -> None:
        entries = _entries(record)
        names = [name for name, *_ in entries]
        storages = [e for e in entries if e[0].startswith(_STORAGE_PREFIX)]
        if len(storages) != 1 or storages[0][2] != payload or _ID_RECORD not in names:
            raise _Unexpected("one storage record and a serialization id")
        _, start, _, central = storages[0]
        _, id_start, id_size, id_central = entries[names.index(_ID_RECORD)]
        if id_start < start + payload or id_size != 40:
            raise _Unexpected("the serialization id after the storage")
        end = start + payload
        self.payload, self.prefix, self.suffix = payload, record[:start], record[end:]
        # Where the five varying fields lie in `suffix` (the descriptor follows the payload).
        self.fields = (4, central + 16 - end, id_start + 20 - end, id_start + 44 - end,
                       id_central + 16 - end)
        self.id_names = record[id_start:id_start + 20]
        self.crcs = crcs
        # What torch folds into the id, in order: each record's CRC-32 (zero without them)
        # and the bytes 4-8 of a record that starts like a data descriptor; None: the
        # payload's own (see write).
        self.folds: list[int | None] = []
        for name, data_start, size, _ in entries[:names.index(_ID_RECORD)]:
            if not size:
                continue  # an empty record: no descriptor, nothing folded
            if name.startswith(_STORAGE_PREFIX):
                self.folds.append(None)
                continue
            data = record[data_start:data_start + size]
            if size >= 8 and data[:4] == _DESCRIPTOR:
                self.folds.append(struct.unpack_from("<I", data, 4)[0])
            self.folds.append(crc32(data) if crcs else 0)

    def write(self, tensor: torch.Tensor, out: Any, sliced: bool) -> None:
        out.write(self.prefix)
        if not self.payload:  # an empty storage: its record is the same for all
            out.write(self.suffix)
            out.flush()
            return
        payload = _storage_bytes(tensor, self.payload)
        crc = _write_payload(payload, out, sliced, self.crcs)
        combined = 0
        for value in self.folds:
            if value is not None:
                combined = _hash_combine(combined, value)
                continue
            # The payload's: its bytes 4-8 if it starts like a descriptor, then its CRC-32.
            if self.payload >= 8 and bytes(payload[:4]) == _DESCRIPTOR:
                combined = _hash_combine(combined, struct.unpack_from("<I", payload, 4)[0])
            combined = _hash_combine(combined, crc)
        identity = self.id_names + b"%020d" % combined
        suffix = bytearray(self.suffix)
        at_descriptor, at_central, at_id, at_id_descriptor, at_id_central = self.fields
        struct.pack_into("<I", suffix, at_descriptor, crc)
        struct.pack_into("<I", suffix, at_central, crc)
        suffix[at_id:at_id + 20] = identity[20:]
        id_crc = crc32(identity) if self.crcs else 0
        struct.pack_into("<I", suffix, at_id_descriptor, id_crc)
        struct.pack_into("<I", suffix, at_id_central, id_crc)
        out.write(suffix)
        out.flush()  # as torch.save ends


def _storage_bytes(tensor: torch.Tensor, nbytes: int) -> memoryview:
    """The bytes of the storage `tensor` covers exactly (what torch.save writes)."""
    # torch's stubs require a stride here; the 3-argument form is valid (contiguous):
    flat = torch.empty(0, dtype=torch.uint8).set_(  # type: ignore[call-overload]
        tensor.untyped_storage(), 0, (nbytes,))
    return memoryview(flat.numpy()).cast("B")


def _write_payload(data: memoryview, out: Any, sliced: bool, crcs: bool) -> int:
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


def _entries(record: bytes) -> list[tuple[str, int, int, int]]:
    """(name, data offset, size, central directory entry offset) of each record of one
    torch.save archive without zip64, in the order written; _Unexpected otherwise."""
    end = struct.unpack_from("<4s4H2LH", record, len(record) - 22)
    if end[0] != b"PK\x05\x06" or end[7] or end[6] == 0xFFFFFFFF:
        raise _Unexpected("an end of central directory without zip64")
    entries, at = [], end[6]
    for _ in range(end[4]):
        header = _CENTRAL_HEADER.unpack_from(record, at)
        if header[0] != _CENTRAL:
            raise _Unexpected("a central directory entry")
        size, name_length, extra_length, comment_length, local = (
            header[10], header[12], header[13], header[14], header[-1])
        name = record[at + _CENTRAL_HEADER.size:at + _CENTRAL_HEADER.size + name_length]
        fields = _LOCAL_HEADER.unpack_from(record, local)
        data = local + _LOCAL_HEADER.size + fields[-2] + fields[-1]
        entries.append((name.decode(), data, size, at))
        at += _CENTRAL_HEADER.size + name_length + extra_length + comment_length
    return sorted(entries, key=lambda e: e[1])


_templates: dict[tuple[Any, ...], _Template | None] = {}
_NOT_MADE = object()


def _template(tensor: torch.Tensor, nbytes: int, crcs: bool) -> _Template | None:
    """The template of `tensor`'s layout (with or without CRC-32s), made from its first
    record; None for a layout whose record is not as _Template expects."""
    key = (tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(),
           nbytes, tensor.requires_grad, torch_private.storage_alignment(), crcs)
    found = _templates.get(key, _NOT_MADE)
    if found is not _NOT_MADE:
        return cast("_Template | None", found)
    made = _make_template(tensor, nbytes, crcs)
    if len(_templates) >= _TEMPLATES_KEPT:  # layouts that come and go (one-off shapes)
        _templates.clear()
    _templates[key] = made
    return made


def _make_template(tensor: torch.Tensor, nbytes: int, crcs: bool = True) -> _Template | None:
    record = io.BytesIO()
    _save_crc_records(tensor, record, sliced=False, crcs=crcs)
    try:
        return _Template(record.getvalue(), nbytes, crcs)
    except (_Unexpected, struct.error):
        return None


def _save_crc_records(tensor: torch.Tensor, out: Any, sliced: bool, crcs: bool = True) -> None:
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


_templates_usable: bool | None = None


def templates_checked() -> bool:
    """Whether a template made from one tensor writes torch.save's bytes for another of its
    layout: checked once per process on probes whose second tensor has other bytes (one
    starting like a data descriptor too), which a torch whose records hold anything else
    that depends on the data would fail (and, written without CRC-32s, one gives what torch's
    writer gives with its CRC-32 off). Then records are written by CrcRecords alone."""
    global _templates_usable
    if _templates_usable is None:  # two threads may both probe: the same answer
        _templates_usable = writer_checked() and _probe_templates()
    return _templates_usable


def _probe_templates() -> bool:
    pairs = [(torch.arange(300, dtype=torch.float32), torch.arange(300.0).flip(0)),
             (torch.ones(3, 5, dtype=torch.bfloat16), torch.full((3, 5), -2.0).bfloat16()),
             (torch.arange(16, dtype=torch.uint8),
              torch.tensor([*_DESCRIPTOR, *range(12)], dtype=torch.uint8)),
             (torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))]
    try:
        for first, other in pairs:
            template = _make_template(first, first.untyped_storage().nbytes())
            if template is None:
                return False
            expected, ours = io.BytesIO(), io.BytesIO()
            torch.save(other, expected)
            template.write(other, ours, sliced=True)
            if ours.getvalue() != expected.getvalue():
                return False
            # Without CRC-32s: what torch's writer itself writes with its CRC-32 off.
            template = _make_template(first, first.untyped_storage().nbytes(), crcs=False)
            if template is None:
                return False
            expected, ours = io.BytesIO(), io.BytesIO()
            _save_without_crcs(other, expected)
            template.write(other, ours, sliced=True)
            if ours.getvalue() != expected.getvalue():
                return False
    except (_Unexpected, RuntimeError, TypeError, AttributeError, struct.error):
        return False
    return True


def _save_without_crcs(tensor: torch.Tensor, out: Any) -> None:
    """torch.save's bytes with its CRC-32 option off, from torch's writer alone."""
    writer = torch_private.zip_writer_without_crc(out)
    torch_private.save_into_zip(tensor, writer, pickle)
    writer.write_end_of_file()


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


# -- adding CRC-32s to a record written without them ------------------------------------------

_DESCRIPTOR_SIZES = (struct.Struct("<4sIII"), struct.Struct("<4sIQQ"))


class _Member:
    """One member of a record: where its data and its data descriptor lie."""

    def __init__(self, name: str, header: int, data: int, size: int) -> None:
        self.name, self.header, self.data, self.size = name, header, data, size


def _plan(stream: Any, offset: int, length: int) -> tuple[list[_Member], int, list[str]]:
    """The members of the torch.save record at [offset, offset+length) of `stream` (in the
    order stored), where its central directory starts, and the names of its entries in
    order: read from the record's end and its local headers, before its bytes are read in
    order (`add_crcs` checks what it finds there against this)."""
    window = RecordWindow(stream, offset, length)
    try:
        archive = zipfile.ZipFile(window)
        infos = archive.infolist()
        start = archive.start_dir
    except (zipfile.BadZipFile, ValueError, struct.error, EOFError) as exc:
        raise _Unexpected(f"a zip record ({exc})") from None
    members = []
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED:
            raise _Unexpected(f"{info.filename} stored uncompressed")
        window.seek(info.header_offset)
        header = window.read(_LOCAL_HEADER.size)
        if len(header) != _LOCAL_HEADER.size or header[:4] != _LOCAL:
            raise _Unexpected(f"the local header of {info.filename}")
        fields = _LOCAL_HEADER.unpack(header)
        data = info.header_offset + _LOCAL_HEADER.size + fields[-2] + fields[-1]
        members.append(_Member(info.orig_filename, info.header_offset, data, info.file_size))
    members.sort(key=lambda m: m.header)
    return members, start, [info.orig_filename for info in infos]


def add_crcs(stream: Any, offset: int, length: int, out: Any, hasher: Any) -> None:
    """Write the torch.save record at [offset, offset+length) of `stream` (seekable) to `out`
    with every CRC-32 computed (and the serialization id that folds them in): the bytes
    `torch.save` writes for the same tensor, whether the record had CRC-32s or was written
    without them (`crcs=False`, in memory). A drain to a store that keeps CRC-32s passes the
    memory tier's records through this. The record's bytes are read once, in order, and
    each passes through `hasher` (the caller checks them against the item's digest); the
    payload goes on in SLICE pieces. RecordError for anything but torch's zip layout,
    before a byte is written when the record's end or headers say so."""
    try:
        _add_crcs(stream, offset, length, out, hasher)
    except (_Unexpected, struct.error) as exc:
        raise RecordError(getattr(exc, "expected", None) or str(exc)) from None


def _add_crcs(stream: Any, offset: int, length: int, out: Any, hasher: Any) -> None:
    members, directory, names = _plan(stream, offset, length)
    stream.seek(offset)
    position = 0

    def take(size: int) -> bytes:
        nonlocal position
        data = stream.read(size)
        if data is None or len(data) != size:
            raise _Unexpected(f"{size} bytes at {position} of the record")
        hasher.update(data)
        position += size
        return data

    crcs: dict[str, int] = {}
    combined = 0
    for member in members:
        if member.header != position or member.data > length or member.size > length:
            raise _Unexpected(f"{member.name} where its header says")
        out.write(take(member.data - position))
        if member.name == _ID_RECORD:
            digits = take(member.size)
            if len(digits) != 40 or not digits.isdigit():
                raise _Unexpected("a 40-digit serialization id")
            digits = digits[:20] + b"%020d" % combined
            crc = crc32(digits)
            out.write(digits)
        else:
            crc, first = 0, b""
            for _ in range(0, member.size, SLICE):
                piece = take(min(SLICE, member.size - (position - member.data)))
                first = first or piece[:8]
                crc = crc32(piece, crc)
                out.write(piece)
            if len(first) >= 8 and first[:4] == _DESCRIPTOR:  # folded by torch: see CrcRecords
                combined = _hash_combine(combined, struct.unpack_from("<I", first, 4)[0])
        crcs[member.name] = crc
        if not member.size and member.name != _ID_RECORD:
            continue  # an empty member: no descriptor (its CRC-32 is zero)
        descriptor = _read_descriptor(take, member)
        struct.pack_into("<I", descriptor, 4, crc)
        combined = _hash_combine(combined, crc)
        out.write(descriptor)
    if directory != position:
        raise _Unexpected("the central directory after the last member")
    trailer = bytearray(take(length - position))
    at = 0
    for name in names:
        if bytes(trailer[at:at + 4]) != _CENTRAL:
            raise _Unexpected(f"the central directory entry of {name}")
        fields = _CENTRAL_HEADER.unpack_from(trailer, at)
        struct.pack_into("<I", trailer, at + 16, crcs[name])
        at += _CENTRAL_HEADER.size + fields[12] + fields[13] + fields[14]
    out.write(trailer)


def _read_descriptor(take: Any, member: _Member) -> bytearray:
    """The data descriptor after `member`'s data: 16 bytes, or 24 past zip64's limits."""
    head = take(16)
    short, long = _DESCRIPTOR_SIZES
    if head[:4] == _DESCRIPTOR and short.unpack(head)[2:] == (member.size, member.size):
        return bytearray(head)
    whole = head + take(8)
    if whole[:4] == _DESCRIPTOR and long.unpack(whole)[2:] == (member.size, member.size):
        return bytearray(whole)
    raise _Unexpected(f"the data descriptor of {member.name}")
