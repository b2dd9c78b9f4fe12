"""Local disk: the `LocalBackend` itself (containment, durable writes, the page-cache policy
of storage.read_cache). How its files' bytes are written and cold files read is in
local_writes.py and local_reads.py; the raw kernel calls (O_DIRECT, posix_fadvise,
sync_file_range, cachestat, mincore, /proc) in kernel.py.

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
import copy
import dataclasses
import errno
import functools
import os
import shutil
import stat
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import IO, Any, ClassVar, Literal, cast

from statereg.backends.base import EXCLUSIVE_WRITE, StorageBackend, StoredFile
from statereg.backends.capabilities import StoreCapabilities
from statereg.backends.checksum import HashingWriter, WrittenFile
from statereg.backends.kernel import (
    advise_sequential,
    available_memory,
    cached_share,
    in_memory,
    set_direct,
)
from statereg.backends.local_reads import DirectReads, mostly_whole_chunks
from statereg.backends.local_writes import DirectFile, WritebackFile
from statereg.errors import CorruptCheckpointError, StorageError

# Large buffers keep the number of write syscalls low for multi-GB tensor files.
_BUFFER = 8 * 1024 * 1024
# Filesystems without hard links answer link() with one of these; then O_EXCL is used.
_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK,
             errno.ENOSYS}
# Reads open each component below the root without following a link, and the file itself
# without blocking (a FIFO with no writer would otherwise wait forever in open).
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_WRITE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
# `storage.read_cache` (benchmarks/results/journal.md, "The page cache"): whether what a load
# reads and a save writes stays in the page cache. auto keeps it when it fits in this share of the
# memory the kernel reports available.
ReadCache = Literal["auto", "keep", "bypass"]
READ_CACHE_MODES: tuple[ReadCache, ...] = ("auto", "keep", "bypass")
_FITS_SHARE = 0.5
# A file with this share of its runs in the page cache is read from it, as a warm file: the
# kernel's proactive reclaim (DAMON here) drops a few idle pages of a file read moments ago
# (10 of 58,304 within 2 s), and a miss costs one small read, where treating the file as cold
# read it with O_DIRECT or started a read-ahead over all of it (a warm 1.4 GB load took 0.50 s,
# not 0.36).
_MOSTLY_CACHED = 0.98


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


def keeps_pages(policy: ReadCache, nbytes: int, available: int | None) -> bool:
    """Whether `nbytes` of checkpoint read or written under `policy` should stay in the page
    cache: always for keep, never for bypass; for auto, when they take less than half of
    `available` (memory the kernel can hand out), or when that is unknown (no /proc/meminfo:
    not Linux, where O_DIRECT is not offered either)."""
    if policy == "keep":
        return True
    if policy == "bypass":
        return False
    return available is None or nbytes < _FITS_SHARE * available


def temporary_name(path: str) -> str:
    """A sibling name no other writer uses: `<path>.tmp-<pid>-<random>`."""
    return f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class LocalBackend(StorageBackend):
    """Checkpoints in a local directory (a plain path or a file:// URL)."""

    schemes: ClassVar[tuple[str, ...]] = ("", "file", "local")
    atomic_create = True  # link(2) fails if the name exists, on every POSIX filesystem
    probe_exclusive = False
    denied_hint = "This user may not write there: check the folder's owner and permissions"
    denied_read_hint = ("This user may not read there: check its owner and permissions (on a "
                        "shared root, another user's entry)")
    # A local folder has no credentials: what failed is the filesystem.
    failure_hint = "The filesystem reported it: check the disk and its mount"
    kind = StoreCapabilities("local-disk", "disk", page_cache=True)
    # storage.read_cache (`open_backend` sets it): whether the page cache keeps what loads
    # read and saves write (`keeps_pages`).
    read_cache: ReadCache = "auto"
    # Whether the pages of the load reading through this backend stay cached, decided for
    # all its bytes at once (`for_reading`); None: for each file's own size.
    _load_keeps: bool | None = None
    # Whether files opened for writing go around the page cache (`for_writing`).
    _write_around = False

    @classmethod
    def capabilities_at(cls, url: str) -> StoreCapabilities:
        """A local disk; a path on a tmpfs (or ramfs) is memory, with no cache to go around."""
        path = url[len("file://"):] if url.startswith("file://") else url
        if in_memory(os.path.abspath(os.path.expanduser(path))):
            return dataclasses.replace(cls.kind, latency="memory", page_cache=False)
        return cls.kind

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

    # -- the page cache -----------------------------------------------------------------

    def _keeps(self, nbytes: int) -> bool:
        """Whether `nbytes` of this root read or written stay in the page cache
        (`keeps_pages` under `read_cache`); always in memory (tmpfs: the cache is the store)."""
        if in_memory(self.root):
            return True
        available = None if self.read_cache != "auto" else available_memory()
        return keeps_pages(self.read_cache, nbytes, available)

    def for_reading(self, nbytes: int) -> LocalBackend:
        """This backend for one load that reads `nbytes` in all: under `read_cache: auto` its
        files are read through the page cache when that total fits (`keeps_pages`), so a load
        of a large checkpoint reads it all with O_DIRECT even file by file. Decided once per
        load: MemAvailable costs ~1 ms a read of /proc/meminfo here."""
        reading = copy.copy(self)
        reading._load_keeps = self._keeps(nbytes)
        return reading

    # -- writing ------------------------------------------------------------------------

    def for_writing(self, around_cache: bool) -> LocalBackend:
        """This backend for one writer: with `around_cache` (the I/O policy's, for compressed
        data) its files go to disk with O_DIRECT (`DirectFile`), except on a root in memory,
        where the cache is the store."""
        if not around_cache or in_memory(self.root):
            return self
        writing = copy.copy(self)
        writing._write_around = True
        return writing

    def open_write(self, path: str, on_done: Callable[[WrittenFile], None] | None = None,
                   ) -> HashingWriter:
        full = self.full_path(path)
        self._refuse_links("create", path)
        with self._storage_op("create", path):
            _makedirs_durable(os.path.dirname(full))
            fd = self._open_for_write(path, full)
            mapped = self._mapped_writer(path, fd, on_done)
            if mapped is not None:
                return mapped
            if self._write_around and set_direct(fd, True):
                return self._direct_writer(path, full, fd, on_done)
            sink = WritebackFile(
                open(fd, "wb", buffering=_BUFFER),  # noqa: SIM115 - closed by the writer
                self._keeps, functools.partial(self._storage_op, "write", path))

        def durable(stream: WritebackFile) -> None:
            with self._storage_op("write", path):
                try:
                    stream.flush()
                    fd = stream.fileno()
                    end = os.lseek(fd, 0, os.SEEK_CUR)
                    if os.fstat(fd).st_size > end:  # written over a longer file (shm.py)
                        os.ftruncate(fd, end)
                    os.fsync(fd)
                    stream.drop_pages()
                except BaseException:
                    # A failed write (a full disk or tmpfs) must not keep its descriptor:
                    # an open file keeps its pages after it is deleted.
                    with contextlib.suppress(OSError):
                        stream.close()
                    raise
                stream.close()
                _fsync_dir(os.path.dirname(full))

        return HashingWriter(path, sink, durable, on_done)

    def _direct_writer(self, path: str, full: str, fd: int,
                       on_done: Callable[[WrittenFile], None] | None) -> HashingWriter:
        """A writer of `fd` (O_DIRECT on) through `DirectFile`."""
        sink = DirectFile(fd, functools.partial(self._storage_op, "write", path))

        def durable(stream: DirectFile) -> None:
            with self._storage_op("write", path):
                try:
                    sink.finish()
                    os.fsync(fd)
                except BaseException:
                    with contextlib.suppress(OSError):
                        sink.close()  # an open file keeps its blocks after it is deleted
                    raise
                sink.close()
                _fsync_dir(os.path.dirname(full))

        return HashingWriter(path, sink, durable, on_done)

    def _open_for_write(self, path: str, full: str) -> int:
        """A descriptor to write `path` (at `full`) from its start: a new or emptied file.
        O_NOFOLLOW: a link left at this name is never written through."""
        return os.open(full, _WRITE, 0o644)

    def _mapped_writer(self, path: str, fd: int,
                       on_done: Callable[[WrittenFile], None] | None) -> HashingWriter | None:
        """A writer that copies into a mapping of the file open at `fd` (shm.py, for files
        written over), or None to write through the descriptor."""
        return None

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
        """The runs of a data file, through the page cache or around it (`read_cache`).

        Where the policy keeps the checkpoint's pages (`_keeps` of the load's bytes, or of
        the file's without `for_reading`), the file is read buffered straight into the
        tensors, as `open_read` does, and stays cached: a later load of it is a memory copy.
        Otherwise a cold file is read with O_DIRECT: large aligned chunks, several in flight
        (`DirectReads`), keep the disk's queue full and leave no copy in the cache. Read
        buffered in every case: a root in memory (tmpfs, ramfs: shm://), where the page cache
        is the storage; a file where O_DIRECT is refused (some network filesystems); runs
        scattered thinly over the file (`mostly_whole_chunks`); a file whose runs are in the
        page cache already, or nearly (`cached_share`: O_DIRECT would read the disk again). A
        subclass that routes reads elsewhere (its own `open_read`) keeps its route.
        """
        if (type(self).open_read is not LocalBackend.open_read or not ranges
                or in_memory(self.root) or not mostly_whole_chunks(ranges, size)):
            with self.open_read(path, size) as stream:
                yield stream
            return
        wanted = sum(end - start for start, end in ranges)
        keep = self._load_keeps if self._load_keeps is not None else self._keeps(wanted)
        fd = self._open_contained("open", path)
        cached = cached_share(fd, sorted(ranges)) >= _MOSTLY_CACHED
        if keep or cached or not set_direct(fd, True):
            if keep and not cached:
                # A cold file read front to back (the readers never seek back: torchsave.py):
                # the kernel's readahead keeps the disk busy, with twice its window. A thread
                # asking for the runs ahead (WILLNEED) read this disk at half the rate
                # (benchmarks/results/journal.md, "Cold loads read front to back").
                advise_sequential(fd)
            with self._storage_op("open", path):
                plain = open(fd, "rb")  # noqa: SIM115 - closed below
            with plain:
                yield plain
            return
        with DirectReads(self, path, fd, ranges) as direct:
            yield cast(IO[bytes], direct)  # file-like: read, readinto, seek, tell

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
