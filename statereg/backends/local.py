"""Local disk: buffered file writes (compressed data files with O_DIRECT, around the page
cache), fsync before a file counts as written.

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
import ctypes
import dataclasses
import errno
import fcntl
import functools
import mmap
import os
import queue
import shutil
import stat
import sys
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import IO, Any, ClassVar, Literal, cast

import numpy as np

from statereg.backends.base import (
    EXCLUSIVE_WRITE,
    PositionedReads,
    StorageBackend,
    StoredFile,
)
from statereg.backends.capabilities import StoreCapabilities
from statereg.backends.checksum import HashingWriter, WrittenFile
from statereg.errors import CorruptCheckpointError, StorageError

# Large buffers keep the number of write syscalls low for multi-GB tensor files.
_BUFFER = 8 * 1024 * 1024
# Every this many bytes, the kernel is asked to start writing a file out (see _WritebackFile).
_WRITEBACK_EVERY = 64 * 1024 * 1024
# Writes at least this long go to the file directly, past its buffer.
_UNBUFFERED = 256 * 1024
# Filesystems without hard links answer link() with one of these; then O_EXCL is used.
_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK,
             errno.ENOSYS}
# Reads open each component below the root without following a link, and the file itself
# without blocking (a FIFO with no writer would otherwise wait forever in open).
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_WRITE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
# Data files are read with O_DIRECT in chunks of this size, this many chunks in flight
# (benchmarks/results/journal.md, "Cold load"). O_DIRECT needs offsets and lengths in whole blocks.
_DIRECT_CHUNK = 4 * 1024 * 1024
_DIRECT_AHEAD = 8
_DIRECT_ALIGN = 4096
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
# A file written around the page cache (`for_writing(around_cache=True)`: compressed data)
# goes to disk with O_DIRECT from page-aligned buffers of this size, this many written at once
# per file (`_DirectFile`); up to `_KEPT_ALIGNED` buffers are kept for the next files.
_DIRECT_WRITE_CHUNK = 4 * 1024 * 1024
_DIRECT_WRITES_AHEAD = 2
_KEPT_ALIGNED = 12
# Pieces at least this long are copied into those buffers by numpy, without the GIL.
_COPY_WITHOUT_GIL = 64 * 1024
_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start writeback of dirty pages, do not wait


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


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (memory the kernel can hand out without
    swapping, reclaimable page cache included); None where it cannot be read."""
    try:
        with open("/proc/meminfo", "rb") as info:
            for line in info:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


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


@functools.cache
def _sync_file_range() -> Any:
    """libc's sync_file_range (start writeback of a range, keep its pages), or None."""
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    function.restype = ctypes.c_int
    return function


def _start_writeback(fd: int, offset: int, length: int, keep: bool) -> bool:
    """Ask the kernel to start writing [offset, offset+length) of `fd` to disk now, without
    waiting: with `keep`, the pages stay cached (sync_file_range); without, the cache may drop
    them once written (posix_fadvise(DONTNEED), which drops the clean ones at once). False
    where the kernel or filesystem cannot."""
    if keep:
        function = _sync_file_range()
        return function is not None and function(fd, offset, length,
                                                 _SYNC_FILE_RANGE_WRITE) == 0
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    except OSError:
        return False
    return True


class _WritebackFile:
    """A file whose written bytes start going to disk every 64 MiB, not at fsync.

    The page cache would otherwise hold a whole checkpoint file dirty until fsync, which then
    waits for the disk to write all of it: a save took copy time plus disk time. Started
    early, the disk works while the rest is still being copied, and the fsync finds little
    left to do. `keep(nbytes)` says whether the pages of a file of that size stay in the page
    cache (storage.read_cache): then writeback is started with sync_file_range, else with
    posix_fadvise(DONTNEED), which also lets the cache drop them (`drop_pages` after the
    fsync drops the rest). Pieces of `_UNBUFFERED` bytes or more skip the file's buffer (a
    tensor's bytes arrive in 1 MiB slices: records.py), and every failed write is the
    backend's StorageError (`guard`), as a failed fsync is.
    """

    def __init__(self, file: IO[bytes], keep: Callable[[int], bool],
                 guard: Callable[[], contextlib.AbstractContextManager[None]]) -> None:
        self._file = file
        self._keep = keep
        self._guard = guard  # reports a failed write as the backend's StorageError
        self._written = self._started = 0
        self._advise = hasattr(os, "posix_fadvise")

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        with self._guard():
            if len(view) >= _UNBUFFERED:
                # The buffered file would copy a piece shorter than its buffer into it
                # first: one more pass over every byte of a tensor handed on in slices.
                self._file.flush()
                raw, count = self._file.raw, 0  # type: ignore[attr-defined]
                while count < len(view):
                    count += raw.write(view[count:])
            else:
                count = self._file.write(view)
            self._written += count
            if self._advise and self._written - self._started >= _WRITEBACK_EVERY:
                self._file.flush()
                # A filesystem without either: the final fsync does all the work.
                self._advise = _start_writeback(self._file.fileno(), self._started,
                                                self._written - self._started,
                                                self._keep(self._written))
                self._started = self._written
        return count

    def drop_pages(self) -> None:
        """After the fsync: let the cache drop the file's pages (all clean now) unless the
        policy keeps a file of this size."""
        if hasattr(os, "posix_fadvise") and not self._keep(self._written):
            with contextlib.suppress(OSError):
                os.posix_fadvise(self._file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)

    def flush(self) -> None:
        self._file.flush()

    def fileno(self) -> int:
        return self._file.fileno()

    def close(self) -> None:
        self._file.close()


class _AlignedBuffers:
    """Page-aligned buffers for O_DIRECT writes, kept from one file to the next: a fresh
    buffer costs a page fault for each of its 4 KiB on first use."""

    def __init__(self) -> None:
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self) -> mmap.mmap:
        with self._lock:
            if self._free:
                return self._free.pop()
        return mmap.mmap(-1, _DIRECT_WRITE_CHUNK)

    def give(self, buffer: mmap.mmap) -> None:
        with self._lock:
            if len(self._free) < _KEPT_ALIGNED:
                self._free.append(buffer)
                return
        with contextlib.suppress(BufferError):  # still viewed: freed with the last view
            buffer.close()


_ALIGNED = _AlignedBuffers()


class _DirectFile:
    """The sink of a file written around the page cache (`for_writing(around_cache=True)`).

    Bytes are gathered into page-aligned buffers, and a thread of the file's own writes each
    full one with O_DIRECT, `_DIRECT_WRITES_AHEAD` at once, so the disk works while the
    caller makes the next bytes. The kernel neither copies them into its cache nor keeps
    them there: for a compressed save, whose two cores are busy encoding, that copy was a
    fifth of its time (benchmarks/results/journal.md, "Compressed saves around the page cache").
    `finish` writes the last piece padded to a whole page and cuts the file back to its
    length. A write the filesystem refuses with O_DIRECT (EINVAL) is done buffered, and so is
    the rest of the file; any other failure is raised by the next `write` or by `finish`, as
    the backend's StorageError (`guard`).
    """

    def __init__(self, fd: int, guard: Callable[[], contextlib.AbstractContextManager[None]],
                 ) -> None:
        self._fd = fd
        self._guard = guard
        self._direct = True
        self._offset = 0  # where the buffer being filled starts in the file
        self._filled = 0
        self._buffer: mmap.mmap | None = _ALIGNED.take()
        self._array: np.ndarray | None = np.frombuffer(self._buffer, dtype=np.uint8)
        self._pending: queue.SimpleQueue[tuple[mmap.mmap, int, int] | None] = queue.SimpleQueue()
        self._slots = threading.Semaphore(_DIRECT_WRITES_AHEAD)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._closed = False

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        count, at = len(view), 0
        while at < count:
            start = self._filled
            take = min(_DIRECT_WRITE_CHUNK - start, count - at)
            if take >= _COPY_WITHOUT_GIL:
                assert self._array is not None
                np.copyto(self._array[start:start + take],
                          np.frombuffer(view[at:at + take], dtype=np.uint8))
            else:
                self._buffer[start:start + take] = view[at:at + take]  # type: ignore[index]
            self._filled += take
            at += take
            if self._filled == _DIRECT_WRITE_CHUNK:
                self._submit(_DIRECT_WRITE_CHUNK)
        self._raise_failure()
        return count

    def _submit(self, length: int) -> None:
        """Hand the buffer being filled to the writing thread, and take a fresh one."""
        assert self._buffer is not None
        self._slots.acquire()  # at most _DIRECT_WRITES_AHEAD buffers wait for the disk
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="statereg-direct-write",
                                            daemon=True)
            self._thread.start()
        self._pending.put((self._buffer, self._offset, length))
        self._offset += length
        # The handed-on buffer is the writing thread's now: never given back from here too,
        # even if taking a fresh one fails.
        self._array = self._buffer = None
        self._buffer = _ALIGNED.take()
        self._array = np.frombuffer(self._buffer, dtype=np.uint8)
        self._filled = 0

    def _run(self) -> None:
        while (job := self._pending.get()) is not None:
            buffer, offset, length = job
            try:
                if self._error is None:
                    self._write_at(buffer, offset, length)
            except BaseException as exc:  # raised on the caller's thread (_raise_failure)
                self._error = exc
            finally:
                _ALIGNED.give(buffer)
                self._slots.release()

    def _write_at(self, buffer: mmap.mmap, offset: int, length: int) -> None:
        view = memoryview(buffer)
        try:
            done = 0
            while done < length:
                try:
                    done += os.pwrite(self._fd, view[done:length], offset + done)
                except OSError as exc:
                    if exc.errno != errno.EINVAL or not self._direct:
                        raise
                    self._direct = False  # refused after all: buffered from here on
                    _set_direct(self._fd, False)
        finally:
            view.release()

    def _raise_failure(self) -> None:
        if self._error is not None:
            with self._guard():
                raise self._error

    def _stop(self) -> None:
        """Wait until every buffer handed on is written (or failed)."""
        if self._thread is not None:
            self._pending.put(None)
            self._thread.join()
            self._thread = None

    def finish(self) -> None:
        """Write the rest (padded to a page, then the file is cut back to its length) and wait
        for every write; raises the first failure."""
        size = self._offset + self._filled
        if self._filled:
            padded = -(-self._filled // _DIRECT_ALIGN) * _DIRECT_ALIGN
            self._buffer[self._filled:padded] = bytes(padded - self._filled)  # type: ignore[index]
            self._submit(padded)
        self._stop()
        self._raise_failure()
        with self._guard():
            os.ftruncate(self._fd, size)

    def flush(self) -> None:
        """Nothing to do: `finish` writes the last piece, which O_DIRECT cannot write alone."""

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop()
        self._array = None
        if self._buffer is not None:
            _ALIGNED.give(self._buffer)
            self._buffer = None
        os.close(self._fd)


@functools.cache
def _in_memory(root: str) -> bool:
    """Whether `root` lies on a memory filesystem (tmpfs, ramfs), by /proc/mounts."""
    try:
        with open("/proc/mounts") as table:
            mounts = [line.split()[1:3] for line in table]
    except OSError:
        return False
    resolved = os.path.realpath(root)
    found, kind = "", ""
    for mount, fstype in mounts:
        inside = resolved == mount or resolved.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(found):
            found, kind = mount, fstype
    return kind in ("tmpfs", "ramfs")


def _set_direct(fd: int, on: bool) -> bool:
    """Turn O_DIRECT on or off for `fd`; False where the filesystem refuses it."""
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)
    except OSError:
        return False
    return True


@functools.cache
def _libc() -> Any:
    """libc with mmap, munmap, mincore and syscall typed for ctypes, or None where it has
    none."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_int64)
        libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
        libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
        libc.syscall.restype = ctypes.c_long
    except (OSError, AttributeError):
        return None
    return libc


class _CacheStatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


# cachestat(2), Linux 6.5: one call counts a range's pages in the page cache. The number is
# the same on every architecture (the generic syscall table).
_CACHESTAT = 451
_cachestat_works = sys.platform == "linux"


def _cached_pages(libc: Any, fd: int, first: int, pages: int) -> int | None:
    """How many of `pages` pages from page `first` are cached, by cachestat(2); None where
    the kernel has no cachestat (older than 6.5, or refused by a seccomp filter)."""
    global _cachestat_works
    if not _cachestat_works:
        return None
    span, stat = _CacheStatRange(first * mmap.PAGESIZE, pages * mmap.PAGESIZE), _CacheStat()
    # syscall(2) is variadic and reads every argument as a long: pass longs, not C ints.
    if libc.syscall(ctypes.c_long(_CACHESTAT), ctypes.c_long(fd), ctypes.byref(span),
                    ctypes.byref(stat), ctypes.c_long(0)) != 0:
        if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):
            _cachestat_works = False
        return None
    return stat.nr_cache


def _cached_share(fd: int, ranges: Sequence[tuple[int, int]]) -> float:
    """The share of the runs' pages in the page cache (a file written or read a moment ago is
    all there), 0.0 where the kernel cannot say. Asks cachestat(2), else mincore(2) of a
    mapping of the file (20x slower: 6 ms for 480 MB here); neither reads anything nor faults
    anything in (an RWF_NOWAIT read probe starts readahead of what it finds missing)."""
    libc = _libc()
    if not ranges or libc is None:
        return 0.0
    size = os.fstat(fd).st_size
    spans = []
    for start, end in ranges:
        first = start // mmap.PAGESIZE
        pages = -(-min(end, size) // mmap.PAGESIZE) - first
        if pages > 0:
            spans.append((first, pages))
    total = sum(pages for _, pages in spans)
    if not total:
        return 0.0
    counted = [_cached_pages(libc, fd, first, pages) for first, pages in spans]
    if None not in counted:
        whole = cast("list[int]", counted)  # every span answered
        return sum(min(c, pages) for c, (_, pages) in zip(whole, spans, strict=True)) / total
    address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        return 0.0
    cached = 0
    try:
        for first, pages in spans:
            vector = ctypes.create_string_buffer(pages)
            if libc.mincore(address + first * mmap.PAGESIZE, pages * mmap.PAGESIZE,
                            vector) != 0:
                return 0.0
            cached += pages - vector.raw.count(0)  # bit 0: resident; the others are 0
    finally:
        libc.munmap(address, size)
    return cached / total


def _mostly_whole_chunks(ranges: Sequence[tuple[int, int]], size: int | None) -> bool:
    """Whether the runs fill at least half of the aligned chunks they touch. O_DIRECT reads
    whole chunks: for runs scattered thinly over a large file (a few items of each rank's
    file in a load at another world size) it would read several times the bytes asked for
    (measured: 2.75x the checkpoint at 4 ranks), so those are read buffered, run by run."""
    touched: set[int] = set()
    for start, end in ranges:
        touched.update(range(start // _DIRECT_CHUNK, (end - 1) // _DIRECT_CHUNK + 1))
    total = sum(_DIRECT_CHUNK if size is None else min(_DIRECT_CHUNK, size - i * _DIRECT_CHUNK)
                for i in touched)
    return 2 * sum(end - start for start, end in ranges) >= total


class _DirectReads(PositionedReads):
    """Runs of a local file, read with O_DIRECT in page-aligned chunks, several ahead.

    Every chunk the runs touch is read, in order, into a page-aligned buffer by a small pool
    of threads (`_DIRECT_AHEAD` chunks in flight), and reads copy out of the chunk they fall
    in: one memory copy per byte, far cheaper than the disk time it overlaps. Any position can
    be read (a chunk outside the runs is read when asked for); a filesystem that accepted
    O_DIRECT but refuses a read with it is read buffered from then on.
    """

    def __init__(self, backend: LocalBackend, path: str, fd: int,
                 ranges: Sequence[tuple[int, int]]) -> None:
        super().__init__(backend, path)
        self._fd = fd
        self._direct = True
        order: list[int] = []
        for start, end in sorted(ranges):
            for index in range(start // _DIRECT_CHUNK, (end - 1) // _DIRECT_CHUNK + 1):
                if not order or index > order[-1]:
                    order.append(index)
        self._order = order
        self._place = {index: n for n, index in enumerate(order)}
        self._pending: dict[int, Future[tuple[mmap.mmap, int]]] = {}
        self._spare: list[mmap.mmap] = []
        self._pool = ThreadPoolExecutor(_DIRECT_AHEAD, thread_name_prefix="statereg-direct")
        self._pos = 0
        self._chunk: tuple[int, mmap.mmap, int] | None = None  # index, buffer, bytes in it

    def fileno(self) -> int:
        return self._fd

    def _file_size(self) -> int:
        return os.fstat(self._fd).st_size

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        done = 0
        while done < len(view):
            index, data, filled = self._chunk_at(self._pos // _DIRECT_CHUNK)
            at = self._pos - index * _DIRECT_CHUNK
            got = min(len(view) - done, filled - at)
            if got <= 0:
                break  # the file ends here
            view[done:done + got] = data[at:at + got]
            done += got
            self._pos += got
        return done

    def _chunk_at(self, index: int) -> tuple[int, mmap.mmap, int]:
        if self._chunk is not None and self._chunk[0] == index:
            return self._chunk
        if self._chunk is not None:
            self._spare.append(self._chunk[1])
            self._chunk = None
        pending = self._pending.pop(index, None)
        place = self._place.get(index)
        if place is not None:  # keep the next chunks of the runs in flight
            for ahead in self._order[place + 1:place + 1 + _DIRECT_AHEAD]:
                if ahead not in self._pending:
                    self._pending[ahead] = self._pool.submit(self._read_chunk, ahead,
                                                             self._buffer())
        with self._backend._storage_op("read", self._path):
            data, filled = (pending.result() if pending is not None
                            else self._read_chunk(index, self._buffer()))
        self._chunk = (index, data, filled)
        return self._chunk

    def _buffer(self) -> mmap.mmap:
        return self._spare.pop() if self._spare else mmap.mmap(-1, _DIRECT_CHUNK)

    def _read_chunk(self, index: int, data: mmap.mmap) -> tuple[mmap.mmap, int]:
        """Fill `data` from the chunk's offset: as much as the file holds there."""
        offset, filled = index * _DIRECT_CHUNK, 0
        view = memoryview(data)
        try:
            while filled < _DIRECT_CHUNK:
                try:
                    got = os.preadv(self._fd, [view[filled:]], offset + filled)
                except OSError as exc:
                    if exc.errno != errno.EINVAL or not self._direct:
                        raise
                    self._direct = False  # refused after all: read buffered from here on
                    _set_direct(self._fd, False)
                    continue
                if not got:
                    break
                filled += got
                if self._direct and filled % _DIRECT_ALIGN:
                    break  # a short O_DIRECT read ends at the end of the file
        finally:
            view.release()
        return data, filled

    def close(self) -> None:
        if self.closed:
            return
        for pending in self._pending.values():
            pending.cancel()
        self._pool.shutdown(wait=True)
        self._pending.clear()
        self._chunk = None
        self._spare.clear()  # their memory goes with the last reference
        os.close(self._fd)
        super().close()


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
        if _in_memory(os.path.abspath(os.path.expanduser(path))):
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
        if _in_memory(self.root):
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
        data) its files go to disk with O_DIRECT (`_DirectFile`), except on a root in memory,
        where the cache is the store."""
        if not around_cache or _in_memory(self.root):
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
            if self._write_around and _set_direct(fd, True):
                return self._direct_writer(path, full, fd, on_done)
            sink = _WritebackFile(
                open(fd, "wb", buffering=_BUFFER),  # noqa: SIM115 - closed by the writer
                self._keeps, functools.partial(self._storage_op, "write", path))

        def durable(stream: _WritebackFile) -> None:
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
        """A writer of `fd` (O_DIRECT on) through `_DirectFile`."""
        sink = _DirectFile(fd, functools.partial(self._storage_op, "write", path))

        def durable(stream: _DirectFile) -> None:
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
        (`_DirectReads`), keep the disk's queue full and leave no copy in the cache. Read
        buffered in every case: a root in memory (tmpfs, ramfs: shm://), where the page cache
        is the storage; a file where O_DIRECT is refused (some network filesystems); runs
        scattered thinly over the file (`_mostly_whole_chunks`); a file whose runs are in the
        page cache already, or nearly (`_cached_share`: O_DIRECT would read the disk again). A
        subclass that routes reads elsewhere (its own `open_read`) keeps its route.
        """
        if (type(self).open_read is not LocalBackend.open_read or not ranges
                or _in_memory(self.root) or not _mostly_whole_chunks(ranges, size)):
            with self.open_read(path, size) as stream:
                yield stream
            return
        wanted = sum(end - start for start, end in ranges)
        keep = self._load_keeps if self._load_keeps is not None else self._keeps(wanted)
        fd = self._open_contained("open", path)
        cached = _cached_share(fd, sorted(ranges)) >= _MOSTLY_CACHED
        if keep or cached or not _set_direct(fd, True):
            if keep and not cached:
                # A cold file read front to back (the readers never seek back: torchsave.py):
                # the kernel's readahead keeps the disk busy, with twice its window. A thread
                # asking for the runs ahead (WILLNEED) read this disk at half the rate
                # (benchmarks/results/journal.md, "Cold loads read front to back").
                with contextlib.suppress(OSError, AttributeError):  # AttributeError: macOS
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            with self._storage_op("open", path):
                plain = open(fd, "rb")  # noqa: SIM115 - closed below
            with plain:
                yield plain
            return
        with _DirectReads(self, path, fd, ranges) as direct:
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
