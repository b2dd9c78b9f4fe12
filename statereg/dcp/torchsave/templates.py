"""A record of a tensor of a layout seen before, from that layout's template.

A record of a tensor of a layout seen before (dtype, shape, strides, storage) is written from
that layout's template (`Template`): the first record's bytes around the payload, with the
payload's CRC-32 and the serialization id filled in. torch's pickler and the ~40 pieces per
record through `CrcRecords` cost 150-300 us a tensor, which is most of a save of many small
tensors; a template costs ~20 us. `templates_checked()` probes it once per process and, where
a template's record differs from `torch.save`'s, warns once and leaves every record to
`CrcRecords`.
"""

from __future__ import annotations

import io
import struct
from typing import Any, cast

import torch

from statereg.dcp import torch_private
from statereg.dcp.torchsave import crc_stream, layout
from statereg.dcp.torchsave.layout import (
    CENTRAL,
    CENTRAL_HEADER,
    DESCRIPTOR,
    END,
    ID_DIGITS,
    ID_RECORD,
    LOCAL_HEADER,
    STORAGE_PREFIX,
    Unexpected,
    crc32,
    hash_combine,
)
from statereg.process_state import BytesBounded, process_wide

# Tensors of at most this many bytes are written from a template of their layout: past it,
# torch's per-record work is nothing beside the bytes' own, and records stay below zip64's
# limits.
TEMPLATED_UP_TO = 64 << 20
# Templates kept per process, by their bytes (a small tensor's is ~1.5 KB, ~2.5 KB with
# Python's objects, counted here): a model of 20,000 distinct small shapes keeps all of them
# (~50 MB). A cap by count (4,096) had every save of such a model miss nearly every layout,
# and a miss serialized each tensor twice (benchmarks/results/journal.md, "Many small
# tensors").
_TEMPLATE_BYTES_KEPT = 64 << 20
_TEMPLATE_OVERHEAD = 1024


class Template:
    """torch.save's record of every tensor of one layout (dtype, shape, strides, storage
    offset and size), made from the record CrcRecords wrote for the first such tensor.

    Two such records differ only in the payload (the storage's bytes), its CRC-32 (in its
    data descriptor and its central directory entry), and the serialization id, whose second
    half folds that CRC-32 in, with the id record's own CRC-32: `write` sends the bytes before
    the payload as they are, the payload in slices (its CRC-32 computed on the way, as
    CrcRecords does), then the bytes after it with those five fields filled in. A template
    made without CRC-32s (`crcs` False) keeps them all zero, its id folding zeros as torch's
    writer then does. torch's pickler and ~40 pieces through Python per record are spared:
    ~20 us a record instead of 150-300 us. A record of another shape (zip64, the id before
    the payload, a second storage) raises Unexpected and its layout keeps the plain path.
    The first record of a layout is serialized by torch's writer into memory, made the
    template, and written through it like every later one (`write_templated`): a save of
    the same shapes pays torch's writer once per layout and process.
    """

    def __init__(self, record: bytes, payload: int, crcs: bool = True) -> None:
        entries = _entries(record)
        names = [name for name, *_ in entries]
        storages = [e for e in entries if e[0].startswith(STORAGE_PREFIX)]
        if len(storages) != 1 or storages[0][2] != payload or ID_RECORD not in names:
            raise Unexpected("one storage record and a serialization id")
        _, start, _, central = storages[0]
        _, id_start, id_size, id_central = entries[names.index(ID_RECORD)]
        if id_start < start + payload or id_size != ID_DIGITS:
            raise Unexpected("the serialization id after the storage")
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
        for name, data_start, size, _ in entries[:names.index(ID_RECORD)]:
            if not size:
                continue  # an empty record: no descriptor, nothing folded
            if name.startswith(STORAGE_PREFIX):
                self.folds.append(None)
                continue
            data = record[data_start:data_start + size]
            if size >= 8 and data[:4] == DESCRIPTOR:
                self.folds.append(struct.unpack_from("<I", data, 4)[0])
            self.folds.append(crc32(data) if crcs else 0)

    def write(self, tensor: torch.Tensor, out: Any, sliced: bool) -> None:
        out.write(self.prefix)
        if not self.payload:  # an empty storage: its record is the same for all
            out.write(self.suffix)
            out.flush()
            return
        payload = crc_stream.storage_bytes(tensor, self.payload)
        crc = crc_stream.write_payload(payload, out, sliced, self.crcs)
        combined = 0
        for value in self.folds:
            if value is not None:
                combined = hash_combine(combined, value)
                continue
            # The payload's: its bytes 4-8 if it starts like a descriptor, then its CRC-32.
            if self.payload >= 8 and bytes(payload[:4]) == DESCRIPTOR:
                combined = hash_combine(combined, struct.unpack_from("<I", payload, 4)[0])
            combined = hash_combine(combined, crc)
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


def _entries(record: bytes) -> list[tuple[str, int, int, int]]:
    """(name, data offset, size, central directory entry offset) of each record of one
    torch.save archive without zip64, in the order written; Unexpected otherwise."""
    end = struct.unpack_from("<4s4H2LH", record, len(record) - 22)
    if end[0] != END or end[7] or end[6] == 0xFFFFFFFF:
        raise Unexpected("an end of central directory without zip64")
    entries, at = [], end[6]
    for _ in range(end[4]):
        header = CENTRAL_HEADER.unpack_from(record, at)
        if header[0] != CENTRAL:
            raise Unexpected("a central directory entry")
        size, name_length, extra_length, comment_length, local = (
            header[10], header[12], header[13], header[14], header[-1])
        name = record[at + CENTRAL_HEADER.size:at + CENTRAL_HEADER.size + name_length]
        fields = LOCAL_HEADER.unpack_from(record, local)
        data = local + LOCAL_HEADER.size + fields[-2] + fields[-1]
        entries.append((name.decode(), data, size, at))
        at += CENTRAL_HEADER.size + name_length + extra_length + comment_length
    return sorted(entries, key=lambda e: e[1])


_templates = BytesBounded()  # layout key -> Template, or None: not as Template expects
process_wide(__name__, "_templates", "one record template per tensor layout, made from its "
             "first record")
_NOT_MADE = object()


def write_templated(tensor: torch.Tensor, nbytes: int, out: Any, sliced: bool,
                    crcs: bool) -> bool:
    """Write `tensor`'s record from its layout's template, made from torch's record of the
    layout's first tensor (torch's writer runs once per layout); False, writing nothing,
    for a layout already found not as Template expects."""
    key = (tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(),
           nbytes, tensor.requires_grad, torch_private.storage_alignment(), crcs)
    found = _templates.get(key, _NOT_MADE)
    if found is None:
        return False
    if found is not _NOT_MADE:
        cast("Template", found).write(tensor, out, sliced)
        return True
    made = _make_template(tensor, nbytes, crcs)
    # Layouts that come and go (one-off shapes) are forgotten past _TEMPLATE_BYTES_KEPT.
    _templates.keep(key, made, _TEMPLATE_OVERHEAD
                    + (len(made.prefix) + len(made.suffix) if made else 0), _TEMPLATE_BYTES_KEPT)
    if made is None:  # written again by torch's writer, in its own pieces
        crc_stream.save_crc_records(tensor, out, sliced, crcs)
    else:  # in the pieces a template writes: an encoder sees the payload as one write
        made.write(tensor, out, sliced)
    return True


def _make_template(tensor: torch.Tensor, nbytes: int, crcs: bool = True) -> Template | None:
    """The template of `tensor`'s layout, from torch's record of it; None for a record not
    as Template expects."""
    record = io.BytesIO()
    crc_stream.save_crc_records(tensor, record, sliced=False, crcs=crcs)
    try:
        return Template(record.getvalue(), nbytes, crcs)
    except (Unexpected, struct.error):
        return None


_templates_usable: bool | None = None
process_wide(__name__, "_templates_usable", "whether templates write torch.save's bytes, "
             "probed once")


def templates_checked() -> bool:
    """Whether a template made from one tensor writes torch.save's bytes for another of its
    layout: checked once per process on probes whose second tensor has other bytes (one
    starting like a data descriptor too), which a torch whose records hold anything else
    that depends on the data would fail (and, written without CRC-32s, one gives what torch's
    writer gives with its CRC-32 off). Then records are written by CrcRecords alone."""
    global _templates_usable
    if _templates_usable is None:  # two threads may both probe: the same answer
        _templates_usable = crc_stream.writer_checked() and _probe_templates()
    return _templates_usable


def _probe_templates() -> bool:
    pairs = [(torch.arange(300, dtype=torch.float32), torch.arange(300.0).flip(0)),
             (torch.ones(3, 5, dtype=torch.bfloat16), torch.full((3, 5), -2.0).bfloat16()),
             (torch.arange(16, dtype=torch.uint8),
              torch.tensor([*DESCRIPTOR, *range(12)], dtype=torch.uint8)),
             (torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))]
    try:
        for first, other in pairs:
            for crcs in (True, False):
                # Without CRC-32s: what torch's writer itself writes with its CRC-32 off.
                made = _make_template(first, first.untyped_storage().nbytes(), crcs=crcs)
                if made is None:
                    return _fallback(f"{first.dtype} {tuple(first.shape)} makes no template")
                expected, ours = io.BytesIO(), io.BytesIO()
                if crcs:
                    torch.save(other, expected)
                else:
                    crc_stream.save_without_crcs(other, expected)
                made.write(other, ours, sliced=True)
                if ours.getvalue() != expected.getvalue():
                    return _fallback(f"a templated record of {other.dtype} "
                                     f"{tuple(other.shape)} differs from torch's writer's")
    except (Unexpected, RuntimeError, TypeError, AttributeError, struct.error) as exc:
        return _fallback(f"writing a probe failed ({type(exc).__name__}: {exc})")
    return True


def _fallback(why: str) -> bool:
    layout.warn_fallback(why, "records are written without templates")
    return False


