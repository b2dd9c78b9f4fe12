"""What statereg's record code knows of torch.save's zip, named once: signatures, header
layouts, record names, the serialization id's hash, the CRC-32 it computes with.

Every name here is an assumption about torch's writer (torch/serialization.py `_save` and
caffe2/serialize/inline_container.cc, miniz in streaming mode); docs/compatibility.md lists
each one with what breaks if torch changes it and which check notices.
"""

from __future__ import annotations

import struct
import warnings

import torch

from statereg import env
from statereg.errors import StateregError
from statereg.process_state import process_wide

try:
    from isal.isal_zlib import crc32
except ImportError:  # a platform without isal's wheels: the standard library's, ~5x slower
    from zlib import crc32

# zip signatures (PKWARE APPNOTE): local header, data descriptor, central directory entry,
# end of central directory.
LOCAL = b"PK\x03\x04"
DESCRIPTOR = b"PK\x07\x08"
CENTRAL = b"PK\x01\x02"
END = b"PK\x05\x06"
LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # zipfile.structFileHeader
CENTRAL_HEADER = struct.Struct("<4s4B4HL2L5H2L")  # zipfile.structCentralDir
# A data descriptor: signature, CRC-32, compressed and plain size (24 bytes past zip64's limits).
DESCRIPTOR32 = struct.Struct("<4sIII")
DESCRIPTOR64 = struct.Struct("<4sIQQ")

# torch.save into a stream names its archive "archive"; its records, in the order written:
# data.pkl, .format_version, .storage_alignment, byteorder, data/<key> per storage (keys
# "0", "1", ... in first-pickled order), then, from the writer's end of file, version and
# .data/serialization_id.
ID_RECORD = "archive/.data/serialization_id"
STORAGE_PREFIX = "archive/data/"
# The records torch.save writes between data.pkl and the storages (member names, no prefix).
SMALL_RECORDS = frozenset({".format_version", ".storage_alignment", "byteorder"})
# The serialization id: 20 decimal digits of a hash of the record names, then 20 of a hash
# (`hash_combine`) of every record's CRC-32.
ID_DIGITS = 40

# The typed storage class names torch.save pickles in a tensor's storage reference.
STORAGE_DTYPES = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32,
    "HalfStorage": torch.float16, "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64, "IntStorage": torch.int32, "ShortStorage": torch.int16,
    "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
}

# Payload bytes handed on per write: the CRC, the hashes and the write each read a slice
# while it is still in the CPU's cache.
SLICE = 1 << 20
_U64 = (1 << 64) - 1

__all__ = ["CENTRAL", "CENTRAL_HEADER", "DESCRIPTOR", "DESCRIPTOR32", "DESCRIPTOR64", "END",
           "ID_DIGITS", "ID_RECORD", "LOCAL", "LOCAL_HEADER", "SLICE", "SMALL_RECORDS",
           "STORAGE_DTYPES", "STORAGE_PREFIX", "Unexpected", "crc32", "hash_combine",
           "plain_torch_save", "warn_fallback"]


_plain: bool | None = None
process_wide(__name__, "_plain", "STATEREG_PLAIN_TORCH_SAVE, read at the first record")


def plain_torch_save() -> bool:
    """$STATEREG_PLAIN_TORCH_SAVE (`statereg.env.plain_torch_save`), read at this process's
    first record and kept, like the probes' answers: a lookup of a variable that is not set
    costs os.environ ~3 us (an exception inside), a tenth of a small tensor's record."""
    global _plain
    if _plain is None:
        _plain = env.plain_torch_save()
    return _plain


class Unexpected(StateregError):
    """torch's zip writer wrote a piece, or a record holds one, that this package does not
    expect (a torch whose writer changed after the probes passed: not seen; the save fails,
    nothing is committed)."""

    def __init__(self, expected: str) -> None:
        self.expected = expected
        super().__init__(
            f"torch {torch.__version__}'s zip writer did not write {expected} where statereg "
            "expected it; the save was not committed. Report this with your torch version, "
            "and set STATEREG_PLAIN_TORCH_SAVE=1 to write every record with torch.save")


def hash_combine(seed: int, value: int) -> int:
    """c10::hash_combine on 64 bits, which torch folds every record's CRC-32 into for the
    serialization id."""
    return seed ^ ((value + 0x9E3779B9 + ((seed << 6) & _U64) + (seed >> 2)) & _U64)


def warn_fallback(why: str, instead: str) -> None:
    """The one warning a failed probe gives: what differed, and what statereg does instead."""
    warnings.warn(f"statereg's torch.save record code does not match torch {torch.__version__}: "
                  f"{why}; {instead} (slower, the same result). Report this with your torch "
                  "version (docs/compatibility.md)", RuntimeWarning, stacklevel=3)
