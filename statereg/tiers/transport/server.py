"""The peer server: one node's memory folder served, read-only, to the other nodes of its
job, at bounded cost to its training process whoever reaches its port (the bounds are
listed in statereg/tiers/transport/__init__.py and docs/tiers.md#the-peer-transport).

One selector thread reads every request head and authenticates it; only authenticated
requests reach the worker threads, which open files and send them with `sendfile`.
"""

from __future__ import annotations

import errno
import hmac
import logging
import os
import secrets
import selectors
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from urllib.parse import unquote

from statereg.backends.shm import SharedMemoryBackend
from statereg.errors import StorageError
from statereg.tiers.transport.address import GLOO_IFNAME_ENV, PEER_HOST_ENV, peer_host
from statereg.tiers.transport.wire import (
    HEX,
    MAX_HEAD,
    RANGE,
    SCHEME,
    STAMP,
    answer_head,
    authority,
    bare_answer,
    kernel_timeouts,
    parse_request,
    request_mac,
)

logger = logging.getLogger(__name__)

# The server's bounds (PeerServer's defaults).
_HEAD_DEADLINE = 5.0  # seconds a connection has to send a request head
_IDLE = 60.0  # seconds a kept-alive connection may wait for its next request
_MAX_PENDING = 64  # connections waiting for their first authenticated head
_MAX_CONNECTIONS = 64  # authenticated connections open at once
_WORKERS = 8  # requests served at once (threads)
_WINDOW = 300.0  # seconds a request's timestamp may differ from the server's clock
_SEND_TIMEOUT = 60.0  # seconds the server waits for a reader that stopped reading
_POLL = 0.05  # how often the server's loop looks for a shutdown request


class _Waiting:
    """A connection the selector watches for a request head (no thread, no file)."""

    __slots__ = ("buffer", "deadline", "sock")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.buffer = bytearray()
        self.deadline = deadline


class PeerServer:
    """Serves one node's memory folder, read-only, to the other nodes of its job.

    `secret` (32 random bytes) is what the job shares over its process group; `url`
    (http://HOST:PORT) is where peers reach this server. The bounds are the keyword
    arguments (module docstring)."""

    def __init__(self, folder: SharedMemoryBackend, host: str | None = None, *,
                 max_pending: int = _MAX_PENDING, max_connections: int = _MAX_CONNECTIONS,
                 workers: int = _WORKERS, head_deadline: float = _HEAD_DEADLINE,
                 idle: float = _IDLE, window: float = _WINDOW) -> None:
        self.folder = folder
        self.secret = secrets.token_bytes(32)
        self.max_pending, self.max_connections = max_pending, max_connections
        self.head_deadline, self.idle, self.window = head_deadline, idle, window
        host = host or peer_host()
        try:
            family, _, _, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
            listener = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:
            raise StorageError(f"memory tier: cannot listen on {host!r} ({exc}); set "
                               f"${PEER_HOST_ENV} to this node's address") from exc
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(address[:2])
            listener.listen(256)
            listener.setblocking(False)
        except OSError as exc:
            listener.close()
            raise StorageError(
                f"memory tier: cannot listen on {host} ({exc}): it is not an address of this "
                f"node. Set ${PEER_HOST_ENV} to this node's address on the network the job's "
                f"process group uses (the address of ${GLOO_IFNAME_ENV}'s interface)") from exc
        self._listener = listener
        self.host, self.port = listener.getsockname()[:2]
        self.authority = authority(self.host, self.port)
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake_write = socket.socketpair()
        self._wake_read.setblocking(False)
        self._wake_write.setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ, "listen")
        self._selector.register(self._wake_read, selectors.EVENT_READ, "wake")
        self._fresh: dict[socket.socket, _Waiting] = {}  # no request yet: oldest first
        self._kept: dict[socket.socket, _Waiting] = {}  # between requests: oldest first
        self._lock = threading.Lock()
        self._serving = 0  # authenticated connections in a worker (under _lock)
        self._served: set[socket.socket] = set()  # their sockets (under _lock)
        self._returned: list[_Waiting] = []  # handed back by workers (under _lock)
        self._nonces: dict[str, float] = {}
        self._pruned = time.monotonic()
        self._closed = False
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="statereg-peer")
        self._thread = threading.Thread(target=self._loop, name="statereg-peer-server",
                                        daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """What a peer opens: http://HOST:PORT (with `secret`, which is not in it)."""
        return f"http://{self.authority}"

    def connections(self) -> int:
        """Connections open now: waiting for a head, kept between requests, or served."""
        with self._lock:
            return len(self._fresh) + len(self._kept) + self._serving + len(self._returned)

    def close(self) -> None:
        """Stop serving: no new connection is accepted and open ones are ended (a reader in
        the middle of a file gets a StorageError naming this peer)."""
        if self._closed:
            return
        self._closed = True
        with suppress(OSError):
            self._wake_write.send(b"x")
        self._thread.join()
        with self._lock:
            served = list(self._served)
        for sock in served:  # a worker sending ends at once; it closes its socket
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._pool.shutdown(wait=True)

    # -- the selector thread -----------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._closed:
                now = time.monotonic()
                deadlines = [w.deadline for pool in (self._fresh, self._kept) for w in
                             list(pool.values())[:1]]
                wait = min([_POLL, *(d - now for d in deadlines)])
                for key, _ in self._selector.select(max(wait, 0.0)):
                    if key.data == "listen":
                        self._accept()
                    elif key.data == "wake":
                        with suppress(OSError):
                            self._wake_read.recv(4096)
                        self._take_returned()
                    else:
                        self._readable_or_dropped(key.data)
                self._expire(time.monotonic())
        finally:
            self._shut()

    def _shut(self) -> None:
        with suppress(OSError):
            self._listener.close()
        for pool in (self._fresh, self._kept):
            for waiting in list(pool.values()):
                self._drop(waiting)
        with self._lock:
            returned, self._returned = self._returned, []
        for waiting in returned:
            waiting.sock.close()
        self._selector.close()
        self._wake_read.close()
        self._wake_write.close()

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # EMFILE and kin: let the process's other files close
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    logger.debug("peer server: accept failed (%s)", exc)
                    time.sleep(_POLL)
                return
            sock.setblocking(False)
            if len(self._fresh) >= self.max_pending:  # the oldest unauthenticated one goes
                self._drop(next(iter(self._fresh.values())))
            waiting = _Waiting(sock, time.monotonic() + self.head_deadline)
            self._fresh[sock] = waiting
            self._selector.register(sock, selectors.EVENT_READ, waiting)

    def _drop(self, waiting: _Waiting) -> None:
        self._fresh.pop(waiting.sock, None)
        self._kept.pop(waiting.sock, None)
        with suppress(KeyError, ValueError):
            self._selector.unregister(waiting.sock)
        waiting.sock.close()

    def _expire(self, now: float) -> None:
        for pool in (self._fresh, self._kept):
            while pool:
                oldest = next(iter(pool.values()))
                if oldest.deadline > now:
                    break
                self._drop(oldest)

    def _take_returned(self) -> None:
        with self._lock:
            returned, self._returned = self._returned, []
        for waiting in returned:
            if self._closed:
                waiting.sock.close()
                continue
            waiting.deadline = time.monotonic() + self.idle
            self._kept[waiting.sock] = waiting
            self._selector.register(waiting.sock, selectors.EVENT_READ, waiting)
            if b"\r\n\r\n" in waiting.buffer:
                self._head(waiting)

    def _readable_or_dropped(self, waiting: _Waiting) -> None:
        """`_readable`, where a failure to handle one connection's head (a bug: every
        head is checked) drops that connection instead of ending the selector thread."""
        try:
            self._readable(waiting)
        except Exception as exc:
            logger.warning("peer server: a request head could not be handled (%r); its "
                           "connection is closed", exc)
            if waiting.sock in self._fresh or waiting.sock in self._kept:
                self._drop(waiting)

    def _readable(self, waiting: _Waiting) -> None:
        try:
            data = waiting.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(waiting)
            return
        waiting.buffer += data
        if b"\r\n\r\n" in waiting.buffer:
            self._head(waiting)
        elif len(waiting.buffer) > MAX_HEAD:
            self._drop(waiting)

    def _refuse_now(self, waiting: _Waiting, status: int) -> None:
        """A bare answer sent without blocking (dropped if the socket cannot take it), then
        the connection is closed: what an unauthenticated request gets."""
        with suppress(OSError):
            waiting.sock.send(bare_answer(status))
        self._drop(waiting)

    def _head(self, waiting: _Waiting) -> None:
        """A whole request head arrived: check it here, serve it on a worker."""
        raw, _, rest = bytes(waiting.buffer).partition(b"\r\n\r\n")
        waiting.buffer = bytearray(rest)
        parsed = parse_request(raw)  # None: not a head (h11 says), or too long
        if parsed is None or parsed[0] not in ("GET", "HEAD"):
            self._refuse_now(waiting, 400)
            return
        method, target, headers = parsed
        nonce = self._authentic(method, target, headers)
        if nonce is None:
            self._refuse_now(waiting, 403)
            return
        self._fresh.pop(waiting.sock, None)
        self._kept.pop(waiting.sock, None)
        self._selector.unregister(waiting.sock)
        with self._lock:
            full = (len(self._kept) + self._serving + len(self._returned)
                    >= self.max_connections)
            if not full:
                self._serving += 1
                self._served.add(waiting.sock)
        if full:
            with suppress(OSError):
                waiting.sock.send(self._answer_head(503, nonce, "", 0, close=True))
            waiting.sock.close()
            return
        self._pool.submit(self._serve, waiting, method, target, headers, nonce)

    def _authentic(self, method: str, target: str, headers: dict[str, str]) -> str | None:
        """The request's nonce if its MAC is the job's, its time within the window and its
        nonce new; None otherwise."""
        scheme, _, fields = headers.get("authorization", "").partition(" ")
        if scheme != SCHEME:
            return None
        parts = dict(item.partition("=")[::2] for item in fields.split(","))
        stamp, nonce, mac = parts.get("t", ""), parts.get("n", ""), parts.get("m", "")
        # Hex before compare_digest, which raises TypeError on non-ASCII text: one such
        # header would otherwise end the selector thread, and the server with it.
        if not (len(nonce) == 32 and HEX.match(nonce) and len(mac) == 64 and HEX.match(mac)
                and STAMP.match(stamp)):
            return None
        expected = request_mac(self.secret, method, self.authority, target,
                               headers.get("range", ""), stamp, nonce)
        if not hmac.compare_digest(expected, mac):
            return None
        now = time.time()
        if abs(now - float(stamp)) > self.window or nonce in self._nonces:
            return None  # stale, or a replay
        self._nonces[nonce] = float(stamp)
        if len(self._nonces) > 4096 and time.monotonic() - self._pruned > 1.0:
            self._nonces = {n: t for n, t in self._nonces.items() if t >= now - self.window}
            self._pruned = time.monotonic()
        return nonce

    def _answer_head(self, status: int, nonce: str, content_range: str, length: int,
                     close: bool = False) -> bytes:
        return answer_head(self.secret, status, nonce, content_range, length, close)

    # -- the workers -------------------------------------------------------------------

    def _serve(self, waiting: _Waiting, method: str, target: str, headers: dict[str, str],
               nonce: str) -> None:
        sock, keep = waiting.sock, False
        try:
            sock.setblocking(True)
            kernel_timeouts(sock, _SEND_TIMEOUT)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            keep = self._send(sock, method, target, headers, nonce)
            keep = keep and headers.get("connection", "").lower() != "close"
        except Exception as exc:  # a reader that went away is not this node's error
            logger.debug("peer server: a request ended early (%s)", exc)
            keep = False
        with self._lock:
            self._serving -= 1
            self._served.discard(sock)
            if keep and not self._closed:
                sock.setblocking(False)
                self._returned.append(waiting)
            else:
                sock.close()
        if keep:
            with suppress(OSError):
                self._wake_write.send(b"r")

    def _send(self, sock: socket.socket, method: str, target: str, headers: dict[str, str],
              nonce: str) -> bool:
        """Answer one authenticated request; whether the connection may be kept."""
        path = unquote(target.split("?", 1)[0]).lstrip("/")
        parts = path.split("/")
        if not path or any(p in ("", ".", "..") for p in parts) or "\0" in path:
            sock.sendall(self._answer_head(403 if path else 200, nonce, "", 0))
            return True  # "/" is the reachability check: 200, no body
        try:
            fd = self.folder.open_contained(path)
        except FileNotFoundError:
            sock.sendall(self._answer_head(404, nonce, "", 0))
            return True
        except Exception:  # a link, a special file, an unreadable folder: never served
            sock.sendall(self._answer_head(403, nonce, "", 0))
            return True
        with open(fd, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            wanted = headers.get("range")
            if method == "HEAD" or wanted is None:
                start, end, status, content_range = 0, size, 200, ""
            else:
                match = RANGE.match(wanted)
                first = int(match.group(1)) if match else 0
                last = int(match.group(2)) if match and match.group(2) else None
                if match is None or first >= size or (last is not None and last < first):
                    sock.sendall(self._answer_head(416, nonce, f"bytes */{size}", 0))
                    return True
                start, end = first, size if last is None else min(size, last + 1)
                status, content_range = 206, f"bytes {start}-{end - 1}/{size}"
            sock.sendall(self._answer_head(status, nonce, content_range, end - start))
            if method == "GET":  # the kernel copies page cache to socket
                offset, left = start, end - start
                while left > 0:
                    sent = os.sendfile(sock.fileno(), file.fileno(), offset, left)
                    if not sent:
                        return False
                    offset, left = offset + sent, left - sent
        return True
