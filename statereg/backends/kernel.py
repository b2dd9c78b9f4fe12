"""The kernel calls of local-disk I/O beyond open, read, write and fsync: every raw binding
(ctypes, fcntl, posix_fadvise, /proc) in one place, what each is for, and what statereg does
where it is missing. Nothing here decides when to use them: `local.py` (storage.read_cache,
the I/O policy's writes around the page cache) does.

- `set_direct`: O_DIRECT on a descriptor (fcntl F_SETFL). For compressed files written
  around the page cache (local_writes.DirectFile) and cold files read around it
  (local_reads.DirectReads). Missing (no os.O_DIRECT: macOS) or refused by the filesystem
  (tmpfs, some network filesystems): False, and the file is written or read buffered,
  through the cache; an O_DIRECT write or read refused later (EINVAL) turns it off again.
- `start_writeback(keep=True)`: sync_file_range(2) with SYNC_FILE_RANGE_WRITE, through
  libc. Every 64 MiB of a file written, its writeback starts now and the pages stay cached.
  Missing (not Linux): False, and the final fsync writes it all.
- `start_writeback(keep=False)` and `drop_pages`: posix_fadvise(DONTNEED). The same, and the
  cache may drop the pages once written (read_cache: bypass, or a file that does not fit).
  Missing: False or nothing, and the pages stay until the kernel reclaims them.
- `advise_sequential`: posix_fadvise(SEQUENTIAL). A cold file read front to back through
  the cache gets twice the readahead window. Missing: the kernel's default readahead.
- `cached_pages`: cachestat(2), syscall 451 (Linux 6.5), through libc's syscall(). How many
  pages of a range the page cache holds, reading nothing. Missing (an older kernel, or a
  seccomp filter: ENOSYS, EPERM): None, remembered for the process, and `cached_share`
  asks mincore instead.
- `cached_share`'s fallback: mmap(2), mincore(2), munmap(2) through libc. The same, 20x
  slower (6 ms for 480 MB). No libc, or a call fails: 0.0, the file is treated as cold.
- `filesystem_type`, `in_memory`: /proc/self/mountinfo. The filesystem a root lies on: a
  tmpfs or ramfs is memory, where the cache is the store (no O_DIRECT, pages always kept),
  and a memory tier elsewhere is warned about (shm.py). Unreadable: None, a disk.
- `available_memory`: /proc/meminfo's MemAvailable. read_cache: auto keeps the pages of
  what fits in half of it. Unreadable: None, and pages are kept.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import mmap
import os
import sys
from collections.abc import Sequence
from typing import Any, cast

from statereg.process_state import process_wide

# O_DIRECT needs offsets, lengths and buffers in whole blocks of this size.
DIRECT_ALIGN = 4096
_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start writeback of dirty pages, do not wait


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


process_wide(__name__, "_sync_file_range", "libc's sync_file_range bound through ctypes once")


def start_writeback(fd: int, offset: int, length: int, keep: bool) -> bool:
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


def drop_pages(fd: int) -> None:
    """Let the page cache drop the pages of `fd` (clean ones go at once): posix_fadvise
    (DONTNEED); nothing where there is none or it fails."""
    if hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def advise_sequential(fd: int) -> None:
    """Tell the kernel `fd` is read front to back (posix_fadvise(SEQUENTIAL): twice the
    readahead window); nothing where there is none (macOS) or it fails."""
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: macOS
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)


def filesystem_type(path: str) -> str | None:
    """The type of the filesystem mounted at `path` or above it (/proc/self/mountinfo)."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as mounts:
            lines = mounts.read().splitlines()
    except OSError:
        return None
    real = os.path.realpath(path)
    best, found = -1, None
    for line in lines:
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        point = fields[4].replace("\\040", " ")
        after = line.split(" - ", 1)[1].split()
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best and after:
            best, found = len(point), after[0]
    return found


@functools.cache
def in_memory(root: str) -> bool:
    """Whether `root` lies on a memory filesystem (tmpfs, ramfs), by `filesystem_type`."""
    return filesystem_type(root) in ("tmpfs", "ramfs")


process_wide(__name__, "in_memory", "whether a root is on tmpfs: /proc/mounts read once a root")


def set_direct(fd: int, on: bool) -> bool:
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
def load_libc() -> Any:
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


process_wide(__name__, "load_libc", "libc bound through ctypes once (mmap, mincore, syscall)")


class _CacheStatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


# cachestat(2), Linux 6.5: one call counts a range's pages in the page cache. The number is
# the same on every architecture (the generic syscall table).
_CACHESTAT = 451
_cachestat_works = sys.platform == "linux"
process_wide(__name__, "_cachestat_works", "whether the kernel has cachestat(2), learnt once")


def cached_pages(libc: Any, fd: int, first: int, pages: int) -> int | None:
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


def cached_share(fd: int, ranges: Sequence[tuple[int, int]]) -> float:
    """The share of the runs' pages in the page cache (a file written or read a moment ago is
    all there), 0.0 where the kernel cannot say. Asks cachestat(2), else mincore(2) of a
    mapping of the file (20x slower: 6 ms for 480 MB here); neither reads anything nor faults
    anything in (an RWF_NOWAIT read probe starts readahead of what it finds missing)."""
    libc = load_libc()
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
    counted = [cached_pages(libc, fd, first, pages) for first, pages in spans]
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
