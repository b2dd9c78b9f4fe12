"""Checksums of stored files: the hasher, its text form, and a stream that checksums as it writes.

Every file statereg writes passes through `HashingWriter`, so its size and checksum are known
when it is stored, without reading it back; `FileRecorder` collects the `WrittenFile`s of one
save for its manifest. Readers verify what they read against those records: `check_file`
for bytes already in memory, `verify_stream` for a whole file read in bounded blocks (and
`verified.VerifiedReads`, a backend whose whole-file reads are checked as they are read).
Imports nothing of statereg's storage: `base` builds on it, never the other way round.
"""

from __future__ import annotations

import contextlib
import io
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import xxhash

from statereg.errors import CorruptCheckpointError

# Files are verified in blocks of this size, so memory stays bounded whatever a file holds.
VERIFY_BLOCK = 8 << 20


@dataclass(frozen=True)
class WrittenFile:
    """What the writer observed while a file was written: its path, size and checksum."""

    path: str
    size: int
    checksum: str


def new_hasher() -> Any:
    """The checksum used for every file (xxh3_64: fast, from the maintained `xxhash` package)."""
    return xxhash.xxh3_64()


def checksum_of(hasher: Any) -> str:
    return f"xxh3_64:{hasher.hexdigest()}"


class Recorded(Protocol):
    """What the manifest recorded about one file (a schemas.manifest.FileRecord)."""

    size: int
    checksum: str


def missing(where: str, record: Recorded) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{where} is missing; the manifest lists it ({record.size} bytes). The checkpoint is "
        "damaged: load an earlier one"
    )


def check_size(where: str, record: Recorded, size: int) -> None:
    if size != record.size:
        raise CorruptCheckpointError(
            f"{where} has {size} bytes, the manifest recorded {record.size}; the file is "
            "truncated or damaged: load an earlier checkpoint"
        )


def check_hasher(where: str, record: Recorded, hasher: Any) -> None:
    if checksum_of(hasher) != record.checksum:
        raise CorruptCheckpointError(
            f"{where}: checksum {checksum_of(hasher)} differs from the manifest's "
            f"{record.checksum}; the file is damaged: load an earlier checkpoint"
        )


def check_file(where: str, record: Recorded, data: Any) -> None:
    """Raise CorruptCheckpointError unless `data` has the size and checksum recorded."""
    check_size(where, record, len(memoryview(data).cast("B")))
    hasher = new_hasher()
    hasher.update(data)
    check_hasher(where, record, hasher)


class SeekableReads(Protocol):
    """What verify_stream reads through: a file's read() and seek() (a plain binary file,
    or a backend's wrapper of one)."""

    def read(self, size: int = -1, /) -> bytes: ...

    def seek(self, offset: int, whence: int = io.SEEK_SET, /) -> int: ...


def verify_stream(where: str, record: Recorded, stream: SeekableReads,
                  sink: Callable[[Any], Any] | None = None) -> None:
    """Read `stream` to its end in bounded blocks, checking size and checksum; each block is
    also passed to `sink` (a copy's destination). Never reads more than one block past the
    recorded size, so a file replaced by an endless one (a device) still ends."""
    hasher = new_hasher()
    size = 0
    while size <= record.size:
        block = stream.read(min(VERIFY_BLOCK, record.size + 1 - size))
        if not block:
            break
        size += len(block)
        if size > record.size:  # longer than recorded: say by how much where the store can
            with contextlib.suppress(OSError, ValueError):
                size = stream.seek(0, io.SEEK_END)
            break
        hasher.update(block)
        if sink is not None:
            sink(block)
    check_size(where, record, size)
    check_hasher(where, record, hasher)


class FileRecorder:
    """Collects `WrittenFile`s from concurrent writer threads during one save."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._files: dict[str, WrittenFile] = {}

    def add(self, written: WrittenFile) -> None:
        with self._lock:
            self._files[written.path] = written

    def files(self) -> list[WrittenFile]:
        with self._lock:
            return sorted(self._files.values(), key=lambda f: f.path)


# Writes shorter than this are gathered (up to _GATHER_UP_TO bytes) before they pass on.
_SMALL_WRITE = 64 * 1024
_GATHER_UP_TO = 1024 * 1024


class ByteSink(Protocol):
    """Where a HashingWriter passes the bytes on: a binary file, or a backend's own writer."""

    def write(self, data: Any, /) -> object: ...

    def close(self) -> None: ...


SinkT = TypeVar("SinkT", bound=ByteSink)


class HashingWriter(io.RawIOBase, Generic[SinkT]):
    """A write-only stream that checksums bytes as they pass and reports the file on close.

    `finish` runs once on close: it makes the bytes durable (fsync, or the single PUT of an
    object store) before the file is reported, so a reported file is a stored file.
    """

    def __init__(self, path: str, sink: SinkT, finish: Callable[[SinkT], None],
                 on_done: Callable[[WrittenFile], None] | None) -> None:
        super().__init__()
        self.path = path
        self._sink = sink
        self._finish = finish
        self._on_done = on_done
        self._hasher = new_hasher()
        self._size = 0
        # torch.save writes ~40 pieces of a few bytes around each tensor; gathered, they cost
        # one hash update and one sink write instead of forty.
        self._small = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if len(view) < _SMALL_WRITE:
            self._small += view
            if len(self._small) >= _GATHER_UP_TO:
                self._pass_small()
        else:
            self._pass_small()
            self._pass(view)
        self._size += len(view)
        return len(view)

    def _pass(self, view: Any) -> None:
        self._sink.write(view)
        self._hasher.update(view)

    def _pass_small(self) -> None:
        if self._small:
            self._pass(self._small)
            self._small = bytearray()

    def tell(self) -> int:
        return self._size

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        self._pass_small()
        self._finish(self._sink)
        if self._on_done is not None:
            self._on_done(WrittenFile(self.path, self._size, checksum_of(self._hasher)))

    def abort(self) -> None:
        """Drop the file without reporting it (used when the writer raised)."""
        if not self.closed:
            self._on_done = None
            io.RawIOBase.close(self)
            # Closing flushes what is buffered, which fails again on a full disk; the
            # descriptor is closed all the same, and the writer's own error is the one to see.
            with contextlib.suppress(OSError):
                self._sink.close()
