"""tiers/transport/ and tiers/node_memory.py: a node's memory folder served read-only to
its peers over 127.0.0.1, and a backend that reads what its own node lacks from them
(docs/tiers.md)."""

from __future__ import annotations

import ast
import inspect
import os
import socket
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from statereg.backends.base import StorageBackend
from statereg.backends.checksum import checksum_of, new_hasher
from statereg.backends.registry import open_backend
from statereg.backends.stores import ReadOnlyStore
from statereg.engine.verify import verify_files
from statereg.errors import CorruptCheckpointError, StorageError
from statereg.schemas.manifest import FileRecord
from statereg.tiers.node_memory import NodeMemoryBackend
from statereg.tiers.transport import PeerServer, open_peer
from statereg.tiers.transport.client import PeerBackend

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
    b = NodeMemoryBackend("shm://run/job", [open_peer(server.url, server.secret)])
    yield a, b, server
    server.close()


def _get(server: PeerServer, path: str, start: int = 0, end: int | None = None,
         ) -> tuple[int, bytes]:
    """What the job's own client gets for `path` (its status as an error: 403 or 404)."""
    peer = open_peer(server.url, server.secret)
    try:
        return 206, peer.read_range(path, start, end)
    except FileNotFoundError:
        return 404, b""
    except StorageError as exc:
        assert "HTTP 403" in str(exc), exc
        return 403, b""


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


def _record(path: str, data: bytes) -> FileRecord:
    hasher = new_hasher()
    hasher.update(data)
    return FileRecord(path=path, size=len(data), checksum=checksum_of(hasher))


def test_a_replica_appears_only_whole_and_is_then_read_locally(nodes) -> None:
    a, b, _ = nodes
    path = "step_00000001/model/data.bin"
    b.fetch(b.peers[0], path, _record(path, DATA))
    assert Path(b.full_path(path)).read_bytes() == DATA
    assert sorted(os.listdir(Path(b.full_path(path)).parent)) == ["data.bin"]  # no temp left
    os.remove(a.full_path(path))
    assert b.read_bytes(path) == DATA  # its own copy now


def test_a_replica_that_does_not_match_its_manifest_is_never_installed(nodes) -> None:
    # The peer's file changed under the copy (rewritten, damaged): the copy is refused.
    a, b, _ = nodes
    path = "step_00000001/model/data.bin"
    changed = bytearray(DATA)
    changed[5000] ^= 1
    a.write_bytes(path, bytes(changed))
    with pytest.raises(CorruptCheckpointError, match=r"data\.bin"):
        b.fetch(b.peers[0], path, _record(path, DATA))
    folder = Path(b.full_path(path)).parent
    assert not folder.exists() or os.listdir(folder) == []  # no replica, no temporary


def test_holders_show_peer_files_in_walk_and_listings_so_verify_and_layouts_see_them(
        nodes) -> None:
    _, b, _ = nodes
    path = "step_00000001/model/data.bin"
    b.write_bytes("step_00000001/own.bin", DATA)
    assert [(f.path, f.size) for f in b.walk("step_00000001")] == [
        ("step_00000001/own.bin", len(DATA))]
    assert b.list_dir("step_00000001") == ["own.bin"]
    b.holders = {path: (len(DATA), [0]), "step_00000002/model/x.bin": (1, [0]),
                 "step_00000001/model/gone.bin": (1, [])}  # no node holds it
    assert [(f.path, f.size) for f in b.walk("step_00000001")] == [
        (path, len(DATA)), ("step_00000001/own.bin", len(DATA))]
    # A layout that finds its files by listing (safetensors) finds the peer's file too.
    assert b.list_dir("step_00000001") == ["model", "own.bin"]
    assert b.list_dir("step_00000001/model") == ["data.bin"]
    assert b.list_dir("") == ["step_00000001", "step_00000002"]
    hasher = new_hasher()
    hasher.update(DATA)
    # verify's fast mode checks sizes from walk(): the peer's file passes as present.
    verify_files(b, "step_00000001", [FileRecord(path="model/data.bin", size=len(DATA),
                                                 checksum=checksum_of(hasher))], "fast")


def test_the_server_answers_only_the_job_and_never_leaves_its_folder(nodes,
                                                                     tmp_path: Path) -> None:
    a, _, server = nodes
    (tmp_path / "secret.txt").write_text("not a checkpoint")
    os.symlink(tmp_path / "secret.txt", a.full_path("step_00000001/model/link.bin"))
    os.mkfifo(a.full_path("step_00000001/model/fifo"))
    assert _get(server, "step_00000001/model/data.bin") == (206, DATA)
    # Without the job's secret: refused, whatever the path.
    stranger = open_peer(server.url, bytes(32))
    with pytest.raises(StorageError, match="HTTP 403"):
        stranger.read_bytes("step_00000001/model/data.bin")
    for hostile in ("../../secret.txt", "step_00000001/../../../secret.txt",
                    "step_00000001/model/link.bin", "step_00000001/model/fifo",
                    "%2e%2e/%2e%2e/secret.txt"):
        assert _get(server, hostile)[0] in (403, 404), hostile
    assert _get(server, "step_00000001/model/data.bin", 100, 110) == (206, DATA[100:110])
    assert _get(server, "step_00000001/model/data.bin", len(DATA)) == (206, b"")  # 416
    # Messages never show the secret, and no URL holds it.
    assert server.secret.hex() not in server.url


# -- the HTTP client: ranged reads into the caller's buffer, kept connections, clear errors --

BIG = bytes(range(251)) * 4099  # ~1 MiB, not a multiple of any block size


def test_ranged_and_whole_reads_give_the_stored_bytes_over_one_kept_connection(
        nodes) -> None:
    a, _, server = nodes
    a.write_bytes("step_00000001/model/big.bin", BIG)
    peer = open_peer(server.url, server.secret)
    path = "step_00000001/model/big.bin"
    runs = [(100, 300_000), (300_000, 700_001), (900_000, len(BIG) + 500)]
    with peer.open_ranges(path, runs, len(BIG)) as stream:
        got = bytearray(len(BIG))
        stream.seek(100)
        assert stream.readinto(memoryview(got)[100:700_001]) == 700_001 - 100  # two runs
        stream.seek(150)  # back, into the block the first read kept: small reads
        assert stream.read(10) == BIG[150:160]
        stream.seek(800_000)  # outside every run: just what is asked
        assert stream.read(70_000) == BIG[800_000:870_000]
        stream.seek(900_000)
        assert stream.readinto(memoryview(got)[900_000:]) == len(BIG) - 900_000
        assert stream.read(5) == b""  # the end of the file, as from any stream
        stream.seek(-7, os.SEEK_END)
        assert stream.read() == BIG[-7:]
    assert got[100:700_001] == BIG[100:700_001] and got[900_000:] == BIG[900_000:]
    assert server.connections() == 1
    with peer.open_read(path) as stream:
        assert stream.read() == BIG
    assert peer.read_bytes(path) == BIG and peer.read_bytes(path, limit=3) == BIG[:3]
    assert peer.read_range(path, 5, 9) == BIG[5:9] and peer.read_range(path, len(BIG), None) == b""
    assert peer.size(path) == len(BIG) and peer.exists(path)
    assert not peer.exists("step_00000001/model/none.bin")
    # Every request went over the one connection kept alive.
    assert server.connections() == 1 and len(peer._idle) == 1


def test_a_peer_that_stops_mid_file_is_a_storage_error_naming_it_and_the_file(
        nodes) -> None:
    a, b, server = nodes
    path = "step_00000001/model/large.bin"
    Path(a.full_path(path)).write_bytes(bytes(64 << 20))  # more than loopback buffers hold
    host, port = server.url.split("/")[2].split(":")
    buffer = bytearray(64 << 20)
    with b.open_ranges(path, [(0, len(buffer))], len(buffer)) as stream:
        assert stream.readinto(memoryview(buffer)[:1 << 20]) == 1 << 20
        server.close()  # the node goes away with the rest of the file unsent
        with pytest.raises(StorageError, match=rf"reading http://{host}:{port}/{path} "
                           rf"failed: the peer node at {host}:{port} stopped sending it at "
                           r"byte \d+ .*bring it back, or restore from storage.url") as err:
            stream.readinto(memoryview(buffer)[1 << 20:])
    assert server.secret.hex() not in str(err.value)
    # Down before a read: no answer at all, and no node to fall back to.
    with pytest.raises(StorageError, match=rf"{path} failed: the peer node at {host}:{port} "
                       r"did not answer \(ConnectionRefusedError"):
        open_peer(server.url, server.secret).read_bytes(path)
    with pytest.raises(StorageError, match="did not answer"):
        b.exists("step_00000001/model/data.bin")


def test_a_wrong_secret_is_refused_with_a_storage_error_and_a_peer_only_reads(
        nodes) -> None:
    _, _, server = nodes
    stranger = open_peer(server.url, bytes(32))
    with pytest.raises(StorageError, match=r"step_00000001/model/data.bin failed: the peer "
                       r"node at .* refused the request \(HTTP 403\): its MAC"):
        stranger.read_bytes("step_00000001/model/data.bin")
    # Read-only by construction: a peer is no StorageBackend and has nothing that writes,
    # deletes or lists to refuse (each node writes its own folder).
    peer = open_peer(server.url, server.secret)
    assert not isinstance(peer, StorageBackend)
    assert not [name for name in ("open_write", "write_bytes", "create_bytes", "makedirs",
                                  "list_dir", "walk", "remove_file", "remove_tree")
                if hasattr(peer, name)]
    with pytest.raises(StorageError, match="is not a peer server's URL"):
        open_peer(f"{server.url}/token", server.secret)


def _only_raise(cls: type) -> list[str]:
    """The methods of `cls` whose body, past a docstring, is one `raise`."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            body = [s for s in node.body if not (isinstance(s, ast.Expr)
                                                and isinstance(s.value, ast.Constant))]
            if len(body) == 1 and isinstance(body[0], ast.Raise):
                found.append(node.name)
    return found


def test_the_peer_and_every_backend_are_one_read_only_store_with_nothing_that_refuses(
        nodes, tmp_path: Path) -> None:
    """A node's memory falls back to a peer typed as a ReadOnlyStore: the peer has its read
    methods, and none of its methods only raises (it is no backend refusing writes)."""
    memory, _, server = nodes
    peer = open_peer(server.url, server.secret)
    assert isinstance(peer, ReadOnlyStore)
    assert isinstance(memory, ReadOnlyStore)
    assert isinstance(open_backend(str(tmp_path)), ReadOnlyStore)
    assert isinstance(open_backend("memory://read-only-store"), ReadOnlyStore)
    assert _only_raise(PeerBackend) == []


def test_a_kept_connection_the_server_has_since_closed_is_replaced(nodes) -> None:
    _, _, server = nodes
    peer = open_peer(server.url, server.secret)
    path = "step_00000001/model/data.bin"
    assert peer.read_bytes(path) == DATA
    kept = list(peer._idle)
    for _ in range(200):  # the worker hands the connection back to the selector thread
        if server._kept:
            break
        time.sleep(0.01)
    for connection in list(server._kept):  # as the server's idle timeout does
        connection.shutdown(socket.SHUT_RDWR)
    assert peer.read_bytes(path) == DATA and peer.size(path) == len(DATA)
    assert len(kept) == 1 and kept[0] not in peer._idle
