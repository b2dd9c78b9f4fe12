"""A load that needs part of a DCP file fetches those bytes and no others, still verified.

A sharded checkpoint read at another world size, or a load of some keys, needs some items of
each file. The reader fetches only the runs of adjacent items it reads (one ranged GET per
run on an object store), checks every item it reads against its digest, and decodes
compressed items as before. Bytes and requests are counted by a relay in front of the real
S3 server (moto), so what is asserted is what crossed the wire.
"""

from __future__ import annotations

import socket
import threading
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp
from storage_servers import OutageProxy, s3_options

from statereg.backends import FileRecorder, open_backend
from statereg.dcp.codec import CompressionSettings
from statereg.dcp.metadata import load_dcp_metadata
from statereg.dcp.reader import BackendReader, SafeLoadPlanner, load_in_place
from statereg.dcp.writer import BackendWriter
from statereg.engine.world import caught, raise_own
from statereg.errors import CorruptCheckpointError

# What one HTTP response adds around the bytes it carries (status line and headers).
_RESPONSE_OVERHEAD = 1024
# Eight 256 KiB tensors, saved into one file in this order.
_KEYS = [f"t{i}" for i in range(8)]


class CountingProxy(OutageProxy):
    """A relay in front of a server that counts the GET requests and the bytes answered."""

    def __init__(self, target_port: int) -> None:
        self.gets = 0
        self.answered = 0
        self._counts = threading.Lock()
        super().__init__(target_port)

    def reset(self) -> None:
        with self._counts:
            self.gets = self.answered = 0

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            answers = src.getpeername()[1] == self.target[1]
            while data := src.recv(1 << 16):
                with self._counts:
                    if answers:
                        self.answered += len(data)
                    else:
                        self.gets += data.count(b"GET /")
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                sock.close()


@pytest.fixture
def counted_s3(s3_server, s3_admin):
    """(url, options through the counting relay, the relay, the admin filesystem)."""
    bucket = f"statereg-{uuid.uuid4().hex[:12]}"
    s3_admin.mkdir(bucket)
    proxy = CountingProxy(s3_server.port)
    yield f"s3://{bucket}/run", s3_options(proxy.endpoint), proxy, s3_admin
    proxy.down()


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {key: torch.randn(256, 256, generator=gen) for key in _KEYS}


def _save(url: str, options: dict, compression: CompressionSettings | None = None):
    """Save the state into one DCP file; its records (by path) and item locations (by key)."""
    state = _state()
    recorder = FileRecorder()
    writer = BackendWriter(open_backend(url, options), "ckpt", recorder, thread_count=1,
                           compression=compression)
    dcp.save(state, storage_writer=writer, no_dist=True)
    records = {written.path: written for written in recorder.files()}
    backend = open_backend(url, options)
    metadata = load_dcp_metadata(backend.read_bytes("ckpt/.metadata"), ".metadata")
    infos = {index.fqn: info for index, info in metadata.storage_data.items()}
    return state, records, infos


def _load(url: str, options: dict, records: dict, keys: list[str]) -> dict[str, torch.Tensor]:
    targets = {key: torch.zeros(256, 256) for key in keys}
    reader = BackendReader(open_backend(url, options), "ckpt", records=records)
    with caught() as loading:
        load_in_place(targets, reader, SafeLoadPlanner())
    if loading.error is not None:  # DCP wraps the reader's error; the engine raises it as itself
        raise_own(loading.error, "load", 0)
    return targets


@pytest.mark.parametrize("compression", [None, CompressionSettings(level=1)],
                         ids=["plain", "zstd"])
def test_a_partial_load_fetches_only_the_items_it_reads(counted_s3, compression):
    url, options, proxy, _ = counted_s3
    state, records, infos = _save(url, options, compression)
    assert len({info.relative_path for info in infos.values()}) == 1  # one file of 8 items
    wanted = ["t1", "t2", "t5"]  # two runs: t1+t2 (adjacent) and t5
    proxy.reset()

    loaded = _load(url, options, records, wanted)

    for key in wanted:
        assert torch.equal(loaded[key], state[key]), key
    needed = sum(infos[key].length for key in wanted) + records["ckpt/.metadata"].size
    data_file = next(path for path in records if path.endswith(".distcp"))
    assert needed < records[data_file].size / 2  # reading the whole file would be > 2x needed
    assert needed <= proxy.answered <= needed + _RESPONSE_OVERHEAD * proxy.gets
    assert proxy.gets == 3  # .metadata, the run t1-t2, the run t5


def test_a_full_load_fetches_each_file_with_one_request(counted_s3):
    url, options, proxy, _ = counted_s3
    state, records, _ = _save(url, options)
    proxy.reset()

    loaded = _load(url, options, records, _KEYS)

    assert all(torch.equal(loaded[key], state[key]) for key in _KEYS)
    assert proxy.gets == len(records)  # .metadata and the one data file
    assert proxy.answered <= sum(r.size for r in records.values()) + \
        _RESPONSE_OVERHEAD * proxy.gets


def _flip(fs, path: str, at: int) -> None:
    data = bytearray(fs.cat_file(path))
    data[at] ^= 0x10
    fs.pipe_file(path, bytes(data))


@pytest.mark.parametrize("compression", [None, CompressionSettings(level=1)],
                         ids=["plain", "zstd"])
def test_a_flipped_byte_inside_a_fetched_range_is_refused(counted_s3, compression):
    url, options, _, admin = counted_s3
    state, records, infos = _save(url, options, compression)
    data_file = next(path for path in records if path.endswith(".distcp"))
    damaged = infos["t5"]
    _flip(admin, f"{url.removeprefix('s3://')}/{data_file}",
          damaged.offset + damaged.length // 2)

    with pytest.raises(CorruptCheckpointError) as raised:
        _load(url, options, records, ["t1", "t5"])

    message = str(raised.value)
    assert data_file in message and "'t5'" in message
    assert "the file is damaged" in message
    # The damage lies outside what a load of t1 and t2 fetches: that load is unaffected.
    loaded = _load(url, options, records, ["t1", "t2"])
    assert torch.equal(loaded["t1"], state["t1"]) and torch.equal(loaded["t2"], state["t2"])


def test_a_partial_load_from_local_disk_reads_the_same_bytes(tmp_path):
    state, records, _ = _save(str(tmp_path), {})

    loaded = _load(str(tmp_path), {}, records, ["t0", "t3", "t7"])

    assert all(torch.equal(loaded[key], state[key]) for key in ("t0", "t3", "t7"))


def test_a_destination_that_cannot_be_resolved_is_reported_with_its_item(tmp_path):
    # Destinations are resolved before the reader threads start; a failure there still names
    # the item and is statereg's error, as a failure while reading it is.
    _save(str(tmp_path), {})

    class Broken(SafeLoadPlanner):
        def resolve_tensor(self, read_item):
            raise RuntimeError("narrow out of range")

    targets = {"t3": torch.zeros(256, 256)}
    reader = BackendReader(open_backend(str(tmp_path)), "ckpt")
    with caught() as loading:
        load_in_place(targets, reader, Broken())
    with pytest.raises(CorruptCheckpointError, match=r"'t3'.*RuntimeError: narrow out of range"):
        raise_own(loading.error, "load", 0)
