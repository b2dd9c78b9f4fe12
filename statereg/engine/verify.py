"""Check a checkpoint's files against its manifest, without torch: `statereg verify` and
`inspect` need no tensor library, and a load verifies through the same function.

fast: every file exists with its recorded size (one listing of the checkpoint); full: also
every checksum, reading each file in bounded blocks.
"""

from __future__ import annotations

from typing import Literal

from statereg.backends.base import StorageBackend
from statereg.backends.checksum import check_size, missing, verify_stream
from statereg.schemas.manifest import FileRecord

VerifyMode = Literal["off", "fast", "full"]


def verify_files(backend: StorageBackend, name: str, files: list[FileRecord],
                 mode: VerifyMode) -> None:
    """fast: every file exists with its recorded size; full: also every checksum, reading
    each file in bounded blocks (never more than one block past its recorded size).

    Paths are relative to checkpoint `name`, or to the root when `name` is empty.
    """
    if mode == "off":
        return
    # One listing of the checkpoint gives every size: on an object store, one request per
    # thousand files instead of one HEAD per file.
    listed = {f.path: f.size for f in backend.walk(name)} if name and mode == "fast" else None
    for record in files:
        path = f"{name}/{record.path}" if name else record.path
        where = backend.display(path)
        if mode == "full":
            try:
                with backend.open_blocks(path) as stream:
                    verify_stream(where, record, stream)
            except FileNotFoundError:
                raise missing(where, record) from None
            continue
        if listed is not None:
            size = listed.get(path)
        else:
            try:
                size = backend.size(path)
            except FileNotFoundError:
                size = None
        if size is None:
            raise missing(where, record)
        check_size(where, record, size)


