"""The peer store: another node's memory folder read through its PeerServer, read-only.

A `PeerBackend` sends authenticated GET (one byte range) and HEAD requests over kept-alive
connections, requires exactly the status and `Content-Range` it asked for and never more
bytes than it asked for, and bounds each request with one deadline for the whole exchange
(head and body): `timeout` seconds plus one second per `_MIN_RATE` bytes received, so a
peer that lies or trickles costs bounded time and is a StorageError naming it. It only
reads: it has no write, delete or listing operation to refuse (each node writes its own
folder; the nodes' inventories travel over the process group, never through a peer).
"""

from __future__ import annotations

import bisect
import hmac
import io
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import IO, Any, NoReturn
from urllib.parse import quote, urlsplit

from statereg import env
from statereg.errors import StorageError
from statereg.tiers.transport.address import PEER_HOST_ENV
from statereg.tiers.transport.wire import (
    CONTENT_RANGE,
    HEX,
    MAX_HEAD,
    UNSATISFIABLE,
    HeadError,
    answer_mac,
    authority,
    kernel_timeouts,
    parse_answer,
    request_head,
    request_mac,
)

# Seconds a peer may take for a request before it counts as gone (plus 1 s per _MIN_RATE
# bytes it sent); tests set it low.
PEER_TIMEOUT_ENV = env.PEER_TIMEOUT_S
_TIMEOUT = 60.0
# A peer must keep up this many bytes per second (after the first `timeout` seconds) or
# its request ends: an honest node sends at network speed, a trickle is a stall.
_MIN_RATE = 8e6
# Idle connections a PeerBackend keeps open to its peer (one per reading thread suffices).
_KEPT_CONNECTIONS = 8
# Reads smaller than this (a record's header, framing) are served from one block fetched at
# once; larger ones (tensors) go from the socket straight into the caller's buffer.
_SMALL = 64 * 1024


class _Stalled(Exception):
    """The request's deadline passed."""


class _Lie(Exception):
    """The answer is not one the request allows."""


class _Closed(ConnectionError):
    """The peer closed the connection."""


class _Connection:
    """One socket to a peer, blocking with the kernel's timeouts set to what is left of the
    request's deadline (re-set at most every 50 ms): receives go straight into the caller's
    buffer with no poll between them, and no pattern of sends outlives the deadline."""

    def __init__(self, address: tuple[str, int], seconds: float) -> None:
        self.sock = socket.create_connection(address, timeout=max(seconds, 0.001))
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.pending = bytearray()  # bytes received past the head
        self._set_at = -1.0

    def close(self) -> None:
        self.sock.close()

    def _bound(self, deadline: float) -> None:
        now = time.monotonic()
        if now >= deadline:
            raise _Stalled
        if now - self._set_at > 0.05 or deadline - now < 0.05:
            kernel_timeouts(self.sock, deadline - now)
            self._set_at = now

    def send(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            self._bound(deadline)
            try:
                view = view[self.sock.send(view):]
            except (BlockingIOError, TimeoutError):
                continue

    def recv_into(self, view: memoryview, deadline: Callable[[], float]) -> int:
        """Some bytes into `view` (at least one); `deadline()` is re-read as bytes arrive."""
        if self.pending:
            got = min(len(view), len(self.pending))
            view[:got] = self.pending[:got]
            del self.pending[:got]
            return got
        while True:
            self._bound(deadline())
            try:
                got = self.sock.recv_into(view)
            except (BlockingIOError, TimeoutError):
                continue
            if not got:
                raise _Closed("the peer closed the connection")
            return got

    def read_head(self, deadline: float) -> bytes:
        buffer = bytearray()
        chunk = memoryview(bytearray(4096))
        while b"\r\n\r\n" not in buffer:
            if len(buffer) > MAX_HEAD:
                raise _Lie(f"an answer head longer than {MAX_HEAD} bytes")
            try:
                got = self.recv_into(chunk, lambda: deadline)
            except _Closed:
                if buffer:
                    raise _Lie("an answer head cut short") from None
                raise
            buffer += chunk[:got]
        head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
        self.pending = bytearray(rest)
        return head


class _Answer:
    """The answer to one request: its status, headers and body bytes still to read."""

    def __init__(self, connection: _Connection, status: int, headers: dict[str, str],
                 length: int, started: float, timeout: float) -> None:
        self.connection = connection
        self.status = status
        self.headers = headers
        self.length = length
        self.left = length
        self._started, self._timeout = started, timeout

    def deadline(self) -> float:
        """The request's end: `timeout` s, plus 1 s for each _MIN_RATE bytes received."""
        return self._started + self._timeout + (self.length - self.left) / _MIN_RATE

    def readinto(self, view: memoryview) -> int:
        """Body bytes into `view` (at least one while any is left; 0 at its end)."""
        if not self.left or not view:
            return 0
        got = self.connection.recv_into(view[:self.left], self.deadline)
        self.left -= got
        return got


class PeerBackend:
    """Another node's memory folder, read through its PeerServer: a read-only store.

    `url` is the server's, http://HOST:PORT, and `secret` the job's. Requests go over
    keep-alive connections, of which up to `_KEPT_CONNECTIONS` wait idle for the next
    request; bodies go from the socket into the caller's buffer. A file the peer lacks is
    FileNotFoundError, as on any backend; a peer that is down, busy past the deadline,
    stalls, answers what was not asked or refuses the request is a StorageError naming the
    peer and the file. `timeout` (default $STATEREG_PEER_TIMEOUT_S, else 60 s) bounds each
    request, plus 1 s per _MIN_RATE bytes it received.

    It is what NodeMemoryBackend (tiers/node_memory.py) falls back to for a file its node
    lacks: a `backends.stores.ReadOnlyStore`, as every StorageBackend is (`exists`, `size`,
    `read_bytes`, `read_range`, `open_read`, `open_ranges`, `open_blocks`), with no write
    or delete to refuse. It is not a whole `stores.ReadableStore`: a load reads through the
    node's NodeMemoryBackend (which is one), never through a peer, and a peer's server
    lists nothing.
    """

    def __init__(self, url: str, secret: bytes, timeout: float | None = None) -> None:
        self._secret = secret
        if timeout is None:
            timeout = env.peer_timeout_s(_TIMEOUT)
        self.timeout = timeout
        self.url = url.rstrip("/") or url
        self._address, self._authority = self._server(self.url)
        self._idle: list[_Connection] = []
        self._idle_lock = threading.Lock()

    def _server(self, url: str) -> tuple[tuple[str, int], str]:
        """The server's address and authority (HOST:PORT) in `url`, which must be
        http://HOST:PORT and nothing more."""
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.scheme != "http" or not parts.hostname or port is None or \
                parts.path.strip("/"):
            raise StorageError(f"{self.display()} is not a peer server's URL: expected "
                               "http://HOST:PORT, as PeerServer.url gives")
        return (parts.hostname, port), authority(parts.hostname, port)

    def display(self, path: str = "") -> str:
        """The file's URL on the peer, for messages (the secret is never in it)."""
        return f"{self.url.rstrip('/')}/{path}" if path else self.url

    def _peer(self) -> str:
        return self._authority

    # -- requests -----------------------------------------------------------------------

    def ping(self) -> None:
        """One authenticated request for nothing: proves this node reaches the peer's server
        and that the server holds the job's secret (StorageError otherwise)."""
        answer = self._request("HEAD", "")
        self._release(answer)

    def _request(self, method: str, path: str, start: int = 0, end: int | None = None,
                 ) -> _Answer:
        """Send one request for `path` (GET: bytes [start, end), to the file's end where
        `end` is None) and check its answer: a GET's is 206 with exactly the range asked (or
        as much of it as the file holds), or 416 when the file ends before `start` (an empty
        body); a HEAD's is 200. Raises FileNotFoundError (404), StorageError otherwise.

        A kept connection that the server has closed since is replaced; a server at its
        connection cap is asked again until the deadline."""
        if end is not None and end <= start:
            raise StorageError(f"reading {self.display(path)}: the range {start}-{end} is "
                               "empty or reversed (a bug in the caller)")
        target = "/" + quote(path)
        wanted = "" if method == "HEAD" else f"bytes={start}-{'' if end is None else end - 1}"
        started = time.monotonic()
        deadline = started + self.timeout
        pause = 0.01
        while True:
            with self._idle_lock:
                kept = self._idle.pop() if self._idle else None
            try:
                connection = kept or _Connection(self._address, deadline - time.monotonic())
            except OSError as exc:
                raise self._gone(path, exc) from exc
            stamp, nonce = f"{time.time():.3f}", secrets.token_hex(16)
            mac = request_mac(self._secret, method, self._authority, target, wanted, stamp,
                              nonce)
            head = request_head(method, target, self._authority,
                                f"t={stamp},n={nonce},m={mac}", wanted)
            try:
                connection.send(head, deadline)
                raw = connection.read_head(deadline)
            except _Stalled:
                connection.close()
                raise self._gone(path, TimeoutError(), None) from None
            except _Lie as exc:
                connection.close()
                raise self._lie(path, str(exc)) from None
            except OSError as exc:  # closed before any answer (_Closed), reset, ...
                connection.close()
                if kept is not None:
                    continue  # the server closed it while idle: a new one
                if isinstance(exc, _Closed) and time.monotonic() + pause < deadline:
                    time.sleep(pause)  # dropped unanswered: its pending pool was full
                    pause = min(pause * 2, 1.0)
                    continue
                raise self._gone(path, exc) from exc
            answer = self._check(connection, raw, method, path, nonce, start, end, started)
            if answer is not None:
                return answer
            if time.monotonic() + pause >= deadline:  # 503 at every try
                raise StorageError(
                    f"reading {self.display(path)} failed: the peer node at {self._peer()} "
                    f"stayed at its cap of connections for {self.timeout:.0f} s; restore "
                    "from storage.url")
            time.sleep(pause)
            pause = min(pause * 2, 1.0)

    def _check(self, connection: _Connection, raw: bytes, method: str, path: str, nonce: str,
               start: int, end: int | None, started: float) -> _Answer | None:
        """The answer, if it is one the request allows; None for a proven 503 (busy)."""
        def lie(what: str) -> NoReturn:
            connection.close()
            raise self._lie(path, what)

        try:
            status, headers = parse_answer(raw, method)
        except HeadError as exc:
            lie(str(exc))
        length_text = headers.get("content-length", "")
        content_range = headers.get("content-range", "")
        proof = headers.get("x-statereg-proof", "")
        if not proof and status == 403:
            connection.close()
            raise StorageError(
                f"reading {self.display(path)} failed: the peer node at {self._peer()} "
                "refused the request (HTTP 403): its MAC is not one of this job's (another "
                "job's server at that address?), or its time differs from the server's "
                "clock by more than 5 minutes. Start every rank of the job together and keep "
                "the nodes' clocks synchronized, or restore from storage.url")
        expected = answer_mac(self._secret, nonce, status, content_range, length_text)
        # compare_digest refuses non-ASCII text (a TypeError): a proof is hex or no proof.
        if not (HEX.match(proof) and hmac.compare_digest(expected, proof)):
            lie(f"an answer (HTTP {status}) without this job's proof: another process at "
                "that address?")
        if not length_text.isdigit():
            lie(f"Content-Length {length_text!r}")
        length = int(length_text)
        if status in (503, 404, 403) or method == "HEAD":
            if status != 200 and length:
                lie(f"a body of {length} bytes with HTTP {status}")
            if status == 503:
                connection.close()
                return None
            answer = _Answer(connection, status, headers, 0, started, self.timeout)
            if status == 404:
                self._release(answer)
                raise FileNotFoundError(f"{self.display(path)} is not in the peer node's "
                                        "memory")
            if status == 403:
                self._release(answer)
                raise StorageError(
                    f"reading {self.display(path)} failed: the peer node at {self._peer()} "
                    "refused it (HTTP 403): the file there is a link or a special file; "
                    "restore from storage.url")
            if status != 200:
                lie(f"HTTP {status} to a HEAD request")
            answer.length = length  # the file's size; no body follows a HEAD
            return answer
        asked = f"bytes {start}-{'' if end is None else end - 1}"
        if status == 416:
            unsatisfiable = UNSATISFIABLE.match(content_range)
            if length or unsatisfiable is None or int(unsatisfiable.group(1)) > start:
                lie(f"HTTP 416 with Content-Range {content_range!r} to {asked}")
            return _Answer(connection, status, headers, 0, started, self.timeout)
        if status != 206:
            lie(f"HTTP {status} to a request for {asked} (206 with that range expected)")
        found = CONTENT_RANGE.match(content_range)
        if found is None:
            lie(f"Content-Range {content_range!r} to a request for {asked}")
        first, last, total = (int(found.group(i)) for i in (1, 2, 3))
        stop = total if end is None else min(end, total)
        if first != start or last != stop - 1 or length != last - first + 1:
            lie(f"Content-Range {content_range!r} and Content-Length {length} to a request "
                f"for {asked}")
        return _Answer(connection, status, headers, length, started, self.timeout)

    def _release(self, answer: _Answer) -> None:
        """Keep the answer's connection for the next request if its body was read whole."""
        if not answer.left and not answer.connection.pending:
            with self._idle_lock:
                if len(self._idle) < _KEPT_CONNECTIONS:
                    self._idle.append(answer.connection)
                    return
        answer.connection.close()

    def _lie(self, path: str, what: str) -> StorageError:
        return StorageError(
            f"reading {self.display(path)} failed: the peer node at {self._peer()} answered "
            f"what was not asked ({what}); its answer is not used. Restore from storage.url")

    def _gone(self, path: str, error: BaseException, at: int | None = None) -> StorageError:
        """The error of a peer that did not answer, or (`at`: the file offset it had reached)
        stopped sending."""
        what = "did not answer" if at is None else f"stopped sending it at byte {at}"
        if isinstance(error, (TimeoutError, BlockingIOError, _Stalled)):
            detail = (f"the request's deadline of {self.timeout:g} s (plus 1 s per "
                      f"{_MIN_RATE / 1e6:.0f} MB received) passed")
        else:
            detail = f"{type(error).__name__}: {error}"
        return StorageError(
            f"reading {self.display(path)} failed: the peer node at {self._peer()} {what} "
            f"({detail}). The node is down, its server stopped, or it "
            f"cannot be reached from this host (${PEER_HOST_ENV} on it names its address); "
            "bring it back, or restore from storage.url")

    # -- reading ------------------------------------------------------------------------

    def read_range(self, path: str, start: int, end: int | None) -> bytes:
        """Bytes [start, end) of the file (to its end where `end` is None), in one GET.
        Where `end` is None the buffer grows as bytes arrive, never to a length the peer
        only claims."""
        if end is not None and end <= start:
            return b""
        answer = self._request("GET", path, start, end)
        if end is not None:
            body = bytearray(answer.length)  # at most end - start: checked
            view, done = memoryview(body), 0
            while done < len(body):
                done += self._readinto(path, answer, view[done:], start + done)
        else:
            body = bytearray()
            chunk = memoryview(bytearray(min(answer.length, 4 << 20)))
            while answer.left:
                got = self._readinto(path, answer, chunk, start + len(body))
                body += chunk[:got]
        self._release(answer)
        return bytes(body)

    def _readinto(self, path: str, answer: _Answer, view: memoryview, at: int) -> int:
        """`answer.readinto(view)`, `at` being the file offset of its next byte; a broken
        or stalled answer (its connection then closed) is the peer's StorageError."""
        try:
            return answer.readinto(view)
        except (OSError, _Stalled) as exc:
            answer.connection.close()
            raise self._gone(path, exc, at) from None

    def read_bytes(self, path: str, limit: int | None = None) -> bytes:
        """The whole file (at most its first `limit` bytes), in one GET."""
        return self.read_range(path, 0, limit)

    # The streams are a seekable io.RawIOBase (read, readinto, seek, tell): the IO[bytes] a
    # StorageBackend's streams are to their readers, which typeshed does not see.

    @contextmanager
    def open_read(self, path: str, size: int | None = None) -> Iterator[IO[bytes]]:
        """A seekable stream over the whole file (`size`, if known, spares a HEAD)."""
        with _PeerReads(self, path, None, size) as stream:
            yield stream  # type: ignore[misc]

    @contextmanager
    def open_ranges(self, path: str, ranges: Sequence[tuple[int, int]],
                    size: int | None = None) -> Iterator[IO[bytes]]:
        """A seekable stream over the file whose GETs stop at the ends of `ranges`."""
        with _PeerReads(self, path, ranges, size) as stream:
            yield stream  # type: ignore[misc]

    @contextmanager
    def open_blocks(self, path: str) -> Iterator[IO[bytes]]:
        """The whole file as it is read; FileNotFoundError here if the peer lacks it."""
        with _PeerReads(self, path, None, self.size(path)) as stream:
            yield stream  # type: ignore[misc]

    def size(self, path: str) -> int:
        answer = self._request("HEAD", path)
        self._release(answer)
        return answer.length

    def exists(self, path: str) -> bool:
        try:
            self.size(path)
        except FileNotFoundError:
            return False
        return True


class _PeerReads(io.RawIOBase):
    """A seekable, read-only stream of a file on a peer, fetched by ranged GETs as it is read.

    `runs` (the sorted (start, end) runs a reader will use; None: the whole file) bound each
    GET: a read asks for the rest of the run holding its position (outside every run, for
    what it reads), and the reads after it take that response's bytes as they arrive,
    straight into their own buffers; a seek elsewhere ends the response. A read under
    `_SMALL` bytes is served from a block of the response kept here, so a record's header,
    read, then hashed again, costs no second request. Bytes past the end of the file (or of
    a short file) read as its end, as from any stream. (It keeps its position as
    backends.base.PositionedReads does, whose streams belong to a StorageBackend.)
    """

    def __init__(self, peer: PeerBackend, path: str,
                 runs: Sequence[tuple[int, int]] | None, size: int | None) -> None:
        super().__init__()
        self._peer, self._path, self._size = peer, path, size
        self._pos = 0
        self._runs = sorted(runs) if runs is not None else None
        self._starts = [start for start, _ in self._runs or []]
        self._block_start, self._block = 0, memoryview(b"")
        self._answer: _Answer | None = None
        self._next = 0  # the file offset of the answer's next byte

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_END:
            if self._size is None:
                self._size = self._peer.size(self._path)
            offset += self._size
        elif whence == io.SEEK_CUR:
            offset += self._pos
        self._pos = max(0, offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        """Fill `buffer` from the position: fewer bytes only where the file ends."""
        view = memoryview(buffer).cast("B")
        done = 0
        while done < len(view):
            got = self._read_some(view[done:])
            if not got:
                break
            done += got
            self._pos += got
        return done

    def _read_some(self, view: memoryview) -> int:
        at = self._pos - self._block_start
        if not 0 <= at < len(self._block):
            if len(view) >= _SMALL:
                return self._receive(view)
            block = memoryview(bytearray(_SMALL))
            self._block_start, self._block, at = self._pos, block[:self._receive(block)], 0
        got = min(len(view), len(self._block) - at)
        view[:got] = self._block[at:at + got]
        return got

    def _receive(self, view: memoryview) -> int:
        """Bytes at the position from the response carrying them (a new GET where none is
        at the position or it has ended); 0 at the end of the file."""
        if self._answer is not None and (self._next != self._pos or not self._answer.left):
            self._end_response()
        if self._answer is None:
            if self._size is not None and self._pos >= self._size:
                return 0
            self._answer = self._peer._request("GET", self._path, self._pos,
                                               self._run_end(len(view)))
            self._next = self._pos
            if not self._answer.left:  # 416: the file ends before the position
                self._end_response()
                return 0
        try:
            got = self._peer._readinto(self._path, self._answer, view, self._next)
        except StorageError:
            self._answer = None  # closed: it broke mid-answer
            raise
        self._next += got
        return got

    def _run_end(self, wanted: int) -> int | None:
        """Where a GET from the position stops: the end of its run (None: the file's)."""
        if self._runs is None:
            return self._size
        index = bisect.bisect_right(self._starts, self._pos) - 1
        if index >= 0 and self._pos < self._runs[index][1]:
            end = self._runs[index][1]
        else:
            end = self._pos + max(wanted, _SMALL)
        return end if self._size is None else min(end, self._size)

    def _end_response(self) -> None:
        """Keep the connection if its response was read to the end, else close it."""
        if self._answer is not None:
            self._peer._release(self._answer)
        self._answer = None

    def close(self) -> None:
        self._end_response()
        super().close()


def open_peer(url: str, secret: bytes, timeout: float | None = None) -> PeerBackend:
    """A PeerBackend for a PeerServer's url and the job's secret (StorageError if `url` is
    not a server's)."""
    return PeerBackend(url, secret, timeout)
