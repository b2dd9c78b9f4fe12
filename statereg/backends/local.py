"""Local disk: direct buffered file writes, fsync before a file counts as written.

A file counts as written once its bytes and its directory entry are durable: the file is
fsynced, then its directory (and the parent of every directory the write created), so a
power loss after the manifest cannot lose a file the manifest names.

What a root holds stays inside it: statereg never reads, writes or deletes through a symbolic
link below the root (the root itself may be one: the user chose it), and never reads anything
but a regular file, so a step directory linked elsewhere, a `.distcp` linked to /etc/passwd or
/dev/zero, or a FIFO in place of a file is refused at once, never followed or waited on.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import IO, Any

from statereg.backends.base import EXCLUSIVE_WRITE, StorageBackend, StoredFile
from statereg.backends.checksum import HashingWriter, WrittenFile
from statereg.errors import CorruptCheckpointError, StorageError

# Large buffers keep the number of write syscalls low for multi-GB tensor files.
_BUFFER = 8 * 1024 * 1024
# Every this many bytes, the kernel is asked to start writing a file out (see _WritebackFile).
_WRITEBACK_EVERY = 64 * 1024 * 1024
# Filesystems without hard links answer link() with one of these; then O_EXCL is used.
_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK,
             errno.ENOSYS}
# Reads open each component below the root without following a link, and the file itself
# without blocking (a FIFO with no writer would otherwise wait forever in open).
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_WRITE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC


def file_kind(mode: int) -> str:
    """What `stat` says an entry is: "file", "directory", "symlink", "fifo", "socket",
    "char-device", "block-device" (`StoredFile.kind`)."""
    for test, kind in ((stat.S_ISREG, "file"), (stat.S_ISDIR, "directory"),
                       (stat.S_ISLNK, "symlink"), (stat.S_ISFIFO, "fifo"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "char-device"),
                       (stat.S_ISBLK, "block-device")):
        if test(mode):
            return kind
    return "unknown"


_DESCRIBED = {"symlink": "a symbolic link", "fifo": "a named pipe (FIFO)", "socket": "a socket",
              "char-device": "a character device", "block-device": "a block device",
              "directory": "a directory", "unknown": "not a regular file"}


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

    # -- containment ------------------------------------------------------------------

    def _linked_component(self, path: str, include_last: bool) -> str | None:
        """The first component of `path` below the root that is a symbolic link, if any."""
        parts = path.split("/") if path else []
        current = self.root
        for depth, name in enumerate(parts if include_last else parts[:-1]):
            current = os.path.join(current, name)
            try:
                if stat.S_ISLNK(os.lstat(current).st_mode):
                    return "/".join(parts[:depth + 1])
            except (FileNotFoundError, NotADirectoryError):
                return None
        return None

    def _refuse_links(self, operation: str, path: str, include_last: bool = False) -> None:
        """StorageError if writing or deleting `path` would go through a symbolic link."""
        link = self._linked_component(path, include_last)
        if link is not None:
            raise StorageError(
                f"{operation} refused for {self.display(path)}: {self.display(link)} is a "
                "symbolic link, and statereg never writes or deletes through a link in a "
                "checkpoint root (it may point outside it). Remove the link, or replace it "
                "with what it points to"
            )

    def _not_plain(self, path: str, kind: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self.display(path)} is {_DESCRIBED[kind]}, not a regular file inside the "
            "checkpoint root; statereg never follows links out of a root or reads special "
            "files (a link may point at /etc/passwd or /dev/zero, a FIFO blocks forever). "
            "Replace it with the file itself, or delete this checkpoint"
        )

    def _open_contained(self, operation: str, path: str) -> int:
        """A descriptor of the regular file at `path`, opened one component at a time with
        O_NOFOLLOW (so no link below the root is followed, even one swapped in meanwhile)
        and O_NONBLOCK (so a FIFO cannot block); anything else is CorruptCheckpointError."""
        parts = path.split("/")
        with self._storage_op(operation, path):
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for depth, name in enumerate(parts):
                last = depth == len(parts) - 1
                try:
                    child = os.open(name, _READ if last else _DIRECTORY, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        self._refuse_entry("/".join(parts[:depth + 1]), name, fd)
                    with self._storage_op(operation, path):
                        raise
                os.close(fd)
                fd = child
            kind = file_kind(os.fstat(fd).st_mode)
            if kind != "file":
                raise self._not_plain(path, kind)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _refuse_entry(self, relative: str, name: str, dir_fd: int) -> None:
        """Raise CorruptCheckpointError if `name` in `dir_fd` is a link or a special file."""
        try:
            kind = file_kind(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
        except OSError:
            return
        if kind not in ("file", "directory"):
            raise self._not_plain(relative, kind)

    # -- writing ------------------------------------------------------------------------

    def open_write(self, path: str, on_done: Callable[[WrittenFile], None] | None = None,
                   ) -> HashingWriter:
        full = self.full_path(path)
        self._refuse_links("create", path)
        with self._storage_op("create", path):
            _makedirs_durable(os.path.dirname(full))
            # O_NOFOLLOW: a link left at this name is never written through.
            sink: Any = open(os.open(full, _WRITE, 0o644), "wb",  # noqa: SIM115 - closed by the writer
                             buffering=_BUFFER)
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
        self._refuse_links(EXCLUSIVE_WRITE, path)
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
        self._refuse_links("mkdir", path, include_last=True)
        with self._storage_op("mkdir", path):
            _makedirs_durable(self.full_path(path))

    # -- reading ------------------------------------------------------------------------

    def read_bytes(self, path: str, limit: int | None = None) -> bytes:
        fd = self._open_contained("read", path)
        with self._storage_op("read", path), open(fd, "rb") as f:
            return f.read() if limit is None else f.read(limit)

    def open_blocks(self, path: str) -> Any:
        """A file on disk streams as it is read: the contained open_read is already bounded."""
        return self.open_read(path)

    @contextmanager
    def open_read(self, path: str, size: int | None = None) -> Iterator[IO[bytes]]:
        fd = self._open_contained("open", path)
        with self._storage_op("open", path):
            # Default buffering: DCP reads whole tensors with readinto, which a large buffer
            # would copy through (measured: half the warm-cache read rate with 8 MiB).
            stream = open(fd, "rb")  # noqa: SIM115
        with stream:
            yield stream

    @contextmanager
    def open_ranges(self, path: str, ranges: Sequence[tuple[int, int]],
                    size: int | None = None) -> Iterator[IO[bytes]]:
        """The file itself: a read on disk moves only the bytes it asks for."""
        with self.open_read(path, size) as stream:
            yield stream

    def exists(self, path: str) -> bool:
        """Whether an entry is at `path` (a link counts as itself; a path through a link is
        refused, as for reads)."""
        self._refuse_read_through_link(path)
        with self._storage_op("check", path):
            return os.path.lexists(self.full_path(path))

    def size(self, path: str) -> int:
        self._refuse_read_through_link(path)
        with self._storage_op("stat", path):
            return os.lstat(self.full_path(path)).st_size

    def _refuse_read_through_link(self, path: str) -> None:
        link = self._linked_component(path, include_last=False)
        if link is not None:
            raise self._not_plain(link, "symlink")

    def list_dir(self, path: str = "") -> list[str]:
        """Names of the regular files and directories under `path`. Links and special files
        are left out (walk() reports them, with their kind); listing through a link is
        refused."""
        self._refuse_read_through_link(f"{path}/." if path else "")
        full = self.full_path(path)
        with self._storage_op("list", path):
            try:
                with os.scandir(full) as entries:
                    return sorted(e.name for e in entries
                                  if e.is_file(follow_symlinks=False)
                                  or e.is_dir(follow_symlinks=False))
            except (FileNotFoundError, NotADirectoryError):
                return []

    def walk(self, path: str = "") -> list[StoredFile]:
        """Every entry under `path`; a directory with no files shows as itself, size 0.

        Links are never followed: a link (to a file or a directory) and a special file (FIFO,
        device, socket) are reported as themselves, with their `kind`, so callers can refuse
        them; `path` itself being a link is reported the same way.
        """
        self._refuse_read_through_link(path)
        full = self.full_path(path)
        found = []
        with self._storage_op("list", path):
            try:  # the root itself may be a link: the user chose it
                top = os.lstat(full) if path else os.stat(full)
            except (FileNotFoundError, NotADirectoryError):
                return []
            if not stat.S_ISDIR(top.st_mode):
                kind = file_kind(top.st_mode)
                return [StoredFile(path, top.st_size, top.st_mtime, kind)]
            for dirpath, dirnames, filenames in os.walk(full):
                linked = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
                names = filenames + linked or ([] if dirnames else [""])  # an empty directory
                for name in names:
                    entry = os.path.join(dirpath, name) if name else dirpath
                    try:
                        info = os.lstat(entry)
                    except FileNotFoundError:
                        continue
                    relative = os.path.relpath(entry, self.root).replace(os.sep, "/")
                    kind = file_kind(info.st_mode)
                    size = info.st_size if kind == "file" else 0
                    found.append(StoredFile(relative, size, info.st_mtime, kind))
        return sorted(found, key=lambda f: f.path)

    # -- deleting -----------------------------------------------------------------------

    def remove_file(self, path: str) -> None:
        """Delete the entry at `path`; a link is deleted itself, never what it points to."""
        self._refuse_links("delete", path)
        with self._storage_op("delete", path):
            os.unlink(self.full_path(path))

    def remove_tree(self, path: str) -> None:
        """Delete everything under `path`. A link (at `path` or inside it) is deleted itself:
        nothing it points to is touched, and no linked directory is recursed into."""
        self._refuse_links("delete", path)
        full = self.full_path(path)
        with self._storage_op("delete", path):
            try:
                info = os.lstat(full) if path else os.stat(full)
            except FileNotFoundError:
                return
            if stat.S_ISDIR(info.st_mode):
                # rmtree never follows links: it unlinks them (fd-based on Linux).
                shutil.rmtree(full)
            else:
                os.unlink(full)
