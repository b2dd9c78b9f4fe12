"""Checksums of stored files: the hasher, its text form, and a stream that checksums as it writes.

Every file statereg writes passes through `HashingWriter`, so its size and checksum are known
when it is stored, without reading it back; `FileRecorder` collects the `WrittenFile`s of one
save for its manifest. Readers verify with `new_hasher` and `checksum_of`.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

import xxhash


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


class HashingWriter(io.RawIOBase):
    """A write-only stream that checksums bytes as they pass and reports the file on close.

    `finish` runs once on close: it makes the bytes durable (fsync, or the single PUT of an
    object store) before the file is reported, so a reported file is a stored file.
    """

    def __init__(self, path: str, sink: IO[bytes], finish: Callable[[IO[bytes]], None],
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
            self._sink.close()
