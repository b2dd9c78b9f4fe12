"""The physical floor: what the disk and memory do with the state's bytes and nothing else.

- buffered write: every tensor's bytes, in order, into one file through the page cache, then
  fsync (the durability every checkpoint writer here pays);
- O_DIRECT write: the same bytes through one page-aligned 64 MiB buffer, bypassing the cache,
  then fsync;
- cold read: the buffered file read back with the page cache dropped, straight into
  preallocated tensors (`readinto`, no intermediate buffer);
- memory copy: `copy_` of every tensor into preallocated tensors of the same shape, the floor
  of what an async save must do before the loop may continue; with torch's default intra-op
  threads and with one thread (on a busy machine the threaded copy can be several times
  slower), and the faster of the two is the floor the async target is held to.
"""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

import torch

from perfsuite.measure import PageCache, Timing, measure, tensor_bytes

_DIRECT_CHUNK = 64 * 2**20
_ALIGN = 4096


def write_buffered(path: Path, tensors: list[torch.Tensor]) -> None:
    with open(path, "wb") as f:
        for tensor in tensors:
            f.write(tensor_bytes(tensor))
        f.flush()
        os.fsync(f.fileno())


def write_direct(path: Path, tensors: list[torch.Tensor]) -> None:
    """Write through an aligned bounce buffer with O_DIRECT; pad the tail, then truncate."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    buffer = mmap.mmap(-1, _DIRECT_CHUNK)  # anonymous maps are page-aligned
    staging = memoryview(buffer)
    filled = total = 0

    def flush(length: int) -> None:
        view = staging[:length]
        while view:
            view = view[os.write(fd, view):]

    try:
        for tensor in tensors:
            source = tensor_bytes(tensor)
            while source:
                take = min(len(source), _DIRECT_CHUNK - filled)
                staging[filled:filled + take] = source[:take]
                filled, source = filled + take, source[take:]
                if filled == _DIRECT_CHUNK:
                    flush(filled)
                    total, filled = total + filled, 0
        if filled:
            padded = -(-filled // _ALIGN) * _ALIGN
            staging[filled:padded] = bytes(padded - filled)
            flush(padded)
            total += filled
        os.ftruncate(fd, total)
        os.fsync(fd)
    finally:
        staging.release()
        buffer.close()
        os.close(fd)


def read_into(path: Path, targets: list[torch.Tensor]) -> None:
    with open(path, "rb", buffering=0) as f:
        for tensor in targets:
            view = tensor_bytes(tensor)
            while view:
                view = view[f.readinto(view):]


def copy_into(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    for dst, src in zip(targets, sources, strict=True):
        dst.copy_(src)


def run(tensors: list[torch.Tensor], nbytes: int, work: Path, reps: int,
        cache: PageCache) -> dict[str, Timing]:
    path = work / "floor.bin"
    direct = work / "floor-direct.bin"
    rows: dict[str, Timing] = {}

    def clear() -> None:
        for stale in (path, direct):
            stale.unlink(missing_ok=True)
        cache.drop()

    rows["write_buffered"] = measure("raw sequential write, buffered + fsync",
                                     lambda: write_buffered(path, tensors), reps, nbytes, clear)
    try:
        rows["write_direct"] = measure("raw sequential write, O_DIRECT + fsync",
                                       lambda: write_direct(direct, tensors), reps, nbytes, clear)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        rows["write_direct"] = Timing("raw sequential write, O_DIRECT: not supported by this "
                                      "filesystem", [float("nan")], nbytes)
    direct.unlink(missing_ok=True)
    write_buffered(path, tensors)
    targets = [torch.empty_like(t).zero_() for t in tensors]
    rows["read_cold"] = measure("raw sequential read into tensors (cold cache)",
                                lambda: read_into(path, targets), reps, nbytes, cache.drop)
    copy_into(targets, tensors)  # warm-up: the first parallel copy starts torch's threads
    threads = torch.get_num_threads()
    rows["memcpy"] = measure(f"memory copy into preallocated tensors ({threads} threads)",
                             lambda: copy_into(targets, tensors), reps, nbytes)
    torch.set_num_threads(1)
    try:
        rows["memcpy_1thread"] = measure("memory copy into preallocated tensors (1 thread)",
                                         lambda: copy_into(targets, tensors), reps, nbytes)
    finally:
        torch.set_num_threads(threads)
    path.unlink()
    return rows
