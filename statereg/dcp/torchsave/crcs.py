"""`add_crcs`: a `torch.save` record written without CRC-32s, given them on its way to a
store that keeps them (the memory tier's drain, `statereg cp` out of memory).

The record is read once, front to back: each member's bytes pass through unchanged, its
CRC-32 is computed on the way and written into its data descriptor, the serialization id's
second half is computed again from the real CRC-32s, and the central directory gets them
too. `crcs_checked()` compares the result with `torch.save`'s bytes on probes once per
process; where they differ, and under `STATEREG_PLAIN_TORCH_SAVE=1`, the record is
`torch.load`ed and `torch.save`d instead (`_resave`): the same bytes, slower.
"""

from __future__ import annotations

import io
import struct
import zipfile
from typing import Any

import torch

from statereg.dcp import torch_private
from statereg.dcp.torchsave import crc_stream, layout, write
from statereg.dcp.torchsave.layout import (
    CENTRAL,
    CENTRAL_HEADER,
    DESCRIPTOR,
    DESCRIPTOR32,
    DESCRIPTOR64,
    ID_DIGITS,
    ID_RECORD,
    LOCAL,
    LOCAL_HEADER,
    SLICE,
    Unexpected,
    crc32,
    hash_combine,
)
from statereg.dcp.torchsave.read import RECORD_ERRORS, RecordWindow, check_bounded, hash_range
from statereg.process_state import process_wide


class RecordError(ValueError):
    """A record `add_crcs` reads is not laid out as torch.save lays one out (what was
    expected is the message)."""


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
        raise Unexpected(f"a zip record ({exc})") from None
    members = []
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED:
            raise Unexpected(f"{info.filename} stored uncompressed")
        window.seek(info.header_offset)
        header = window.read(LOCAL_HEADER.size)
        if len(header) != LOCAL_HEADER.size or header[:4] != LOCAL:
            raise Unexpected(f"the local header of {info.filename}")
        fields = LOCAL_HEADER.unpack(header)
        data = info.header_offset + LOCAL_HEADER.size + fields[-2] + fields[-1]
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
    if layout.plain_torch_save() or not crcs_checked():
        _resave(stream, offset, length, out, hasher)
        return
    try:
        _add_crcs(stream, offset, length, out, hasher)
    except (Unexpected, struct.error) as exc:
        raise RecordError(getattr(exc, "expected", None) or str(exc)) from None


def _resave(stream: Any, offset: int, length: int, out: Any, hasher: Any) -> None:
    """`add_crcs` by torch alone: every byte of the record through `hasher`, then the record
    `torch.load`ed (bounded by its size first, as every load is) and `torch.save`d to `out`.
    A record torch.save wrote, with or without CRC-32s, comes out as torch.save's bytes for
    its tensor, as `_add_crcs` writes them, at the cost of a second read and torch's CRC."""
    hash_range(stream, offset, offset + length, hasher)
    try:
        check_bounded(RecordWindow(stream, offset, length), length)
        # torch.load accepts any file-like object; its annotation says IO[bytes]:
        tensor = torch.load(RecordWindow(stream, offset, length),  # type: ignore[arg-type]
                            map_location="cpu", weights_only=True)
    except RECORD_ERRORS as exc:
        raise RecordError(f"a record torch.load reads ({type(exc).__name__}: {exc})") from None
    write.torch_save(tensor, out)


_crcs_usable: bool | None = None
process_wide(__name__, "_crcs_usable", "whether adding CRC-32s gives torch.save's bytes, "
             "probed once")


def crcs_checked() -> bool:
    """Whether `_add_crcs` gives torch.save's bytes on this torch: checked once per process
    on probes written by torch.save and by torch's writer without CRC-32s. Where they differ
    (a torch whose records fold their CRC-32s otherwise), one warning, and every record is
    passed through `_resave`. A process that turned torch.save's CRC-32 off has nothing to
    compare with: it keeps `_add_crcs` unchecked, as before the probe existed."""
    global _crcs_usable
    if _crcs_usable is None:
        if not torch.serialization.get_crc32_options():
            return True
        _crcs_usable = _probe()  # two threads may both probe: the same answer
    return _crcs_usable


_INSTEAD = "CRC-32s are added by torch.load and torch.save"


def _probe() -> bool:
    probes = [torch.arange(300, dtype=torch.float32), torch.ones(3, 5, dtype=torch.bfloat16),
              torch.zeros(0, dtype=torch.int64),
              torch.tensor([*DESCRIPTOR, *range(12)], dtype=torch.uint8)]
    try:
        for probe in probes:
            expected = io.BytesIO()
            torch.save(probe, expected)
            written = [expected.getvalue()]
            if torch_private.ZIP_WRITER_AVAILABLE:
                without = io.BytesIO()
                crc_stream.save_without_crcs(probe, without)
                written.append(without.getvalue())
            for record in written:
                ours = io.BytesIO()
                _add_crcs(io.BytesIO(record), 0, len(record), ours, _NoHash())
                if ours.getvalue() != expected.getvalue():
                    layout.warn_fallback(f"CRC-32s added to a record of {probe.dtype} "
                                         f"{tuple(probe.shape)} differ from torch.save's",
                                         _INSTEAD)
                    return False
    except (Unexpected, RuntimeError, TypeError, AttributeError, struct.error) as exc:
        layout.warn_fallback(f"adding CRC-32s to a probe failed ({type(exc).__name__}: "
                             f"{exc})", _INSTEAD)
        return False
    return True


class _NoHash:
    """A hasher that keeps nothing (the probe's)."""

    def update(self, data: bytes) -> None:
        pass


def _add_crcs(stream: Any, offset: int, length: int, out: Any, hasher: Any) -> None:
    members, directory, names = _plan(stream, offset, length)
    stream.seek(offset)
    position = 0

    def take(size: int) -> bytes:
        nonlocal position
        data = stream.read(size)
        if data is None or len(data) != size:
            raise Unexpected(f"{size} bytes at {position} of the record")
        hasher.update(data)
        position += size
        return data

    crcs: dict[str, int] = {}
    combined = 0
    for member in members:
        if member.header != position or member.data > length or member.size > length:
            raise Unexpected(f"{member.name} where its header says")
        out.write(take(member.data - position))
        if member.name == ID_RECORD:
            digits = take(member.size)
            if len(digits) != ID_DIGITS or not digits.isdigit():
                raise Unexpected("a 40-digit serialization id")
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
            if len(first) >= 8 and first[:4] == DESCRIPTOR:  # folded by torch: see CrcRecords
                combined = hash_combine(combined, struct.unpack_from("<I", first, 4)[0])
        crcs[member.name] = crc
        if not member.size and member.name != ID_RECORD:
            continue  # an empty member: no descriptor (its CRC-32 is zero)
        descriptor = _read_descriptor(take, member)
        struct.pack_into("<I", descriptor, 4, crc)
        combined = hash_combine(combined, crc)
        out.write(descriptor)
    if directory != position:
        raise Unexpected("the central directory after the last member")
    trailer = bytearray(take(length - position))
    at = 0
    for name in names:
        if bytes(trailer[at:at + 4]) != CENTRAL:
            raise Unexpected(f"the central directory entry of {name}")
        fields = CENTRAL_HEADER.unpack_from(trailer, at)
        struct.pack_into("<I", trailer, at + 16, crcs[name])
        at += CENTRAL_HEADER.size + fields[12] + fields[13] + fields[14]
    out.write(trailer)


def _read_descriptor(take: Any, member: _Member) -> bytearray:
    """The data descriptor after `member`'s data: 16 bytes, or 24 past zip64's limits."""
    head = take(16)
    short, long = DESCRIPTOR32, DESCRIPTOR64
    if head[:4] == DESCRIPTOR and short.unpack(head)[2:] == (member.size, member.size):
        return bytearray(head)
    whole = head + take(8)
    if whole[:4] == DESCRIPTOR and long.unpack(whole)[2:] == (member.size, member.size):
        return bytearray(whole)
    raise Unexpected(f"the data descriptor of {member.name}")
