"""How local disk reads a cold data file around the page cache: O_DIRECT in page-aligned
chunks, several in flight (`DirectReads`), for runs that fill most of the chunks they touch
(`mostly_whole_chunks`). `local.LocalBackend.open_ranges` decides when (storage.read_cache);
the kernel calls are kernel.py's.
"""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from statereg.backends.base import PositionedReads, StorageBackend
from statereg.backends.kernel import DIRECT_ALIGN, set_direct

# Data files are read with O_DIRECT in chunks of this size, this many chunks in flight
# (benchmarks/results/journal.md, "Cold load").
DIRECT_CHUNK = 4 * 1024 * 1024
_DIRECT_AHEAD = 8


def mostly_whole_chunks(ranges: Sequence[tuple[int, int]], size: int | None) -> bool:
    """Whether the runs fill at least half of the aligned chunks they touch. O_DIRECT reads
    whole chunks: for runs scattered thinly over a large file (a few items of each rank's
    file in a load at another world size) it would read several times the bytes asked for
    (measured: 2.75x the checkpoint at 4 ranks), so those are read buffered, run by run."""
    touched: set[int] = set()
    for start, end in ranges:
        touched.update(range(start // DIRECT_CHUNK, (end - 1) // DIRECT_CHUNK + 1))
    total = sum(DIRECT_CHUNK if size is None else min(DIRECT_CHUNK, size - i * DIRECT_CHUNK)
                for i in touched)
    return 2 * sum(end - start for start, end in ranges) >= total


class DirectReads(PositionedReads):
    """Runs of a local file, read with O_DIRECT in page-aligned chunks, several ahead.

    Every chunk the runs touch is read, in order, into a page-aligned buffer by a small pool
    of threads (`_DIRECT_AHEAD` chunks in flight), and reads copy out of the chunk they fall
    in: one memory copy per byte, far cheaper than the disk time it overlaps. Any position can
    be read (a chunk outside the runs is read when asked for); a filesystem that accepted
    O_DIRECT but refuses a read with it is read buffered from then on.
    """

    def __init__(self, backend: StorageBackend, path: str, fd: int,
                 ranges: Sequence[tuple[int, int]]) -> None:
        super().__init__(backend, path)
        self._fd = fd
        self._direct = True
        order: list[int] = []
        for start, end in sorted(ranges):
            for index in range(start // DIRECT_CHUNK, (end - 1) // DIRECT_CHUNK + 1):
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
            index, data, filled = self._chunk_at(self._pos // DIRECT_CHUNK)
            at = self._pos - index * DIRECT_CHUNK
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
        return self._spare.pop() if self._spare else mmap.mmap(-1, DIRECT_CHUNK)

    def _read_chunk(self, index: int, data: mmap.mmap) -> tuple[mmap.mmap, int]:
        """Fill `data` from the chunk's offset: as much as the file holds there."""
        offset, filled = index * DIRECT_CHUNK, 0
        view = memoryview(data)
        try:
            while filled < DIRECT_CHUNK:
                try:
                    got = os.preadv(self._fd, [view[filled:]], offset + filled)
                except OSError as exc:
                    if exc.errno != errno.EINVAL or not self._direct:
                        raise
                    self._direct = False  # refused after all: read buffered from here on
                    set_direct(self._fd, False)
                    continue
                if not got:
                    break
                filled += got
                if self._direct and filled % DIRECT_ALIGN:
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
