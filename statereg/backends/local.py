"""Local disk: direct buffered file writes, fsync before a file counts as written.

A file counts as written once its bytes and its directory entry are durable: the file is
fsynced, then its directory (and the parent of every directory the write created), so a
power loss after the manifest cannot lose a file the manifest names.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any

from statereg.backends.base import EXCLUSIVE_WRITE, StorageBackend, StoredFile
from statereg.backends.checksum import HashingWriter, WrittenFile

# Large buffers keep the number of write syscalls low for multi-GB tensor files.
_BUFFER = 8 * 1024 * 1024
# Every this many bytes, the kernel is asked to start writing a file out (see _WritebackFile).
_WRITEBACK_EVERY = 64 * 1024 * 1024
# Filesystems without hard links answer link() with one of these; then O_EXCL is used.
_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK,
             errno.ENOSYS}


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _makedirs_durable(path: str) -> None:
    """os.makedirs, then fsync the parent of each directory it created (its entry)."""
    missing = []
    head = path
    while head and not os.path.isdir(head):
        missing.append(head)
        parent = os.path.dirname(head)
        if parent == head:
            break
        head = parent
    if not missing:
        return
    os.makedirs(path, exist_ok=True)
    for created in reversed(missing):
        _fsync_dir(os.path.dirname(created))


class _WritebackFile:
    """A file whose written bytes start going to disk every 64 MiB, not at fsync.

    The page cache would otherwise hold a whole checkpoint file dirty until fsync, which then
    waits for the disk to write all of it: a save took copy time plus disk time. Started
    early (`posix_fadvise(DONTNEED)` starts writeback without waiting for it), the disk works
    while the rest is still being copied, and the fsync finds little left to do.
    """

    def __init__(self, file: IO[bytes]) -> None:
        self._file = file
        self._written = self._started = 0
        self._advise = True

    def write(self, data: Any) -> int:
        count = self._file.write(data)
        self._written += count
        if self._advise and self._written - self._started >= _WRITEBACK_EVERY:
            self._file.flush()
            try:
                os.posix_fadvise(self._file.fileno(), self._started,
                                 self._written - self._started, os.POSIX_FADV_DONTNEED)
            except OSError:  # a filesystem without it: the final fsync does all the work
                self._advise = False
            self._started = self._written
        return count

    def flush(self) -> None:
        self._file.flush()

    def fileno(self) -> int:
        return self._file.fileno()

    def close(self) -> None:
        self._file.close()


def temporary_name(path: str) -> str:
    """A sibling name no other writer uses: `<path>.tmp-<pid>-<random>`."""
    return f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class LocalBackend(StorageBackend):
    """Checkpoints in a local directory (a plain path or a file:// URL)."""

    schemes = ("", "file", "local")
    atomic_create = True  # link(2) fails if the name exists, on every POSIX filesystem
    probe_exclusive = False

    def _open_filesystem(self, url: str, options: dict[str, Any]) -> tuple[Any, str]:
        path = url[len("file://"):] if url.startswith("file://") else url
        fs, _ = super()._open_filesystem("file:///", {})
        return fs, os.path.abspath(os.path.expanduser(path))

    def open_write(self, path: str, on_done: Callable[[WrittenFile], None] | None = None,
                   ) -> HashingWriter:
        full = self.full_path(path)
        with self._storage_op("create", path):
            _makedirs_durable(os.path.dirname(full))
            sink: Any = open(full, "wb", buffering=_BUFFER)  # noqa: SIM115 - closed by the writer
            if hasattr(os, "posix_fadvise"):
                sink = _WritebackFile(sink)

        def durable(stream: IO[bytes]) -> None:
            with self._storage_op("write", path):
                stream.flush()
                os.fsync(stream.fileno())
                stream.close()
                _fsync_dir(os.path.dirname(full))

        return HashingWriter(path, sink, durable, on_done)

    def write_bytes(self, path: str, data: bytes) -> WrittenFile:
        """Write to a temporary name, fsync, then rename: readers see all of it or none."""
        tmp = temporary_name(path)
        written = super().write_bytes(tmp, data)
        with self._storage_op("rename", path):
            os.replace(self.full_path(tmp), self.full_path(path))
            _fsync_dir(os.path.dirname(self.full_path(path)))
        return WrittenFile(path, written.size, written.checksum)

    def _store_if_absent(self, path: str, data: bytes) -> WrittenFile:
        """Write a durable temporary file, then link(2) it to `path`: the link fails if `path`
        exists, so of two racing writers exactly one wins, and readers never see a part."""
        tmp = temporary_name(path)
        written = super().write_bytes(tmp, data)
        full, tmp_full = self.full_path(path), self.full_path(tmp)
        try:
            with self._storage_op(EXCLUSIVE_WRITE, path):
                try:
                    os.link(tmp_full, full)
                except OSError as exc:
                    if exc.errno not in _NO_LINKS:
                        raise
                    self._create_without_links(full, data)
                _fsync_dir(os.path.dirname(full))
        finally:
            with self._storage_op("delete", tmp), contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_full)
        return WrittenFile(path, written.size, written.checksum)

    @staticmethod
    def _create_without_links(full: str, data: bytes) -> None:
        # O_EXCL is atomic too; a crash mid-write leaves a partial file, which a reader
        # rejects (it does not parse, or its checksum differs).
        fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)

    def makedirs(self, path: str) -> None:
        with self._storage_op("mkdir", path):
            _makedirs_durable(self.full_path(path))

    def read_bytes(self, path: str, limit: int | None = None) -> bytes:
        with self._storage_op("read", path), open(self.full_path(path), "rb") as f:
            return f.read() if limit is None else f.read(limit)

    @contextmanager
    def open_read(self, path: str, size: int | None = None) -> Iterator[IO[bytes]]:
        with self._storage_op("open", path):
            # Default buffering: DCP reads whole tensors with readinto, which a large buffer
            # would copy through (measured: half the warm-cache read rate with 8 MiB).
            stream = open(self.full_path(path), "rb")  # noqa: SIM115
        with stream:
            yield stream

    def list_dir(self, path: str = "") -> list[str]:
        full = self.full_path(path)
        with self._storage_op("list", path):
            try:
                return sorted(os.listdir(full))
            except (FileNotFoundError, NotADirectoryError):
                return []

    def walk(self, path: str = "") -> list[StoredFile]:
        """Every file under `path`; a directory with no files shows as itself, size 0."""
        full = self.full_path(path)
        found = []
        with self._storage_op("list", path):
            for dirpath, dirnames, filenames in os.walk(full):
                names = filenames or ([] if dirnames else [""])  # an empty directory
                for name in names:
                    entry = os.path.join(dirpath, name) if name else dirpath
                    try:
                        stat = os.stat(entry)
                    except FileNotFoundError:
                        continue
                    relative = os.path.relpath(entry, self.root).replace(os.sep, "/")
                    size = stat.st_size if name else 0
                    found.append(StoredFile(relative, size, stat.st_mtime))
            if not found and os.path.isfile(full):
                stat = os.stat(full)
                found.append(StoredFile(path, stat.st_size, stat.st_mtime))
        return sorted(found, key=lambda f: f.path)

    def remove_tree(self, path: str) -> None:
        full = self.full_path(path)
        with self._storage_op("delete", path):
            if os.path.isdir(full):
                shutil.rmtree(full)
            elif os.path.exists(full):
                os.remove(full)
