"""The peer transport's HTTP heads, fuzzed (issue 42): whatever bytes reach either end, the
server answers a bare 400 or 403 (or closes) without a worker thread or a file's byte, and
the client raises FileNotFoundError or a StorageError naming the peer within its deadline,
never another exception, never a hang, never more bytes than it asked for.

The heads are parsed by h11 (statereg/tiers/transport/wire.py); the parsers are fuzzed on
their own, then the real PeerServer and PeerBackend over real sockets: random bytes,
truncated and oversized heads, bad Content-Lengths and Content-Ranges, repeated headers,
answers that carry the job's proof and answers that do not.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import suppress
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statereg.errors import StorageError
from statereg.tiers.node_memory import NodeMemoryBackend
from statereg.tiers.transport import PeerServer, open_peer
from statereg.tiers.transport.wire import (
    MAX_HEAD,
    HeadError,
    answer_mac,
    parse_answer,
    parse_request,
    request_mac,
)

DATA = bytes(range(256)) * 64
PATH = "step_00000001/model/data.bin"
TIMEOUT = 0.3  # the client's deadline in these tests (60 s by default)
FUZZ = settings(max_examples=40, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])

# Header lines as a fuzzer would write them: the names the transport acts on (repeated,
# in any case), with values that are numbers, negative, huge, ranges or junk.
_NAMES = st.sampled_from(["Host", "Range", "Authorization", "Connection", "Content-Length",
                          "content-length", "Content-Range", "X-Statereg-Proof",
                          "Transfer-Encoding", "X-Junk", "Bad Name", ""])
_VALUES = st.one_of(
    st.integers(-10, 10**13).map(str),
    st.sampled_from(["bytes=0-9", "bytes=9-0", "bytes 0-99/16384", "bytes */5", "chunked",
                     "close", "statereg-hmac t=1.000,n=00,m=00", "", " ", "\x00", "\x7f"]),
    st.text(st.characters(min_codepoint=0, max_codepoint=255), max_size=40),
    # A MAC or proof of the right length in any latin-1 text (hmac.compare_digest raises
    # TypeError on non-ASCII text).
    st.text(st.characters(min_codepoint=32, max_codepoint=255), min_size=64, max_size=64).map(
        lambda mac: f"statereg-hmac t=1.000,n={'0' * 32},m={mac}"),
    st.text(st.characters(min_codepoint=32, max_codepoint=255), min_size=64, max_size=64),
)
_LINES = st.lists(st.tuples(_NAMES, _VALUES).map(lambda nv: f"{nv[0]}: {nv[1]}"),
                  max_size=8)


def _bytes(text: str) -> bytes:
    return text.encode("latin-1", "replace")


@given(raw=st.one_of(st.binary(max_size=MAX_HEAD + 64),
                     st.builds(lambda first, lines: _bytes("\r\n".join([first, *lines])),
                               st.sampled_from(["GET / HTTP/1.1", "HEAD /x HTTP/1.0",
                                                "GET /x HTTP/2", "get / http/1.1", "GET",
                                                "POST /x HTTP/1.1", " GET /x HTTP/1.1"]),
                               _LINES)))
@FUZZ
def test_a_request_head_parses_or_is_none_and_nothing_else(raw: bytes) -> None:
    parsed = parse_request(raw)
    if parsed is not None:
        method, target, headers = parsed
        assert isinstance(method, str) and isinstance(target, str)
        assert all(name == name.lower() for name in headers)
        assert len(raw) <= MAX_HEAD


def test_the_request_heads_the_server_refuses() -> None:
    host = "Host: 127.0.0.1:1"
    assert parse_request(_bytes(f"GET /x HTTP/1.1\r\n{host}\r\nRange: bytes=0-9")) == (
        "GET", "/x", {"host": "127.0.0.1:1", "range": "bytes=0-9"})
    refused = {
        "no Host (HTTP/1.1 requires one)": "GET /x HTTP/1.1\r\nRange: bytes=0-9",
        "two Ranges": f"GET /x HTTP/1.1\r\n{host}\r\nRange: bytes=0-9\r\nRange: bytes=0-99",
        "two Authorizations": f"GET /x HTTP/1.1\r\n{host}\r\nAuthorization: a\r\n"
                              "Authorization: b",
        "a line without a colon": f"GET /x HTTP/1.1\r\n{host}\r\nRange bytes=0-9",
        "not HTTP": "hello",
        "too long": f"GET /x HTTP/1.1\r\n{host}\r\nX-Junk: {'a' * MAX_HEAD}",
    }
    for why, text in refused.items():
        assert parse_request(_bytes(text)) is None, why


@given(raw=st.one_of(st.binary(max_size=MAX_HEAD + 64),
                     st.builds(lambda first, lines: _bytes("\r\n".join([first, *lines])),
                               st.sampled_from(["HTTP/1.1 206 X", "HTTP/1.1 200 OK",
                                                "HTTP/1.1 100 Continue", "HTTP/1.0 404 N",
                                                "HTTP/9 206 X", "HTTP/1.1 99999 X",
                                                "HTTP/1.1 -1 X", "ICY 200 OK"]),
                               _LINES)),
       method=st.sampled_from(["GET", "HEAD"]))
@FUZZ
def test_an_answer_head_parses_or_is_a_head_error_and_nothing_else(raw: bytes,
                                                                   method: str) -> None:
    try:
        status, headers = parse_answer(raw, method)
    except HeadError as exc:
        assert str(exc)  # says what is wrong, for the peer's StorageError
        return
    assert 200 <= status <= 999 and all(name == name.lower() for name in headers)
    length = headers.get("content-length")
    assert length is None or length.isdigit()  # h11 refuses any other Content-Length


# -- the real server -----------------------------------------------------------------------


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[PeerServer]:
    monkeypatch.setenv("STATEREG_SHM_DIR", str(tmp_path))
    monkeypatch.setenv("STATEREG_PEER_HOST", "127.0.0.1")
    monkeypatch.setenv("STATEREG_NODE", "a")
    folder = NodeMemoryBackend("shm://run/job")
    folder.write_bytes(PATH, DATA)
    served = PeerServer(folder, max_pending=4, max_connections=4, head_deadline=0.5)
    yield served
    served.close()


def _peer_threads() -> int:
    return sum(t.name.startswith("statereg-peer") for t in threading.enumerate())


def _exchange(server: PeerServer, data: bytes, seconds: float = 2.0) -> tuple[bytes, float]:
    """Send `data`, then read until the server closes: what it sent, and how long."""
    started = time.monotonic()
    with socket.create_connection((server.host, server.port)) as sock:
        with suppress(OSError):  # the server may close before it has read it all
            sock.sendall(data)
        sock.settimeout(seconds)
        got = b""
        with suppress(ConnectionResetError):
            while chunk := sock.recv(4096):
                got += chunk
    return got, time.monotonic() - started


def _signed_get(server: PeerServer, extra: list[str]) -> str:
    """A request with the job's MAC for `bytes=0-9`, and `extra` header lines after it."""
    stamp, nonce = f"{time.time():.3f}", secrets.token_hex(16)
    mac = request_mac(server.secret, "GET", server.authority, f"/{PATH}", "bytes=0-9", stamp,
                      nonce)
    return "\r\n".join([f"GET /{PATH} HTTP/1.1", f"Host: {server.authority}",
                        "Range: bytes=0-9",
                        f"Authorization: statereg-hmac t={stamp},n={nonce},m={mac}", *extra])


def test_fuzzed_request_heads_get_a_bare_400_or_403_from_the_selector_thread(
        server: PeerServer) -> None:
    reader = open_peer(server.url, server.secret, 2.0)
    assert reader.read_bytes(PATH, limit=10) == DATA[:10]  # one worker thread exists now
    threads = _peer_threads()

    @given(head=st.one_of(
        st.binary(max_size=512).filter(lambda b: b"\r\n\r\n" not in b),
        st.builds(lambda first, lines: _bytes("\r\n".join([first, *lines])),
                  st.sampled_from([f"GET /{PATH} HTTP/1.1", f"HEAD /{PATH} HTTP/1.0",
                                   "GET / HTTP/1.1", f"DELETE /{PATH} HTTP/1.1"]), _LINES),
        # The job's own MAC, then repeated or junk headers: still never served.
        st.builds(lambda lines: _bytes(_signed_get(server, ["Range: bytes=0-99", *lines])),
                  _LINES)))
    @FUZZ
    def check(head: bytes) -> None:
        got, elapsed = _exchange(server, head + b"\r\n\r\n")
        assert got == b"" or got.startswith((b"HTTP/1.1 400 ", b"HTTP/1.1 403 ")), got[:80]
        assert b"X-Statereg-Proof" not in got and DATA[:10] not in got
        assert elapsed < 0.5, elapsed  # closed at once, not at the head deadline

    check()
    assert _peer_threads() == threads  # no worker ran for any of them
    assert reader.read_bytes(PATH) == DATA  # and the job's reads go on


def test_a_mac_in_non_ascii_text_is_a_403_and_the_server_goes_on(server: PeerServer) -> None:
    # hmac.compare_digest raises TypeError on non-ASCII text: before the MAC had to be hex,
    # this one unauthenticated request ended the selector thread, and the server with it.
    stamp, nonce = f"{time.time():.3f}", secrets.token_hex(16)
    head = (f"GET /{PATH} HTTP/1.1\r\nHost: {server.authority}\r\nAuthorization: "
            f"statereg-hmac t={stamp},n={nonce},m={chr(0xE9) * 64}\r\n\r\n")
    got, _ = _exchange(server, _bytes(head))
    assert got.startswith(b"HTTP/1.1 403 Forbidden")
    assert open_peer(server.url, server.secret, 2.0).read_bytes(PATH) == DATA


@pytest.mark.parametrize("head", ["truncated", "oversized", "oversized, then ended"])
def test_truncated_and_oversized_request_heads_are_closed_without_an_answer(
        server: PeerServer, head: str) -> None:
    whole = _bytes(_signed_get(server, [])) + b"\r\n\r\n"
    data = {"truncated": whole[:len(whole) // 2],
            "oversized": b"GET /" + b"a" * (2 * MAX_HEAD),
            "oversized, then ended": b"GET /" + b"a" * (2 * MAX_HEAD) + b"\r\n\r\n"}[head]
    got, elapsed = _exchange(server, data)
    # A truncated head waits for the rest until the head deadline; an oversized one is
    # dropped as soon as it passes the cap: nothing is answered to either.
    assert got == b"" and elapsed < 0.5 + 0.3, (got[:80], elapsed)
    assert open_peer(server.url, server.secret, 2.0).read_bytes(PATH) == DATA


# -- the real client ------------------------------------------------------------------------


class _Liar:
    """A real socket server that reads each request head, answers with what `answer(nonce)`
    gives (raw bytes) and closes the connection."""

    def __init__(self) -> None:
        self.answer: Callable[[str], bytes] = lambda nonce: b""
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:  # closed
                return
            with sock, suppress(OSError):
                head = b""
                while b"\r\n\r\n" not in head:
                    data = sock.recv(4096)
                    if not data:
                        break
                    head += data
                nonce = head.split(b",n=", 1)[-1].split(b",", 1)[0].decode()
                sock.sendall(self.answer(nonce))

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def liar() -> Iterator[_Liar]:
    served = _Liar()
    yield served
    served.close()


SECRET = bytes(range(32))


def _answer(status: int, lines: list[str], proof: bool, body: bytes,
            ) -> Callable[[str], bytes]:
    """An answer head with `lines` and, where `proof`, the job's proof over the first
    Content-Range and Content-Length among them (as a peer that holds the secret would)."""
    def first(name: str) -> str:
        return next((line.split(": ", 1)[1] for line in lines
                     if line.lower().startswith(f"{name.lower()}: ")), "")

    def head(nonce: str) -> bytes:
        mac = answer_mac(SECRET, nonce, status, first("Content-Range"),
                         first("Content-Length"))
        proven = [*lines, f"X-Statereg-Proof: {mac}"] if proof else lines
        return _bytes("\r\n".join([f"HTTP/1.1 {status} X", *proven])) + b"\r\n\r\n" + body
    return head


def _read(url: str, limit: int = 100) -> tuple[bytes | None, BaseException | None, float]:
    started = time.monotonic()
    try:
        got: bytes | None = open_peer(url, SECRET, TIMEOUT).read_bytes(PATH, limit=limit)
        failure: BaseException | None = None
    except (StorageError, FileNotFoundError) as exc:
        got, failure = None, exc
    return got, failure, time.monotonic() - started


def test_fuzzed_answers_are_a_storage_error_naming_the_peer_in_bounded_time(
        liar: _Liar) -> None:
    @given(answer=st.one_of(
        st.binary(max_size=600).map(lambda raw: lambda nonce: raw),
        st.builds(_answer, st.sampled_from([200, 206, 206, 206, 404, 416, 100, 302, 999]),
                  st.lists(st.one_of(
                      st.just("Content-Range: bytes 0-99/16384"),
                      st.just("Content-Length: 100"),
                      st.tuples(_NAMES, _VALUES).map(lambda nv: f"{nv[0]}: {nv[1]}")),
                      max_size=6),
                  st.booleans(), st.binary(max_size=300))))
    @FUZZ
    def check(answer: Callable[[str], bytes]) -> None:
        liar.answer = answer
        got, failure, elapsed = _read(liar.url)
        assert elapsed < TIMEOUT + 0.5, elapsed  # never a hang
        if failure is None:
            assert got is not None and len(got) <= 100  # never more than asked
        elif isinstance(failure, StorageError):
            assert f"the peer node at 127.0.0.1:{liar.port} " in str(failure), failure
            assert f"{liar.url}/{PATH}" in str(failure)

    check()


def test_bytes_past_the_asked_range_are_never_read_into_the_answer(liar: _Liar) -> None:
    # A peer with the job's proof that sends more than it announced: the read is exactly
    # what was asked, and the connection, holding bytes of no request, is not kept.
    liar.answer = _answer(206, ["Content-Range: bytes 0-99/16384", "Content-Length: 100"],
                          True, DATA[:100] + b"more than was asked" * 100)
    peer = open_peer(liar.url, SECRET, TIMEOUT)
    assert peer.read_bytes(PATH, limit=100) == DATA[:100]
    assert peer._idle == []


def test_a_proof_in_non_ascii_text_is_a_storage_error_naming_the_peer(liar: _Liar) -> None:
    liar.answer = _answer(206, ["Content-Range: bytes 0-99/16384", "Content-Length: 100",
                                f"X-Statereg-Proof: {chr(0xE9) * 64}"], False, DATA[:100])
    _, failure, _ = _read(liar.url)
    assert isinstance(failure, StorageError), failure
    assert f"the peer node at 127.0.0.1:{liar.port} answered what was not asked" in str(
        failure) and "without this job's proof" in str(failure)


@pytest.mark.parametrize("cut", ["head cut short", "head past the cap", "body cut short",
                                 "nothing"])
def test_a_truncated_or_oversized_answer_is_a_storage_error_naming_the_peer(
        liar: _Liar, cut: str) -> None:
    good = _answer(206, ["Content-Range: bytes 0-99/16384", "Content-Length: 100"], True,
                   DATA[:100])
    liar.answer = {
        "head cut short": lambda nonce: good(nonce)[:40],
        "head past the cap": lambda nonce: b"HTTP/1.1 206 X\r\nX-Junk: " + b"a" * 2 * MAX_HEAD,
        "body cut short": lambda nonce: good(nonce)[:-10],
        "nothing": lambda nonce: b"",
    }[cut]
    _, failure, elapsed = _read(liar.url)
    what = {"head cut short": "an answer head cut short",
            "head past the cap": f"an answer head longer than {MAX_HEAD} bytes",
            "body cut short": "stopped sending it at byte 90",
            "nothing": "did not answer"}[cut]
    assert isinstance(failure, StorageError) and what in str(failure), (cut, failure)
    assert f"the peer node at 127.0.0.1:{liar.port} " in str(failure)
    assert elapsed < TIMEOUT + 0.5
