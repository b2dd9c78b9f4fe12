"""Writing over a recycled shared-memory file through a mapping this process keeps.

The memory tier writes each save over the files of a checkpoint retention retired
(`SharedMemoryBackend.recycle`), so their tmpfs pages exist. `write()` still costs the kernel
a page lookup and lock per 4 KiB (1.5-1.7x a memory copy here), and mapping a file afresh for
each save costs as much in page-table set-up (`MAP_POPULATE`: 1.5x). A mapping kept from one
save to the next has its page tables already: copying into it runs at the speed of a memory
copy (benchmarks/results/journal.md, "Memory saves into kept mappings, without CRC-32s").

A file's inode comes back to the same writer every keep_last + 1 saves, so the mappings are
kept by inode, one per file this process writes. A mapping holds its file's pages even after
the file is deleted, so one is dropped as soon as its file is found deleted (checked each
time a writer takes one, and after retention), when its file's size changed, and when the
tier closes (`Mappings.release`).

Nothing truncates a file while it is written through its mapping (which would be SIGBUS):
the file was just renamed into a folder that only this job's save writes (the memory root is
this user's, one live job per folder: tiers/lock.py), the mapping covers the file's size when
taken, and bytes past it are written with `pwrite`.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

# Files smaller than this are written through their descriptor: a mapping saves nothing.
MAP_AT_LEAST = 1024 * 1024
# Pieces smaller than this are copied holding the GIL (a slice assignment); larger ones by
# numpy, which releases it, so the writer threads of a save copy at the same time.
_COPY_WITHOUT_GIL = 64 * 1024
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class Mapping:
    """One file's shared mapping, with a descriptor of its own (kept to see the file's size
    and whether it still exists)."""

    def __init__(self, fd: int, key: tuple[int, int], size: int) -> None:
        self.key = key
        self.size = size
        self.fd = os.dup(fd)
        try:
            self.map = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED | _POPULATE)
        except BaseException:
            os.close(self.fd)
            raise
        self.array = np.frombuffer(self.map, dtype=np.uint8)
        self.in_use = False

    def close(self) -> None:
        del self.array  # the array's export of the mapping must go before the mapping
        with contextlib.suppress(BufferError):  # a view still alive: unmapped when it goes
            self.map.close()
        os.close(self.fd)

    def deleted(self) -> bool:
        return os.fstat(self.fd).st_nlink == 0


class Mappings:
    """This process's mappings of the shared-memory files it writes over, by inode."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_inode: dict[tuple[int, int], Mapping] = {}

    def __len__(self) -> int:
        return len(self._by_inode)

    def take(self, fd: int) -> Mapping | None:
        """The mapping of the file open at `fd` (made now if there is none, or if the file's
        size changed), marked in use until `put_back`; None for a small file."""
        info = os.fstat(fd)
        key = (info.st_dev, info.st_ino)
        with self._lock:
            self._drop_deleted()
            found = self._by_inode.get(key)
            if found is not None and found.size == info.st_size and not found.in_use:
                found.in_use = True
                return found
            if found is not None and not found.in_use:
                self._by_inode.pop(key).close()
            if found is not None or info.st_size < MAP_AT_LEAST:
                return None
            made = Mapping(fd, key, info.st_size)
            made.in_use = True
            self._by_inode[key] = made
            return made

    def put_back(self, mapping: Mapping, size: int) -> None:
        """The writer is done: keep the mapping while the file keeps the size it had when
        mapped (`size` is the file's size now), else drop it."""
        with self._lock:
            mapping.in_use = False
            if size != mapping.size:
                if self._by_inode.get(mapping.key) is mapping:
                    del self._by_inode[mapping.key]
                mapping.close()

    def drop_deleted(self) -> None:
        """Drop the mappings of deleted files (their pages are freed with the mapping)."""
        with self._lock:
            self._drop_deleted()

    def _drop_deleted(self) -> None:
        for key, mapping in list(self._by_inode.items()):
            if not mapping.in_use and mapping.deleted():
                del self._by_inode[key]
                mapping.close()

    def release(self) -> None:
        """Drop every mapping not being written through (the tier is closing)."""
        with self._lock:
            for key, mapping in list(self._by_inode.items()):
                if not mapping.in_use:
                    del self._by_inode[key]
                    mapping.close()


class MappedFile:
    """The sink of a `HashingWriter` that copies into a kept mapping of the file open at
    `fd` (bytes past the mapping's end go through `pwrite`); `finish` cuts the file to what
    was written and gives the mapping back."""

    def __init__(self, fd: int, mapping: Mapping, mappings: Mappings,
                 guard: Callable[[], contextlib.AbstractContextManager[None]]) -> None:
        self._fd = fd
        self._mapping = mapping
        self._mappings = mappings
        self._guard = guard  # reports a failed write as the backend's StorageError
        self._position = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        count = len(view)
        start, mapped = self._position, self._mapping.size
        inside = min(count, max(0, mapped - start))
        if inside >= _COPY_WITHOUT_GIL:
            np.copyto(self._mapping.array[start:start + inside],
                      np.frombuffer(view[:inside], dtype=np.uint8))
        elif inside:
            self._mapping.map[start:start + inside] = view[:inside]
        if inside < count:
            with self._guard():
                rest, at = view[inside:], start + inside
                while rest:
                    written = os.pwrite(self._fd, rest, at)
                    rest, at = rest[written:], at + written
        self._position += count
        return count

    def finish(self, _: Any = None) -> None:
        """Cut the file to the bytes written (an older, longer content), close it, and give
        the mapping back."""
        size = -1
        try:
            with self._guard():
                if os.fstat(self._fd).st_size > self._position:
                    os.ftruncate(self._fd, self._position)
                size = os.fstat(self._fd).st_size
        finally:
            self._release(size)

    def close(self) -> None:
        """Close without finishing (a failed save): the mapping is dropped with the file's
        unfinished bytes."""
        self._release(-1)

    def _release(self, size: int) -> None:
        if self._fd < 0:
            return
        os.close(self._fd)
        self._fd = -1
        self._mappings.put_back(self._mapping, size)

    def flush(self) -> None:
        """Nothing is buffered."""
