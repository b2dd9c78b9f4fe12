"""storage.read_cache: whether the page cache keeps what loads read and saves write.

Under the default (auto) a checkpoint that fits comfortably in memory stays in the page
cache, so a second load of it reads nothing from the disk; `bypass` reads with O_DIRECT and
drops what a save wrote, so the cache is left as it was (benchmarks/results/journal.md, "The page
cache"). Residency is asked of the kernel with mincore(2) on a mapping of each file, which
faults nothing in; disk reads are counted by /proc/self/io's read_bytes.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import itertools
import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import statereg
from statereg.backends import local, open_backend
from statereg.backends.checksum import WrittenFile, checksum_of, new_hasher
from statereg.backends.kernel import in_memory
from statereg.backends.local import keeps_pages
from statereg.backends.local_writes import DIRECT_WRITE_CHUNK
from statereg.errors import StorageError

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_int64)
_LIBC.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_LIBC.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident(path: Path) -> tuple[int, int]:
    """(pages of `path` in the page cache, pages of `path`), by mincore(2)."""
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        address = _LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, _MAP_FAILED), os.strerror(ctypes.get_errno())
        try:
            vector = (ctypes.c_ubyte * pages)()
            assert _LIBC.mincore(address, size, vector) == 0, os.strerror(ctypes.get_errno())
            return sum(byte & 1 for byte in vector), pages
        finally:
            _LIBC.munmap(address, size)
    finally:
        os.close(fd)


def evict(paths: list[Path]) -> None:
    """Drop the files' pages from the page cache (written back first), as after a reboot."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_reads() -> int:
    """Bytes this process has had read from a disk (/proc/self/io read_bytes)."""
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("read_bytes:"))


class Run:
    """A model of two 1024 x 1024 layers and its AdamW state after a step (~25 MB)."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))
        self.optimizer = torch.optim.AdamW(self.model.parameters())
        self.model(torch.randn(4, 1024)).sum().backward()
        self.optimizer.step()

    def state(self) -> dict[str, torch.Tensor]:
        flat = {f"model.{k}": v.clone() for k, v in self.model.state_dict().items()}
        for index, moments in self.optimizer.state_dict()["state"].items():
            flat.update({f"optimizer.{index}.{k}": v.clone() for k, v in moments.items()})
        return flat


def manager(root: Path, run: Run, **storage: str) -> statereg.CheckpointManager:
    spec = {"storage": {"url": str(root), **storage},
            "components": {"model": {"kind": "model"}, "optimizer": {"kind": "optimizer"}}}
    return statereg.CheckpointManager(spec, model=run.model, optimizer=run.optimizer)


def data_files(root: Path) -> list[Path]:
    found = sorted(root.rglob("*.distcp"))
    assert found, f"no data files under {root}"
    return found


def assert_loaded(run: Run, expected: dict[str, torch.Tensor]) -> None:
    actual = run.state()
    assert actual.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(actual[key], tensor), key


@pytest.fixture
def root(tmp_path: Path) -> Path:
    if in_memory(str(tmp_path)):
        pytest.skip("the temporary folder is in memory (tmpfs): it has no page cache to spare")
    return tmp_path / "ckpts"


def test_a_second_load_under_the_default_policy_reads_nothing_from_disk(root):
    saved = Run(seed=0)
    expected = saved.state()
    manager(root, saved).save(step=1)
    files = data_files(root)
    evict(files)  # the first load starts cold, as after a reboot
    assert all(resident(path)[0] == 0 for path in files)

    run = Run(seed=1)
    mgr = manager(root, run)
    mgr.load()
    assert_loaded(run, expected)
    assert [cached == pages for cached, pages in map(resident, files)] == [True] * len(files)

    with torch.no_grad():  # the second load must put every byte back
        for parameter in run.model.parameters():
            parameter.zero_()
        for moments in run.optimizer.state.values():
            for value in moments.values():
                value.zero_()
    before = disk_reads()
    mgr.load()
    read = disk_reads() - before
    assert_loaded(run, expected)
    stored = sum(path.stat().st_size for path in files)
    assert read <= stored // 100, f"the second load read {read} of {stored} bytes from disk"


def test_a_save_under_the_default_policy_leaves_its_files_cached(root):
    # Files past 64 MiB start their writeback early; that must not drop their pages.
    torch.manual_seed(0)
    model = nn.Linear(4500, 4500)  # 81 MB of weights: one file past the writeback step
    spec = {"storage": {"url": str(root)}, "components": {"model": {"kind": "model"}}}
    statereg.CheckpointManager(spec, model=model).save(step=1)
    for path in data_files(root):
        cached, pages = resident(path)
        assert cached == pages, f"{path.name}: {cached} of {pages} pages cached after the save"


def test_bypass_leaves_the_page_cache_as_it_was(root):
    saved = Run(seed=0)
    expected = saved.state()
    manager(root, saved, read_cache="bypass").save(step=1)
    files = data_files(root)
    # The save let the cache drop what it wrote.
    assert [resident(path)[0] for path in files] == [0] * len(files)

    run = Run(seed=1)
    mgr = manager(root, run, read_cache="bypass")
    mgr.load()  # cold: read around the cache
    assert_loaded(run, expected)
    assert [resident(path)[0] for path in files] == [0] * len(files)

    for path in files:  # warm (someone read the files): read from the cache, left there
        path.read_bytes()
    run = Run(seed=2)
    manager(root, run, read_cache="bypass").load()
    assert_loaded(run, expected)
    assert all(cached == pages for cached, pages in map(resident, files))


def test_keep_and_auto_read_through_the_cache_and_auto_bypasses_a_load_too_large(root):
    saved = Run(seed=0)
    manager(root, saved).save(step=1)
    path = max(data_files(root), key=lambda p: p.stat().st_size)
    size = path.stat().st_size
    relative = str(path.relative_to(root))

    def direct(backend: statereg.backends.StorageBackend) -> bool:
        evict([path])
        with backend.open_ranges(relative, [(0, size)], size) as stream:
            assert stream.read() == path.read_bytes()
            return bool(fcntl.fcntl(stream.fileno(), fcntl.F_GETFL) & os.O_DIRECT)

    assert not direct(open_backend(str(root)))  # auto, one small file
    assert not direct(open_backend(str(root)).for_reading(size))  # auto, a small load
    assert direct(open_backend(str(root)).for_reading(1 << 62))  # auto, a load past memory
    assert not direct(open_backend(str(root), read_cache="keep").for_reading(1 << 62))
    assert direct(open_backend(str(root), read_cache="bypass"))


def test_auto_keeps_what_takes_under_half_of_the_available_memory():
    assert keeps_pages("auto", 49, 100)
    assert not keeps_pages("auto", 50, 100)
    assert keeps_pages("auto", 1 << 40, None)  # unknown (not Linux): buffered, as there
    assert keeps_pages("keep", 1 << 40, 1)
    assert not keeps_pages("bypass", 1, 1 << 40)


def test_an_unknown_read_cache_is_refused_naming_the_field(tmp_path):
    spec = {"storage": {"url": str(tmp_path), "read_cache": "sometimes"},
            "components": {"model": {"kind": "model"}}}
    with pytest.raises(statereg.SpecError, match=r"storage\.read_cache: Input should be "
                                                  r"'auto', 'keep' or 'bypass'"):
        statereg.CheckpointManager(spec, model=nn.Linear(2, 2))
    with pytest.raises(statereg.SpecError, match=r"storage.read_cache 'sometimes'"):
        open_backend(str(tmp_path), read_cache="sometimes")  # type: ignore[arg-type]


@pytest.mark.parametrize("ask", ["cachestat", "mincore"])
def test_residency_is_asked_without_reading_the_file(root, monkeypatch, ask):
    """`kernel.cached_share` (whether a load reads a file from the cache or around it) answers by
    cachestat(2), or mincore(2) where the kernel has none, and reads nothing either way."""
    from statereg.backends import kernel

    if ask == "mincore":
        monkeypatch.setattr(kernel, "_cachestat_works", False)
    root.mkdir(parents=True)
    path = root / "data.distcp"
    pages = 4
    path.write_bytes(os.urandom((pages - 1) * mmap.PAGESIZE + 100))
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        if ask == "cachestat" and kernel.cached_pages(kernel.load_libc(), fd, 0, 1) is None:
            pytest.skip("this kernel has no cachestat(2) (Linux 6.5)")
        os.read(fd, size)  # every page cached
        assert kernel.cached_share(fd, [(0, size)]) == 1.0
        evict([path])
        before = disk_reads()
        assert kernel.cached_share(fd, [(0, size)]) == 0.0
        assert kernel.cached_share(fd, [(size - 50, size)]) == 0.0  # the last, partial page
        assert disk_reads() == before and resident(path)[0] == 0
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead around the next read
        os.pread(fd, 10, mmap.PAGESIZE)  # one page back
        assert kernel.cached_share(fd, [(mmap.PAGESIZE + 1, mmap.PAGESIZE + 9)]) == 1.0
        assert kernel.cached_share(fd, [(0, size)]) == 1 / pages
        assert kernel.cached_share(fd, [(0, 10), (mmap.PAGESIZE, mmap.PAGESIZE + 10)]) == 0.5
    finally:
        os.close(fd)


def test_a_file_nearly_all_cached_is_read_from_the_cache(root):
    """The kernel's proactive reclaim drops a few idle pages of a file read a moment ago: a
    load that finds nearly all of a file cached reads it through the cache under every
    policy (O_DIRECT would read it all again)."""
    saved = Run(seed=0)
    expected = saved.state()
    manager(root, saved).save(step=1)
    files = data_files(root)
    for path in files:  # all cached, then one page in a hundred dropped
        fd = os.open(path, os.O_RDONLY)
        try:
            os.read(fd, path.stat().st_size)
            os.posix_fadvise(fd, mmap.PAGESIZE, mmap.PAGESIZE, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        cached, pages = resident(path)
        assert pages - 2 <= cached < pages
    for policy in ("auto", "bypass"):
        run = Run(seed=1)
        before = disk_reads()
        manager(root, run, read_cache=policy).load()
        assert_loaded(run, expected)
        read = disk_reads() - before
        stored = sum(path.stat().st_size for path in files)
        assert read <= stored // 50, f"{policy}: read {read} of {stored} bytes from disk"


@pytest.mark.parametrize("policy", ["auto", "bypass", "keep"])
def test_compressed_data_files_are_written_around_the_cache_unless_kept(root, policy):
    """A compressed save writes its data files with O_DIRECT (their load is bound by
    decoding, their save by the CPU the cache's copy takes), except under `keep`; a load reads
    them back bit for bit, and under `auto` it leaves them cached for the next load."""
    saved = Run(seed=0)
    expected = saved.state()
    manager(root, saved, read_cache=policy, compression="zstd").save(step=1)
    files = data_files(root)
    cached = [resident(path) for path in files]
    if policy == "keep":
        assert all(count == pages for count, pages in cached), cached
    else:
        assert [count for count, _ in cached] == [0] * len(files), cached

    run = Run(seed=1)
    manager(root, run, read_cache=policy, compression="zstd").load()
    assert_loaded(run, expected)
    if policy == "auto":
        assert all(count == pages for count, pages in map(resident, files))


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, DIRECT_WRITE_CHUNK - 1,
                                  DIRECT_WRITE_CHUNK, 3 * DIRECT_WRITE_CHUNK + 123])
def test_a_file_written_around_the_cache_holds_exactly_its_bytes(root, size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    cuts = sorted(np.random.default_rng(size + 1).integers(0, size + 1, 7).tolist())
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, size], strict=True)]
    reported: list[WrittenFile] = []
    backend = open_backend(str(root)).for_writing(around_cache=True)
    writer = backend.open_write("f.distcp", reported.append)
    for piece in pieces:
        writer.write(piece)
    writer.close()
    path = root / "f.distcp"
    assert path.read_bytes() == data
    hasher = new_hasher()
    hasher.update(data)
    assert reported == [WrittenFile("f.distcp", size, checksum_of(hasher))]


def test_a_filesystem_that_refuses_a_direct_write_gets_it_buffered(root, monkeypatch):
    """EINVAL from an O_DIRECT write (a filesystem that accepted the flag, then refuses the
    write) turns O_DIRECT off for the rest of the file: every byte still lands."""
    refused: list[int] = []
    pwrite = os.pwrite

    def picky(fd: int, data: object, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return pwrite(fd, data, offset)

    monkeypatch.setattr(local.os, "pwrite", picky)
    data = os.urandom(2 * DIRECT_WRITE_CHUNK + 5)
    backend = open_backend(str(root)).for_writing(around_cache=True)
    writer = backend.open_write("f.distcp")
    writer.write(data)
    writer.close()
    assert (root / "f.distcp").read_bytes() == data
    assert refused == [0]


def test_a_failed_direct_write_is_a_storage_error_naming_the_file(root, monkeypatch):
    """A write that fails on the writing thread (a full disk) is raised on the caller's, as
    the backend's StorageError naming the file, and a save that meets it commits nothing."""
    pwrite = os.pwrite

    def full(fd: int, data: object, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.ENOSPC, "No space left on device")
        return pwrite(fd, data, offset)

    saved = Run(seed=0)
    mgr = manager(root, saved, compression={"codec": "zstd", "float_aware": False})
    first = mgr.save(step=1)
    monkeypatch.setattr(local.os, "pwrite", full)
    with pytest.raises(StorageError, match=r"write failed for .*\.distcp.*No space left"):
        mgr.save(step=2)
    monkeypatch.undo()
    assert not (root / "step_00000002" / "manifest.json").exists()
    run = Run(seed=1)
    assert manager(root, run).load().path == first
    assert_loaded(run, saved.state())


class Reads:
    """A stream that records where each read starts and ends."""

    def __init__(self, stream: Any, spans: list[tuple[int, int]]) -> None:
        self._stream, self._spans = stream, spans

    def read(self, size: int = -1) -> bytes:
        start = self._stream.tell()
        data = self._stream.read(size)
        self._spans.append((start, start + len(data)))
        return data

    def readinto(self, buffer: Any) -> int:
        start = self._stream.tell()
        count = self._stream.readinto(buffer)
        self._spans.append((start, start + count))
        return count

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def test_a_cold_load_reads_each_data_file_front_to_back(root, monkeypatch):
    """The kernel's readahead keeps a cold file's reads ahead only while they go forward: a
    read that starts before the last one ended (a record's payload read again from its
    start after its head) resets it, and a cold load read this disk at half its rate."""
    saved = Run(seed=0)
    expected = saved.state()
    manager(root, saved).save(step=1)
    files = data_files(root)
    evict(files)
    spans: dict[str, list[tuple[int, int]]] = {}
    open_ranges = local.LocalBackend.open_ranges

    @contextlib.contextmanager
    def recorded(self: Any, path: str, ranges: Any, size: Any = None) -> Iterator[Any]:
        with open_ranges(self, path, ranges, size) as stream:
            yield Reads(stream, spans.setdefault(path, []))

    monkeypatch.setattr(local.LocalBackend, "open_ranges", recorded)
    run = Run(seed=1)
    manager(root, run).load()
    assert_loaded(run, expected)
    assert sorted(p.rsplit("/", 2)[-2:] for p in spans) == sorted(
        [f.parent.name, f.name] for f in files)
    for path, reads in spans.items():
        backwards = [(a, b) for a, b in itertools.pairwise(reads) if b[0] < a[1]]
        assert not backwards, f"{path}: reads went back: {backwards[:3]}"
