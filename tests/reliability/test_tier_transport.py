"""The peer transport as an attacker on the node's network, or a peer that lies or stalls,
meets it (docs/tiers.md#the-peer-transport; issue 27 case 4 and 6). Real sockets: the job's
PeerServer, and for the peer that misbehaves a tiny real socket server in this file that
holds the job's secret (a broken or compromised node) and answers what it was not asked.

- More connections than the server's caps (idle, half-sent heads) cost no thread, are
  closed, and the job's own reads still succeed.
- A request with a wrong MAC, a replayed one, or a head sent too slowly is closed from the
  selector thread: no worker thread starts.
- A peer that answers 200 to a range, a huge or negative Content-Length, another
  Content-Range, or trickles one byte per just-under-the-timeout, gives a StorageError
  naming it within the request's deadline, and a node's read falls back to the next peer.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import suppress
from pathlib import Path

import pytest

from statereg.errors import StorageError
from statereg.tiers.node_memory import NodeMemoryBackend
from statereg.tiers.transport import PeerServer, open_peer
from statereg.tiers.transport.wire import answer_mac as _answer_mac
from statereg.tiers.transport.wire import request_mac as _request_mac

DATA = bytes(range(256)) * 64
PATH = "step_00000001/model/data.bin"
TIMEOUT = 1.0  # the client's deadline in these tests (60 s by default)


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> NodeMemoryBackend:
    monkeypatch.setenv("STATEREG_SHM_DIR", str(tmp_path))
    monkeypatch.setenv("STATEREG_PEER_HOST", "127.0.0.1")
    monkeypatch.setenv("STATEREG_NODE", "a")
    a = NodeMemoryBackend("shm://run/job")
    a.write_bytes(PATH, DATA)
    return a


@pytest.fixture
def server(folder: NodeMemoryBackend) -> Iterator[PeerServer]:
    served = PeerServer(folder, max_pending=4, max_connections=4, head_deadline=0.5)
    yield served
    served.close()


def _peer_threads() -> int:
    return sum(t.name.startswith("statereg-peer") for t in threading.enumerate())


def _closed_within(sock: socket.socket, seconds: float) -> tuple[bytes, float]:
    """What the server sent before closing `sock`, and how long that took."""
    started = time.monotonic()
    sock.settimeout(seconds)
    got = b""
    while True:
        data = sock.recv(4096)
        if not data:
            return got, time.monotonic() - started
        got += data


def test_connections_past_the_caps_cost_no_thread_and_the_jobs_reads_go_on(
        server: PeerServer) -> None:
    host, port = server.host, server.port
    reader = open_peer(server.url, server.secret, TIMEOUT)
    assert reader.read_bytes(PATH) == DATA  # one worker thread exists now
    threads, before = _peer_threads(), threading.active_count()
    flood = [socket.create_connection((host, port)) for _ in range(40)]  # 10x the cap
    for sock in flood[::2]:
        sock.send(b"GET /" + PATH.encode())  # half a head, never finished
    time.sleep(0.2)
    assert server.connections() <= 4 + 1  # max_pending (+ the reader's kept connection)
    assert threading.active_count() == before and _peer_threads() == threads
    # The job's own reader gets in while the flood holds every pending slot.
    for _ in range(3):
        fresh = open_peer(server.url, server.secret, TIMEOUT)
        assert fresh.read_bytes(PATH) == DATA and fresh.size(PATH) == len(DATA)
    # What is left of the flood is closed at the head deadline, all of it.
    closed = [_closed_within(sock, 2.0) for sock in flood[-4:]]
    assert all(elapsed < 1.5 for _, elapsed in closed)
    for sock in flood:
        sock.close()


def _signed(server: PeerServer, secret: bytes, path: str = PATH, stamp: float | None = None,
            nonce: str | None = None) -> bytes:
    stamp_text = f"{time.time() if stamp is None else stamp:.3f}"
    nonce = nonce or secrets.token_hex(16)
    target = "/" + path
    mac = _request_mac(secret, "GET", server.authority, target, "bytes=0-9", stamp_text, nonce)
    return (f"GET {target} HTTP/1.1\r\nHost: {server.authority}\r\nRange: bytes=0-9\r\n"
            f"Authorization: statereg-hmac t={stamp_text},n={nonce},m={mac}\r\n\r\n").encode()


def test_a_wrong_replayed_or_stale_mac_is_closed_at_once_without_a_thread(
        server: PeerServer) -> None:
    open_peer(server.url, server.secret, TIMEOUT).read_bytes(PATH)
    threads = _peer_threads()
    good = _signed(server, server.secret)
    with socket.create_connection((server.host, server.port)) as sock:
        sock.sendall(good)
        answer = b""
        while not answer.endswith(DATA[:10]) and len(answer) < 4096:
            answer += sock.recv(4096)
        assert answer.startswith(b"HTTP/1.1 206") and answer.endswith(DATA[:10])
    refused = {
        "wrong secret": _signed(server, bytes(32)),
        "replayed": good,  # the same bytes again: its nonce was seen
        "stale": _signed(server, server.secret, stamp=time.time() - 3600),
        "no MAC": f"GET /{PATH} HTTP/1.1\r\nHost: {server.authority}\r\n"
                  "Range: bytes=0-9\r\n\r\n".encode(),
        "a token in the path, as before": f"GET /{'0' * 32}/{PATH} HTTP/1.1\r\n"
                                          f"Host: {server.authority}\r\n\r\n".encode(),
    }
    for why, request in refused.items():
        with socket.create_connection((server.host, server.port)) as sock:
            sock.sendall(request)
            got, elapsed = _closed_within(sock, 2.0)
        assert got.startswith(b"HTTP/1.1 403 Forbidden") and DATA[:10] not in got, why
        assert b"X-Statereg-Proof" not in got and elapsed < 0.3, why
    assert _peer_threads() == threads  # no worker ever ran for them


class _FakePeer:
    """A real socket server that holds the job's secret and answers each request with what
    `answer(nonce, range)` gives: (status, headers, body, seconds between body bytes)."""

    def __init__(self, secret: bytes,
                 answer: Callable[[str, str], tuple[int, dict[str, str], bytes, float]]) -> None:
        self.secret, self.answer = secret, answer
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.listener.settimeout(0.1)
        while not self.stop.is_set():
            try:
                sock, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            threading.Thread(target=self._one, args=(sock,), daemon=True).start()

    def _one(self, sock: socket.socket) -> None:
        with sock, suppress(OSError):  # the client closed it: the lie was caught
            while not self.stop.is_set():
                head = b""
                while b"\r\n\r\n" not in head:
                    data = sock.recv(4096)
                    if not data:
                        return
                    head += data
                lines = head.decode().split("\r\n")
                fields = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
                nonce = fields["Authorization"].split("n=")[1].split(",")[0]
                status, headers, body, pause = self.answer(nonce, fields.get("Range", ""))
                headers.setdefault("Content-Length", str(len(body)))
                proof = _answer_mac(self.secret, nonce, status,
                                    headers.get("Content-Range", ""), headers["Content-Length"])
                text = f"HTTP/1.1 {status} X\r\n" + "".join(
                    f"{k}: {v}\r\n" for k, v in headers.items())
                sock.sendall(f"{text}X-Statereg-Proof: {proof}\r\n\r\n".encode())
                for i in range(len(body)):
                    if self.stop.is_set():
                        return
                    if pause:
                        time.sleep(pause)
                        sock.sendall(body[i:i + 1])
                    else:
                        sock.sendall(body)
                        break

    def close(self) -> None:
        self.stop.set()
        self.listener.close()


def _ranged(first: int, last: int, body: bytes = DATA) -> str:
    return f"bytes {first}-{last}/{len(body)}"


LIES: dict[str, Callable[[str, str], tuple[int, dict[str, str], bytes, float]]] = {
    "the whole file for a range": lambda n, r: (200, {}, DATA, 0.0),
    "a Content-Length of 10**12": lambda n, r: (
        206, {"Content-Range": _ranged(0, 99), "Content-Length": str(10**12)}, b"", 0.0),
    "a negative Content-Length": lambda n, r: (
        206, {"Content-Range": _ranged(0, 99), "Content-Length": "-4"}, b"", 0.0),
    "another Content-Range": lambda n, r: (206, {"Content-Range": _ranged(0, 199)},
                                           DATA[:200], 0.0),
    "a reversed Content-Range": lambda n, r: (206, {"Content-Range": _ranged(99, 0)},
                                              b"", 0.0),
    "a stall: a byte per 0.9 s": lambda n, r: (206, {"Content-Range": _ranged(0, 99)},
                                               DATA[:100], TIMEOUT * 0.9),
}


@pytest.mark.parametrize("lie", sorted(LIES))
def test_a_peer_that_lies_or_stalls_is_a_storage_error_in_bounded_time_and_reads_fall_back(
        lie: str, server: PeerServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakePeer(server.secret, LIES[lie])
    try:
        liar = open_peer(fake.url, server.secret, TIMEOUT)
        started = time.monotonic()
        with pytest.raises(StorageError, match=rf"the peer node at 127\.0\.0\.1:{fake.port} ") \
                as failed:
            liar.read_bytes(PATH, limit=100)  # a bounded read: a manifest's, say
        elapsed = time.monotonic() - started
        # Within the deadline: TIMEOUT plus 1 s per 8 MB received, plus the poll slack.
        assert elapsed < TIMEOUT + 0.5, (lie, elapsed)
        assert "MemoryError" not in str(failed.value)
        # A node whose first peer is the liar reads the file from the next peer.
        monkeypatch.setenv("STATEREG_NODE", "b")
        b = NodeMemoryBackend("shm://run/job", [
            liar, open_peer(server.url, server.secret, TIMEOUT)])
        b._found[PATH] = liar  # the liar answered first that it holds the file
        assert b.read_bytes(PATH, limit=100) == DATA[:100]
    finally:
        fake.close()


def test_a_peer_that_answers_without_the_jobs_proof_is_refused(server: PeerServer) -> None:
    # Another process at the address (the job's server gone, its port taken): not the job's.
    fake = _FakePeer(bytes(32), lambda n, r: (206, {"Content-Range": _ranged(0, 99)},
                                              DATA[:100], 0.0))
    try:
        with pytest.raises(StorageError, match="without this job's proof"):
            open_peer(fake.url, server.secret, TIMEOUT).read_bytes(PATH, limit=100)
    finally:
        fake.close()


def test_the_server_refuses_a_reversed_range_with_416(server: PeerServer) -> None:
    stamp, nonce = f"{time.time():.3f}", secrets.token_hex(16)
    mac = _request_mac(server.secret, "GET", server.authority, f"/{PATH}", "bytes=10-5",
                       stamp, nonce)
    with socket.create_connection((server.host, server.port)) as sock:
        sock.sendall(f"GET /{PATH} HTTP/1.1\r\nHost: {server.authority}\r\n"
                     "Range: bytes=10-5\r\nAuthorization: "
                     f"statereg-hmac t={stamp},n={nonce},m={mac}\r\n\r\n".encode())
        head = sock.recv(4096).decode()
    assert head.startswith("HTTP/1.1 416") and "Content-Length: 0" in head, head
    assert f"Content-Range: bytes */{len(DATA)}" in head


def test_the_server_listens_on_the_peer_address_only(folder: NodeMemoryBackend,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    served = PeerServer(folder)
    try:
        assert served.host == "127.0.0.1"  # $STATEREG_PEER_HOST, not 0.0.0.0
    finally:
        served.close()
    monkeypatch.delenv("STATEREG_PEER_HOST")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # the interface gloo would use
    served = PeerServer(folder)
    try:
        assert served.host == "127.0.0.1"
    finally:
        served.close()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no-such-if0")
    with pytest.raises(StorageError, match=r"\$GLOO_SOCKET_IFNAME names interface "
                       r"'no-such-if0', which has no IPv4 address"):
        PeerServer(folder)
    assert os.environ.get("STATEREG_PEER_HOST") is None
