"""Local data files are read with O_DIRECT where the policy bypasses the page cache and the
filesystem allows it, buffered elsewhere.

With `read_cache: bypass` (or auto for a checkpoint too large to cache) statereg reads the
runs of a data file in large aligned O_DIRECT chunks, several in flight, and copies out of
them (benchmarks/results/journal.md, "Cold load"). The same bytes must come back whatever the
position, length and chunk boundaries, and a filesystem that refuses O_DIRECT (procfs here) or keeps
files in memory (tmpfs) is read buffered instead. tests/backends/test_read_cache.py covers
the policy itself.
"""

from __future__ import annotations

import fcntl
import os
import tempfile

import pytest
import torch
import torch.distributed.checkpoint as dcp

from statereg.backends import FileRecorder, open_backend
from statereg.backends.local_reads import DIRECT_CHUNK as _DIRECT_CHUNK
from statereg.dcp.reader import BackendReader, SafeLoadPlanner, load_in_place
from statereg.dcp.writer import BackendWriter

_SIZE = 2 * _DIRECT_CHUNK + 12345  # two whole chunks and an unaligned tail


def _direct(stream) -> bool:
    return bool(fcntl.fcntl(stream.fileno(), fcntl.F_GETFL) & os.O_DIRECT)


def _evict(*paths) -> None:
    """Drop the files from the page cache (written back first), as after a reboot."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@pytest.fixture
def data_file(tmp_path):
    data = os.urandom(_SIZE)
    (tmp_path / "data.bin").write_bytes(data)
    _evict(tmp_path / "data.bin")
    return tmp_path, data


def test_disk_reads_use_o_direct_and_return_every_byte_as_stored(data_file):
    root, data = data_file
    backend = open_backend(str(root), read_cache="bypass")
    ranges = [(100, _DIRECT_CHUNK + 7), (_DIRECT_CHUNK + 9, _SIZE)]
    with backend.open_ranges("data.bin", ranges, _SIZE) as stream:
        assert _direct(stream)
        stream.seek(100)
        assert stream.read(_DIRECT_CHUNK + 7 - 100) == data[100:_DIRECT_CHUNK + 7]  # 2 chunks
        stream.seek(_DIRECT_CHUNK + 9)
        buffer = bytearray(_SIZE - _DIRECT_CHUNK - 9)
        assert stream.readinto(buffer) == len(buffer) and bytes(buffer) == data[_DIRECT_CHUNK + 9:]
        assert stream.read(10) == b""  # the end of the file
        stream.seek(5)  # back, outside every run: still the stored bytes
        assert stream.read(50) == data[5:55]
        assert stream.seek(0, os.SEEK_END) == _SIZE


def test_a_file_in_the_page_cache_is_read_buffered(data_file):
    # Just read (or just written): O_DIRECT would read from the disk what memory holds.
    root, data = data_file
    assert (root / "data.bin").read_bytes() == data
    with open_backend(str(root), read_cache="bypass").open_ranges("data.bin", [(0, _SIZE)],
                                                                  _SIZE) as stream:
        assert not _direct(stream)
        assert stream.read() == data


def test_a_filesystem_refusing_o_direct_is_read_buffered():
    # procfs refuses O_DIRECT (fcntl answers EINVAL); its files are regular files.
    backend = open_backend("/proc", read_cache="bypass")
    with open("/proc/version", "rb") as f:
        expected = f.read()
    with backend.open_ranges("version", [(0, 4096)]) as stream:
        assert not _direct(stream)
        assert stream.read(4096) == expected


def test_a_root_in_memory_is_read_buffered():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:
        data = os.urandom(10000)
        with open(os.path.join(folder, "data.bin"), "wb") as f:
            f.write(data)
        with open_backend(folder, read_cache="bypass").open_ranges("data.bin",
                                                                   [(10, 9000)]) as stream:
            assert not _direct(stream)
            stream.seek(10)
            assert stream.read(8990) == data[10:9000]


def test_a_dcp_load_through_direct_reads_is_bit_identical_and_verified(tmp_path):
    gen = torch.Generator().manual_seed(3)
    # Items larger and smaller than a chunk, so records straddle chunk boundaries.
    state = {"big": torch.randn(3 * _DIRECT_CHUNK // 8 + 3, 2, generator=gen),
             "small": torch.randn(1000, generator=gen),
             "half": torch.randn(100, 100, generator=gen).half(),
             "meta": {"step": 7}}
    recorder = FileRecorder()
    dcp.save(state, storage_writer=BackendWriter(open_backend(str(tmp_path)), "ckpt", recorder,
                                                 thread_count=2), no_dist=True)
    records = {written.path: written for written in recorder.files()}
    _evict(*(tmp_path / path for path in records))
    targets = {k: torch.zeros_like(v) for k, v in state.items() if k != "meta"}
    targets["meta"] = {"step": 0}

    bypass = open_backend(str(tmp_path), read_cache="bypass")
    load_in_place(targets, BackendReader(bypass, "ckpt", records=records), SafeLoadPlanner())

    for key in ("big", "small", "half"):
        assert torch.equal(targets[key], state[key]), key
    assert targets["meta"] == {"step": 7}
