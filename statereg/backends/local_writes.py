"""How local disk writes a file's bytes: through the page cache with early writeback
(`WritebackFile`), or around it with O_DIRECT from page-aligned buffers (`DirectFile`).

`local.LocalBackend.open_write` picks one (around the cache where the writer's I/O policy
asks: `for_writing(around_cache=True)`); the kernel calls are kernel.py's.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import queue
import threading
from collections.abc import Callable
from typing import IO, Any

import numpy as np

from statereg.backends.kernel import DIRECT_ALIGN, drop_pages, set_direct, start_writeback
from statereg.process_state import process_wide

# Every this many bytes, the kernel is asked to start writing a file out (see WritebackFile).
_WRITEBACK_EVERY = 64 * 1024 * 1024
# Writes at least this long go to the file directly, past its buffer.
_UNBUFFERED = 256 * 1024
# A file written around the page cache (`for_writing(around_cache=True)`: compressed data)
# goes to disk with O_DIRECT from page-aligned buffers of this size, this many written at once
# per file (`DirectFile`); up to `_KEPT_ALIGNED` buffers are kept for the next files.
DIRECT_WRITE_CHUNK = 4 * 1024 * 1024
_DIRECT_WRITES_AHEAD = 2
_KEPT_ALIGNED = 12
# Pieces at least this long are copied into those buffers by numpy, without the GIL.
_COPY_WITHOUT_GIL = 64 * 1024


class WritebackFile:
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
                self._advise = start_writeback(self._file.fileno(), self._started,
                                                self._written - self._started,
                                                self._keep(self._written))
                self._started = self._written
        return count

    def drop_pages(self) -> None:
        """After the fsync: let the cache drop the file's pages (all clean now) unless the
        policy keeps a file of this size."""
        if not self._keep(self._written):
            drop_pages(self._file.fileno())

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
        return mmap.mmap(-1, DIRECT_WRITE_CHUNK)

    def give(self, buffer: mmap.mmap) -> None:
        with self._lock:
            if len(self._free) < _KEPT_ALIGNED:
                self._free.append(buffer)
                return
        with contextlib.suppress(BufferError):  # still viewed: freed with the last view
            buffer.close()


_ALIGNED = _AlignedBuffers()
process_wide(__name__, "_ALIGNED", "O_DIRECT buffers reused from file to file: a fresh one faults "
             "in every page", clear=lambda: _ALIGNED._free.clear())


class DirectFile:
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
            take = min(DIRECT_WRITE_CHUNK - start, count - at)
            if take >= _COPY_WITHOUT_GIL:
                assert self._array is not None
                np.copyto(self._array[start:start + take],
                          np.frombuffer(view[at:at + take], dtype=np.uint8))
            else:
                self._buffer[start:start + take] = view[at:at + take]  # type: ignore[index]
            self._filled += take
            at += take
            if self._filled == DIRECT_WRITE_CHUNK:
                self._submit(DIRECT_WRITE_CHUNK)
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
                    set_direct(self._fd, False)
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
            padded = -(-self._filled // DIRECT_ALIGN) * DIRECT_ALIGN
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
