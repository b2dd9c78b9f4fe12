"""backends/peers.py: a node's memory folder served read-only to its peers over 127.0.0.1,
and a backend that reads what its own node lacks from them (docs/tiers.md)."""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from statereg.backends.checksum import checksum_of, new_hasher
from statereg.backends.peers import NodeMemoryBackend, PeerServer, open_peer
from statereg.engine.verify import verify_files
from statereg.schemas.manifest import FileRecord

DATA = bytes(range(256)) * 64


@pytest.fixture
def nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
          ) -> Iterator[tuple[NodeMemoryBackend, NodeMemoryBackend, PeerServer]]:
    """Node a's folder, served; node b's folder, reading a through the server."""
    monkeypatch.setenv("STATEREG_SHM_DIR", str(tmp_path))
    monkeypatch.setenv("STATEREG_PEER_HOST", "127.0.0.1")
    monkeypatch.setenv("STATEREG_NODE", "a")
    a = NodeMemoryBackend("shm://run/job")
    a.write_bytes("step_00000001/model/data.bin", DATA)
    server = PeerServer(a)
    monkeypatch.setenv("STATEREG_NODE", "b")
    b = NodeMemoryBackend("shm://run/job", [open_peer(server.url)])
    yield a, b, server
    server.close()


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {})) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""


def test_a_node_reads_what_it_lacks_from_its_peer(nodes) -> None:
    _, b, _ = nodes
    path = "step_00000001/model/data.bin"
    assert not os.path.exists(b.full_path(path))
    assert b.exists(path) and b.size(path) == len(DATA)
    assert b.read_bytes(path) == DATA and b.read_bytes(path, limit=7) == DATA[:7]
    with b.open_read(path) as stream:
        assert stream.read() == DATA
    with b.open_blocks(path) as stream:
        stream.seek(300)
        assert stream.read(5) == DATA[300:305]
    with b.open_ranges(path, [(10, 20), (5000, 5010)], len(DATA)) as stream:
        stream.seek(5000)
        assert stream.read(10) == DATA[5000:5010]
    assert not b.exists("step_00000001/model/other.bin")
    with pytest.raises(FileNotFoundError):
        b.read_bytes("step_00000001/model/other.bin")


def test_a_replica_appears_only_whole_and_is_then_read_locally(nodes) -> None:
    a, b, _ = nodes
    path = "step_00000001/model/data.bin"
    b.fetch(b.peers[0], path)
    assert Path(b.full_path(path)).read_bytes() == DATA
    assert sorted(os.listdir(Path(b.full_path(path)).parent)) == ["data.bin"]  # no temp left
    os.remove(a.full_path(path))
    assert b.read_bytes(path) == DATA  # its own copy now


def test_holders_show_peer_files_in_walk_so_verify_sees_them(nodes) -> None:
    _, b, _ = nodes
    path = "step_00000001/model/data.bin"
    assert b.walk("step_00000001") == []
    b.holders = {path: (len(DATA), [0])}
    assert [(f.path, f.size) for f in b.walk("step_00000001")] == [(path, len(DATA))]
    hasher = new_hasher()
    hasher.update(DATA)
    # verify's fast mode checks sizes from walk(): the peer's file passes as present.
    verify_files(b, "step_00000001", [FileRecord(path="model/data.bin", size=len(DATA),
                                                 checksum=checksum_of(hasher))], "fast")


def test_the_server_answers_only_the_token_and_never_leaves_its_folder(nodes,
                                                                       tmp_path: Path) -> None:
    a, _, server = nodes
    base, token = server.url.rsplit("/", 1)
    (tmp_path / "secret.txt").write_text("not a checkpoint")
    os.symlink(tmp_path / "secret.txt", a.full_path("step_00000001/model/link.bin"))
    os.mkfifo(a.full_path("step_00000001/model/fifo"))
    assert _get(f"{server.url}/step_00000001/model/data.bin") == (200, DATA)
    assert _get(f"{base}/{'0' * len(token)}/step_00000001/model/data.bin")[0] == 403
    assert _get(f"{base}/step_00000001/model/data.bin")[0] == 403
    for hostile in ("../../secret.txt", "step_00000001/../../../secret.txt",
                    "step_00000001/model/link.bin", "step_00000001/model/fifo",
                    "%2e%2e/%2e%2e/secret.txt", ""):
        assert _get(f"{server.url}/{hostile}")[0] in (403, 404), hostile
    assert _get(f"{server.url}/step_00000001/model/data.bin",
                {"Range": "bytes=100-109"}) == (206, DATA[100:110])
    assert _get(f"{server.url}/step_00000001/model/data.bin",
                {"Range": f"bytes={len(DATA)}-"})[0] == 416
    # Messages never show the token.
    assert token not in open_peer(server.url).display("step_00000001")
