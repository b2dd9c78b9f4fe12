"""Checksums of stored files: the hasher, its text form, and a stream that checksums as it writes.

Every file statereg writes passes through `HashingWriter`, so its size and checksum are known
when it is stored, without reading it back; `FileRecorder` collects the `WrittenFile`s of one
save for its manifest. Readers verify what they read against those records: `check_file`
for bytes already in memory, `verify_stream` for a whole file read in bounded blocks, and
`VerifiedReads`, a backend whose whole-file reads are checked as they are read.
"""

from __future__ import annotations

import contextlib
import io
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import xxhash

from statereg.errors import CorruptCheckpointError

if TYPE_CHECKING:
    from statereg.backends.base import StorageBackend
    from statereg.backends.capabilities import StoreCapabilities

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


class VerifiedReads:
    """A storage backend whose whole-file reads of recorded files are checked as they are read.

    `read_bytes` of a file the manifest records reads at most one byte more than its
    recorded size and raises CorruptCheckpointError (naming the file) on any difference,
    before the caller sees the bytes; the rest of `base.ReadableStore`, what readers call,
    is the backend's own. The engine hands this to the layouts at load time, so every reader
    of whole files (object state, sidecars, DCP metadata, torch and safetensors model files)
    is verified without knowing. DCP items are read in ranges through `for_reading`'s
    backend and checked against their own digests (dcp/reader.py).
    """

    def __init__(self, backend: StorageBackend, records: Mapping[str, Recorded]) -> None:
        self._backend = backend
        self.records = records

    @property
    def capabilities(self) -> StoreCapabilities:
        return self._backend.capabilities

    def display(self, path: str = "") -> str:
        return self._backend.display(path)

    def open_read(self, path: str, size: int | None = None,
                  ) -> contextlib.AbstractContextManager[IO[bytes]]:
        return self._backend.open_read(path, size)

    def for_reading(self, nbytes: int) -> StorageBackend:
        return self._backend.for_reading(nbytes)

    def exists(self, path: str) -> bool:
        return self._backend.exists(path)

    def list_dir(self, path: str = "") -> list[str]:
        return self._backend.list_dir(path)

    def read_bytes(self, path: str, limit: int | None = None) -> bytes:
        record = self.records.get(path)
        if record is None or limit is not None:
            return self._backend.read_bytes(path, limit)
        where = self._backend.display(path)
        try:
            data = self._backend.read_bytes(path, limit=record.size + 1)
        except FileNotFoundError:
            raise missing(where, record) from None
        check_file(where, record, data)
        return data


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
