"""The transport between nodes' memory tiers: a read-only file server per node, and the
client that reads another node's folder through it (tiers/node_memory.py falls back to it).

A memory checkpoint of a job on several nodes lives in several node folders: each node holds
the files its own ranks wrote and, with `tiers.memory.replicate`, a copy of its previous
node's files (docs/tiers.md). A rank that loads, or rank 0 that drains to storage.url, may
need a file of another node; that node's leader serves its folder over HTTP (stdlib
`ThreadingHTTPServer`, GET and HEAD with byte ranges, sent with `sendfile`), and
`NodeMemoryBackend` falls back to it, through `PeerBackend`, for whatever this node lacks.
`PeerBackend` is a small stdlib `http.client` client: keep-alive connections pooled per peer,
ranged GETs, and bodies read with `readinto` straight into the caller's buffer, so a tensor
read from a peer is one copy from the socket into the tensor (fsspec's aiohttp filesystem,
used before, read a large file at under a third of the rate: docs/performance.md). Every byte
read that way is checked against the manifest like any other read, so a peer can fail a
load but never slip a wrong byte into it.

The server answers only paths under `/<token>/`, where the token is a random secret the job
shares over its process group; it never lists, writes, follows a link, or leaves its folder
(it opens files the way `LocalBackend` does, one component at a time with O_NOFOLLOW).
"""

from __future__ import annotations

import bisect
import hmac
import os
import re
import secrets
import socket
import struct
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from http import HTTPStatus
from http.client import HTTPConnection, HTTPException, HTTPResponse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar, NoReturn
from urllib.parse import quote, unquote, urlsplit

from statereg.backends.base import PositionedReads, StorageBackend, StoredFile
from statereg.backends.shm import SharedMemoryBackend
from statereg.errors import StorageError

PEER_HOST_ENV = "STATEREG_PEER_HOST"
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")
# Seconds a peer may take to accept, answer or send more bytes before it counts as gone.
_TIMEOUT = 60.0
# Seconds the server keeps an idle keep-alive connection (a reader that vanished frees its
# thread); the client retries once on a fresh connection when a kept one was closed.
_SERVER_IDLE = 300.0
# Idle connections a PeerBackend keeps open to its peer (one per reading thread suffices).
_KEPT_CONNECTIONS = 8
# Reads smaller than this (a record's header, framing) are served from one block fetched at
# once; larger ones (tensors) go from the socket straight into the caller's buffer.
_SMALL = 64 * 1024
# How often the server's loop looks for a shutdown request: `close()` waits up to this.
_POLL = 0.05


def _kernel_timeouts(connection: socket.socket, seconds: float) -> None:
    """Make a blocking socket's sends and receives fail (EAGAIN) after `seconds` without
    progress, as SO_SNDTIMEO / SO_RCVTIMEO do, leaving it blocking for Python."""
    value = struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


def peer_host() -> str:
    """The address this node's server listens on and peers reach it at: $STATEREG_PEER_HOST,
    else the address the host name resolves to."""
    given = os.environ.get(PEER_HOST_ENV)
    if given:
        return given
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    # The headers and the body leave in two sends: with Nagle's algorithm the body of a
    # small file waits for the ACK of the headers, which the reader delays by 40 ms
    # (measured: 42 ms per manifest read, a third of a peer restore).
    disable_nagle_algorithm = True

    def setup(self) -> None:
        super().setup()
        # A blocking socket with the kernel's timeouts: sendfile sends a whole body in one
        # call (a Python-level timeout makes the socket non-blocking, one poll per send
        # buffer: a third of the rate measured here), yet an idle or stalled reader ends.
        _kernel_timeouts(self.connection, _SERVER_IDLE)

    def log_message(self, format: str, *args: Any) -> None:
        return  # requests are not worth a log line each

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        path = self._relative()
        if path is None:
            self._refuse(HTTPStatus.FORBIDDEN)
            return
        try:
            fd = self.server.folder.open_contained(path)
        except FileNotFoundError:
            self._refuse(HTTPStatus.NOT_FOUND)
            return
        except Exception:  # a link, a special file, an unreadable folder: never served
            self._refuse(HTTPStatus.FORBIDDEN)
            return
        with open(fd, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            start, end = 0, size
            wanted = _RANGE.match(self.headers.get("Range", ""))
            if wanted:
                start = int(wanted.group(1))
                end = min(size, int(wanted.group(2)) + 1 if wanted.group(2) else size)
                if start >= size and size:
                    self.send_response(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
            self.send_response(HTTPStatus.PARTIAL_CONTENT if wanted else HTTPStatus.OK)
            if wanted:
                self.send_header("Content-Range", f"bytes {start}-{max(end - 1, start)}/{size}")
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(end - start))
            self.end_headers()
            if body:  # the kernel copies page cache to socket (the headers are flushed)
                offset, left = start, end - start
                while left > 0:
                    sent = os.sendfile(self.connection.fileno(), file.fileno(), offset, left)
                    if not sent:
                        break
                    offset, left = offset + sent, left - sent

    def _relative(self) -> str | None:
        """The requested path below the folder, or None if the token is wrong or the path
        leaves the folder."""
        raw = unquote(self.path.split("?", 1)[0]).lstrip("/")
        token, _, path = raw.partition("/")
        if not hmac.compare_digest(token.encode(), self.server.token.encode()):
            return None
        parts = path.split("/")
        if not path or any(p in ("", ".", "..") for p in parts):
            return None
        return path

    def _refuse(self, status: HTTPStatus) -> None:
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()


class _Server(ThreadingHTTPServer):
    """The HTTP server, remembering its open connections so that closing it ends them too
    (a keep-alive connection would otherwise go on being served by its thread)."""

    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        return  # a reader that went away (a failed or finished load) is not this node's error

    def __init__(self, address: tuple[str, int], folder: SharedMemoryBackend,
                 token: str) -> None:
        super().__init__(address, _Handler)
        self.folder = folder
        self.token = token
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._connections_lock:
            self._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._connections_lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    def server_close(self) -> None:
        super().server_close()
        with self._connections_lock:
            open_now = list(self._connections)
        for connection in open_now:  # its thread sees the end and closes it
            with suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)


class PeerServer:
    """Serves one node's memory folder, read-only, to the other nodes of its job."""

    def __init__(self, folder: SharedMemoryBackend, host: str | None = None) -> None:
        self.token = secrets.token_hex(16)
        self._server = _Server((host or peer_host(), 0), folder, self.token)
        self._thread = threading.Thread(target=self._server.serve_forever, args=(_POLL,),
                                        name="statereg-peer-server", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """What a peer opens: http://HOST:PORT/TOKEN (the token is the job's secret)."""
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/{self.token}"

    def close(self) -> None:
        """Stop serving: no new connection is accepted and open ones are ended (a reader in
        the middle of a file gets a StorageError naming this peer)."""
        self._server.shutdown()
        self._server.server_close()


class _PeerConnection(HTTPConnection):
    """An HTTP connection that connects within `timeout`, then stays a blocking socket with
    the kernel's timeouts: `readinto` of a large body is one recv after another with no poll
    between them (a Python-level timeout would add one per recv)."""

    def connect(self) -> None:
        super().connect()
        assert self.sock is not None
        self.sock.settimeout(None)
        _kernel_timeouts(self.sock, self.timeout)


class PeerBackend(StorageBackend):
    """Another node's memory folder, read through its PeerServer (read-only).

    `url` is the server's, http://HOST:PORT/TOKEN. Requests go over keep-alive `http.client`
    connections, of which up to `_KEPT_CONNECTIONS` wait idle for the next request; streams
    read a body with `readinto` into the caller's buffer. A file the peer lacks is
    FileNotFoundError, as on any backend; a peer that is down, stops sending mid-file or
    refuses the token is a StorageError naming the peer and the file (never the token).
    """

    schemes: ClassVar[tuple[str, ...]] = ()
    probe_exclusive: ClassVar[bool] = False  # it never creates anything

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self._idle: list[HTTPConnection] = []
        self._idle_lock = threading.Lock()

    def _open_filesystem(self, url: str, options: dict[str, Any]) -> tuple[Any, str]:
        """No filesystem: the server's address, and its path prefix `/TOKEN` as the root."""
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.scheme != "http" or not parts.hostname or port is None or \
                not parts.path.strip("/"):
            raise StorageError(f"{self.display()} is not a peer server's URL: expected "
                               "http://HOST:PORT/TOKEN, as PeerServer.url gives")
        self._address = (parts.hostname, port)
        return None, parts.path.rstrip("/")

    def display(self, path: str = "") -> str:
        # The URL holds the job's secret: messages name the server, never the token.
        shown = self.url.rsplit("/", 1)[0] + "/..."
        return f"{shown}/{path}" if path else shown

    # -- requests -----------------------------------------------------------------------

    def _request(self, method: str, path: str, start: int = 0, end: int | None = None,
                 ) -> tuple[HTTPConnection, HTTPResponse]:
        """Send one request for `path` (bytes [start, end) where given); the connection and
        its response, of status 200, 206 or 416 (a range past the end: its empty body read).

        A kept connection that the server has closed since is replaced, trying the next
        one, then a new one; any other failure is the peer's (StorageError)."""
        headers = {}
        if start or end is not None:
            headers["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        target = f"{self.root}/{quote(path)}"
        while True:
            with self._idle_lock:
                kept = self._idle.pop() if self._idle else None
            connection = kept or _PeerConnection(*self._address, timeout=_TIMEOUT)
            try:
                connection.request(method, target, headers=headers)
                response = connection.getresponse()
                if response.status not in (HTTPStatus.OK, HTTPStatus.PARTIAL_CONTENT):
                    response.read()
                break
            except (OSError, HTTPException) as exc:
                connection.close()
                if kept is None or isinstance(exc, (TimeoutError, BlockingIOError)):
                    raise self._gone(path, exc) from exc
        if response.status in (HTTPStatus.OK, HTTPStatus.PARTIAL_CONTENT,
                               HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE):
            return connection, response
        self._release(connection, response)
        if response.status == HTTPStatus.NOT_FOUND:
            raise FileNotFoundError(f"{self.display(path)} is not in the peer node's memory")
        if response.status == HTTPStatus.FORBIDDEN:
            raise StorageError(
                f"reading {self.display(path)} failed: the peer node at {self._peer()} refused "
                "it (HTTP 403): the request's token is not the one its server was started with "
                "(another job's server at that address?), or the file there is a link or a "
                "special file. Start every rank of the job together, or restore from "
                "storage.url")
        raise StorageError(f"reading {self.display(path)} failed: the peer node at "
                           f"{self._peer()} answered HTTP {response.status} {response.reason}; "
                           "restore from storage.url")

    def _release(self, connection: HTTPConnection, response: HTTPResponse) -> None:
        """Keep `connection` for the next request if its response was read to the end."""
        if response.isclosed():
            with self._idle_lock:
                if len(self._idle) < _KEPT_CONNECTIONS:
                    self._idle.append(connection)
                    return
        connection.close()

    def _peer(self) -> str:
        return "{}:{}".format(*self._address)

    def _gone(self, path: str, error: BaseException, at: int | None = None) -> StorageError:
        """The error of a peer that did not answer, or (`at`: the file offset it had reached)
        stopped sending."""
        what = "did not answer" if at is None else f"stopped sending it at byte {at}"
        if isinstance(error, (TimeoutError, BlockingIOError)):  # the kernel's timeouts: EAGAIN
            detail = f"nothing came for {_TIMEOUT:.0f} s"
        else:
            detail = f"{type(error).__name__}: {error}"
        return StorageError(
            f"reading {self.display(path)} failed: the peer node at {self._peer()} {what} "
            f"({detail}). The node is down, its server stopped, or it "
            "cannot be reached from this host ($STATEREG_PEER_HOST on it names its address); "
            "bring it back, or restore from storage.url")

    def _refuse(self, operation: str, path: str) -> NoReturn:
        raise StorageError(f"{operation} of {self.display(path)} refused: a peer node's memory "
                           "is read only from other nodes (each node writes its own folder)")

    # -- reading ------------------------------------------------------------------------

    def read_range(self, path: str, start: int, end: int | None) -> bytes:
        """Bytes [start, end) of the file (to its end where `end` is None), in one GET."""
        if end is not None and end <= start:
            return b""
        connection, response = self._request("GET", path, start, end)
        body = bytearray(response.length or 0)  # 0 for 416: the range starts past the end
        view, done = memoryview(body), 0
        while done < len(body):
            done += self._readinto(path, connection, response, view[done:], start + done)
        self._release(connection, response)
        return bytes(body)

    def _readinto(self, path: str, connection: HTTPConnection, response: HTTPResponse,
                  view: memoryview, at: int) -> int:
        """`response.readinto(view)`, `at` being the file offset of its next byte; a broken
        or stalled response (its connection then closed) is the peer's StorageError."""
        try:
            got = response.readinto(view)
            if got is None:  # the kernel's receive timeout (EAGAIN), as http.client passes it
                raise TimeoutError("the receive timed out")
            if not got and view and response.length:  # http.client's EOF mid-body
                raise ConnectionAbortedError(
                    f"the connection closed {response.length} bytes before the body's end")
        except (OSError, HTTPException) as exc:
            connection.close()
            raise self._gone(path, exc, at) from exc
        return got

    def read_bytes(self, path: str, limit: int | None = None) -> bytes:
        return self.read_range(path, 0, limit)

    @contextmanager
    def open_read(self, path: str, size: int | None = None) -> Iterator[_PeerReads]:
        with _PeerReads(self, path, None, size) as stream:
            yield stream

    @contextmanager
    def open_ranges(self, path: str, ranges: Sequence[tuple[int, int]],
                    size: int | None = None) -> Iterator[_PeerReads]:
        with _PeerReads(self, path, ranges, size) as stream:
            yield stream

    @contextmanager
    def open_blocks(self, path: str) -> Iterator[_PeerReads]:
        """The whole file as it is read; FileNotFoundError here if the peer lacks it."""
        with _PeerReads(self, path, None, self.size(path)) as stream:
            yield stream

    def size(self, path: str) -> int:
        connection, response = self._request("HEAD", path)
        response.read()  # no body: this closes the response, so the connection is kept
        self._release(connection, response)
        length = response.getheader("Content-Length")
        if length is None or not length.isdigit():
            raise StorageError(f"the peer node at {self._peer()} gave no size for "
                               f"{self.display(path)}; restore from storage.url")
        return int(length)

    def exists(self, path: str) -> bool:
        try:
            self.size(path)
        except FileNotFoundError:
            return False
        return True

    # -- never here: a peer is read-only and never lists ---------------------------------

    def open_write(self, path: str, on_done: Any = None) -> Any:
        self._refuse("write", path)

    def _store_if_absent(self, path: str, data: bytes) -> Any:
        self._refuse("exclusive write", path)

    def list_dir(self, path: str = "") -> list[str]:
        self._refuse("listing", path)

    def walk(self, path: str = "") -> list[StoredFile]:
        self._refuse("listing", path)

    def remove_file(self, path: str) -> None:
        self._refuse("delete", path)

    def remove_tree(self, path: str) -> None:
        self._refuse("delete", path)


class _PeerReads(PositionedReads):
    """A seekable, read-only stream of a file on a peer, fetched by ranged GETs as it is read.

    `runs` (the sorted (start, end) runs a reader will use; None: the whole file) bound each
    GET: a read asks for the rest of the run holding its position (outside every run, for
    what it reads), and the reads after it take that response's bytes as they arrive,
    straight into their own buffers; a seek elsewhere ends the response. A read under
    `_SMALL` bytes is served from a block of the response kept here, so a record's header,
    read, then hashed again, costs no second request. Bytes past the end of the file (or of
    a short file) read as its end, as from any stream.
    """

    def __init__(self, peer: PeerBackend, path: str,
                 runs: Sequence[tuple[int, int]] | None, size: int | None) -> None:
        super().__init__(peer, path, size)
        self._peer = peer
        self._runs = sorted(runs) if runs is not None else None
        self._starts = [start for start, _ in self._runs or []]
        self._block_start, self._block = 0, memoryview(b"")
        self._connection: HTTPConnection | None = None
        self._response: HTTPResponse | None = None
        self._next = 0  # the file offset of the response's next byte

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
        if self._response is not None and (self._next != self._pos
                                           or self._response.isclosed()):
            self._end_response()
        if self._response is None:
            if self._size is not None and self._pos >= self._size:
                return 0
            self._connection, self._response = self._peer._request(
                "GET", self._path, self._pos, self._run_end(len(view)))
            self._next = self._pos
        assert self._connection is not None
        try:
            got = self._peer._readinto(self._path, self._connection, self._response, view,
                                       self._next)
        except StorageError:
            self._connection = self._response = None  # closed: it broke mid-response
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
        if self._connection is not None and self._response is not None:
            self._peer._release(self._connection, self._response)
        self._connection = self._response = None

    def close(self) -> None:
        self._end_response()
        super().close()


def open_peer(url: str) -> PeerBackend:
    """A PeerBackend for a PeerServer's url (StorageError if it is not one)."""
    return PeerBackend(url)
