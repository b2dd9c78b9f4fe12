"""The transport between nodes' memory tiers: a read-only file server per node, and the
client that reads another node's folder through it (tiers/node_memory.py falls back to it).

A memory checkpoint of a job on several nodes lives in several node folders: each node holds
the files its own ranks wrote and, with `tiers.memory.replicate`, a copy of its previous
node's files (docs/tiers.md). A rank that loads, or rank 0 that drains to storage.url, may
need a file of another node; that node's leader serves its folder over HTTP/1.1 (GET with
one byte range, HEAD, bodies sent with `sendfile`), and `NodeMemoryBackend` falls back to
it, through `PeerBackend`, for whatever this node lacks. Every byte read that way is checked
against the manifest like any other read, so a peer can fail a load but never slip a wrong
byte into it. Why a socket and not the job's process group: docs/tiers.md#the-peer-transport.

The server is built to cost its training process bounded resources whoever reaches its port
(docs/tiers.md#the-peer-transport states the properties exactly):

- it listens on one address only: $STATEREG_PEER_HOST, else the address of the interface
  gloo uses ($GLOO_SOCKET_IFNAME), else the one this host routes to $MASTER_ADDR by, else
  the host name's (`peer_host`);
- one thread reads every request head (a selector, no thread per connection): a new
  connection has `head_deadline` seconds to send a whole head; at most `max_pending` wait
  so (the oldest is closed for a new one), and no thread or file is opened for them;
- every request carries an HMAC-SHA256, under the job's secret, of its method, the server's
  address, the path, the range, a timestamp and a nonce (`Authorization: statereg-hmac`);
  the secret never crosses the network. A wrong MAC, a timestamp outside `window` seconds
  or a nonce already seen closes the connection with a bare 403, from the selector thread;
- only authenticated requests reach the `workers` threads that open files and send them,
  and at most `max_connections` authenticated connections are open (a 503 beyond);
  between requests a kept-alive connection waits in the selector, holding no thread;
- every answer to an authenticated request carries an HMAC of the request's nonce and the
  answer's status and lengths, so the client knows it reached the job's server.

The client requires exactly the status and `Content-Range` it asked for and never more
bytes than it asked for, and each request has one deadline for the whole exchange (head and
body): `timeout` seconds plus one second per `_MIN_RATE` bytes received, so a peer that
lies or trickles costs bounded time and is a StorageError naming it.
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import hashlib
import hmac
import ipaddress
import logging
import os
import re
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from typing import Any, ClassVar, NoReturn
from urllib.parse import quote, unquote, urlsplit

from statereg import env
from statereg.backends.base import PositionedReads, StorageBackend, StoredFile
from statereg.backends.shm import SharedMemoryBackend
from statereg.errors import StorageError

logger = logging.getLogger(__name__)

PEER_HOST_ENV = env.PEER_HOST
# Seconds a peer may take for a request before it counts as gone (plus 1 s per _MIN_RATE
# bytes it sent); tests set it low.
PEER_TIMEOUT_ENV = env.PEER_TIMEOUT_S
GLOO_IFNAME_ENV = env.GLOO_SOCKET_IFNAME
_TIMEOUT = 60.0
# A peer must keep up this many bytes per second (after the first `timeout` seconds) or
# its request ends: an honest node sends at network speed, a trickle is a stall.
_MIN_RATE = 8e6
# The server's bounds (PeerServer's defaults).
_HEAD_DEADLINE = 5.0  # seconds a connection has to send a request head
_IDLE = 60.0  # seconds a kept-alive connection may wait for its next request
_MAX_PENDING = 64  # connections waiting for their first authenticated head
_MAX_CONNECTIONS = 64  # authenticated connections open at once
_WORKERS = 8  # requests served at once (threads)
_WINDOW = 300.0  # seconds a request's timestamp may differ from the server's clock
_SEND_TIMEOUT = 60.0  # seconds the server waits for a reader that stopped reading
_MAX_HEAD = 8192
_POLL = 0.05  # how often the server's loop looks for a shutdown request
# Idle connections a PeerBackend keeps open to its peer (one per reading thread suffices).
_KEPT_CONNECTIONS = 8
# Reads smaller than this (a record's header, framing) are served from one block fetched at
# once; larger ones (tensors) go from the socket straight into the caller's buffer.
_SMALL = 64 * 1024
_SCHEME = "statereg-hmac"
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+)$")
_UNSATISFIABLE = re.compile(r"^bytes \*/(\d+)$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")
_HEX = re.compile(r"^[0-9a-f]+$")
_REASONS = {200: "OK", 206: "Partial Content", 400: "Bad Request", 403: "Forbidden",
            404: "Not Found", 416: "Range Not Satisfiable", 503: "Service Unavailable"}


def _kernel_timeouts(connection: socket.socket, seconds: float) -> None:
    """Make a blocking socket's sends and receives fail (EAGAIN) after `seconds` without
    progress, as SO_SNDTIMEO / SO_RCVTIMEO do, leaving it blocking for Python: `sendfile`
    then sends a whole body in one call (a Python-level timeout polls once per buffer)."""
    seconds = max(seconds, 0.001)
    value = struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


# -- which address -------------------------------------------------------------------------


def interface_address(name: str) -> str:
    """The IPv4 address of network interface `name` (Linux), as gloo binds it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            packed = fcntl.ioctl(probe.fileno(), 0x8915,  # SIOCGIFADDR
                                 struct.pack("256s", name[:15].encode()))
        except OSError as exc:
            raise StorageError(
                f"memory tier: ${GLOO_IFNAME_ENV} names interface {name!r}, which has no IPv4 "
                f"address on this host ({exc}); name the interface the nodes reach each "
                f"other on (`ip -br addr` lists them), or set ${PEER_HOST_ENV} to this "
                "node's address") from exc
    return socket.inet_ntoa(packed[20:24])


def _route_to(host: str) -> str | None:
    """This host's address on the route to `host` (no packet is sent), None if unknown."""
    try:
        infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
        with socket.socket(infos[0][0], socket.SOCK_DGRAM) as probe:
            probe.connect(infos[0][4])
            return str(probe.getsockname()[0])
    except (OSError, IndexError):
        return None


def peer_address() -> tuple[str, str]:
    """The address this node's peer server listens on and peers reach it at, and where it
    came from: $STATEREG_PEER_HOST; else the address of the interface gloo uses
    ($GLOO_SOCKET_IFNAME, its first name); else this host's address on the route to
    $MASTER_ADDR (the address the job's rendezvous reaches it by); else the host name's."""
    given = env.peer_host()
    if given:
        return given, f"${PEER_HOST_ENV}"
    interface = env.gloo_interface()
    if interface:
        return interface_address(interface), f"${GLOO_IFNAME_ENV} {interface}"
    master = env.master_addr()
    routed = _route_to(master) if master else None
    if routed:
        return routed, f"the route to $MASTER_ADDR {master}"
    name = socket.gethostname()
    try:
        return socket.gethostbyname(name), f"the host name {name!r}"
    except OSError:
        return "127.0.0.1", f"the host name {name!r}, which does not resolve"


def peer_host() -> str:
    """The address alone (peer_address)."""
    return peer_address()[0]


def unusable_across_machines(address: str) -> str | None:
    """Why another machine cannot reach `address` (a loopback, unspecified or multicast
    address), or None."""
    try:
        ip = ipaddress.ip_address(socket.getaddrinfo(address, 0)[0][4][0])
    except (OSError, ValueError, IndexError):
        return "an address that does not resolve"
    if ip.is_loopback:
        return "a loopback address, which reaches only the machine it is on"
    if ip.is_unspecified:
        return "the unspecified address"
    if ip.is_multicast:
        return "a multicast address"
    return None


def network_namespace() -> str | None:
    """What two processes share exactly when one's loopback is the other's: this kernel's
    boot and this process's network namespace (Linux); None where unknown."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            booted = boot.read().strip()
        return f"{booted}:{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return None


def _authority(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _request_mac(secret: bytes, method: str, authority: str, target: str, wanted: str,
                 stamp: str, nonce: str) -> str:
    message = "\n".join(("request", method, authority, target, wanted, stamp, nonce))
    return hmac.new(secret, message.encode(), hashlib.sha256).hexdigest()


def _answer_mac(secret: bytes, nonce: str, status: int, content_range: str,
                length: str) -> str:
    message = "\n".join(("answer", nonce, str(status), content_range, length))
    return hmac.new(secret, message.encode(), hashlib.sha256).hexdigest()


# -- the server ------------------------------------------------------------------------------


class _Waiting:
    """A connection the selector watches for a request head (no thread, no file)."""

    __slots__ = ("buffer", "deadline", "sock")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.buffer = bytearray()
        self.deadline = deadline


def _parse_head(raw: bytes) -> tuple[str, str, dict[str, str]] | None:
    lines = raw.decode("latin-1").split("\r\n")
    request = lines[0].split(" ")
    if len(request) != 3 or request[2] not in ("HTTP/1.1", "HTTP/1.0"):
        return None
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, colon, value = line.partition(":")
            if not colon:
                return None
            headers[name.strip().lower()] = value.strip()
    return request[0], request[1], headers


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
        self.authority = _authority(self.host, self.port)
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
                        self._readable(key.data)
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
        elif len(waiting.buffer) > _MAX_HEAD:
            self._drop(waiting)

    def _refuse_now(self, waiting: _Waiting, status: int) -> None:
        """A bare answer sent without blocking (dropped if the socket cannot take it), then
        the connection is closed: what an unauthenticated request gets."""
        with suppress(OSError):
            waiting.sock.send(f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Length: 0"
                              "\r\nConnection: close\r\n\r\n".encode())
        self._drop(waiting)

    def _head(self, waiting: _Waiting) -> None:
        """A whole request head arrived: check it here, serve it on a worker."""
        raw, _, rest = bytes(waiting.buffer).partition(b"\r\n\r\n")
        waiting.buffer = bytearray(rest)
        parsed = _parse_head(raw) if len(raw) <= _MAX_HEAD else None
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
        if scheme != _SCHEME:
            return None
        parts = dict(item.partition("=")[::2] for item in fields.split(","))
        stamp, nonce, mac = parts.get("t", ""), parts.get("n", ""), parts.get("m", "")
        if not (len(nonce) == 32 and _HEX.match(nonce) and len(mac) == 64
                and re.match(r"^\d+\.\d{3}$", stamp)):
            return None
        expected = _request_mac(self.secret, method, self.authority, target,
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
        lines = [f"HTTP/1.1 {status} {_REASONS[status]}",
                 f"Content-Length: {length}", "Accept-Ranges: bytes",
                 "X-Statereg-Proof: "
                 + _answer_mac(self.secret, nonce, status, content_range, str(length))]
        if content_range:
            lines.append(f"Content-Range: {content_range}")
        if close:
            lines.append("Connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode()

    # -- the workers -------------------------------------------------------------------

    def _serve(self, waiting: _Waiting, method: str, target: str, headers: dict[str, str],
               nonce: str) -> None:
        sock, keep = waiting.sock, False
        try:
            sock.setblocking(True)
            _kernel_timeouts(sock, _SEND_TIMEOUT)
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
                match = _RANGE.match(wanted)
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


# -- the client ------------------------------------------------------------------------------


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
            _kernel_timeouts(self.sock, deadline - now)
            self._set_at = now

    def send(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            self._bound(deadline)
            try:
                view = view[self.sock.send(view):]
            except (BlockingIOError, TimeoutError):
                continue

    def recv_into(self, view: memoryview, deadline: Any) -> int:
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
            if len(buffer) > _MAX_HEAD:
                raise _Lie(f"an answer head longer than {_MAX_HEAD} bytes")
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


class PeerBackend(StorageBackend):
    """Another node's memory folder, read through its PeerServer (read-only).

    `url` is the server's, http://HOST:PORT, and `secret` the job's. Requests go over
    keep-alive connections, of which up to `_KEPT_CONNECTIONS` wait idle for the next
    request; bodies go from the socket into the caller's buffer. A file the peer lacks is
    FileNotFoundError, as on any backend; a peer that is down, busy past the deadline,
    stalls, answers what was not asked or refuses the request is a StorageError naming the
    peer and the file. `timeout` (default $STATEREG_PEER_TIMEOUT_S, else 60 s) bounds each
    request, plus 1 s per _MIN_RATE bytes it received.
    """

    schemes: ClassVar[tuple[str, ...]] = ()
    probe_exclusive: ClassVar[bool] = False  # it never creates anything

    def __init__(self, url: str, secret: bytes, timeout: float | None = None) -> None:
        self._secret = secret
        if timeout is None:
            timeout = env.peer_timeout_s(_TIMEOUT)
        self.timeout = timeout
        super().__init__(url)
        self._idle: list[_Connection] = []
        self._idle_lock = threading.Lock()

    def _open_filesystem(self, url: str, options: dict[str, Any]) -> tuple[Any, str]:
        """No filesystem: the server's address; the root is the server's."""
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.scheme != "http" or not parts.hostname or port is None or \
                parts.path.strip("/"):
            raise StorageError(f"{self.display()} is not a peer server's URL: expected "
                               "http://HOST:PORT, as PeerServer.url gives")
        self._address = (parts.hostname, port)
        self._authority = _authority(parts.hostname, port)
        return None, ""

    def display(self, path: str = "") -> str:
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
            mac = _request_mac(self._secret, method, self._authority, target, wanted, stamp,
                               nonce)
            head = [f"{method} {target} HTTP/1.1", f"Host: {self._authority}",
                    f"Authorization: {_SCHEME} t={stamp},n={nonce},m={mac}"]
            if wanted:
                head.append(f"Range: {wanted}")
            try:
                connection.send(("\r\n".join(head) + "\r\n\r\n").encode(), deadline)
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

        lines = raw.decode("latin-1").split("\r\n")
        status_line = lines[0].split(" ", 2)
        if len(status_line) < 2 or not status_line[0].startswith("HTTP/1.") or \
                not status_line[1].isdigit():
            lie(f"an answer that is not HTTP ({lines[0][:60]!r})")
        status = int(status_line[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
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
        expected = _answer_mac(self._secret, nonce, status, content_range, length_text)
        if not hmac.compare_digest(expected, proof):
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
            total = _UNSATISFIABLE.match(content_range)
            if length or total is None or int(total.group(1)) > start:
                lie(f"HTTP 416 with Content-Range {content_range!r} to {asked}")
            return _Answer(connection, status, headers, 0, started, self.timeout)
        if status != 206:
            lie(f"HTTP {status} to a request for {asked} (206 with that range expected)")
        found = _CONTENT_RANGE.match(content_range)
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

    def _refuse(self, operation: str, path: str) -> NoReturn:
        raise StorageError(f"{operation} of {self.display(path)} refused: a peer node's memory "
                           "is read only from other nodes (each node writes its own folder)")

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
        answer = self._request("HEAD", path)
        self._release(answer)
        return answer.length

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
        self._answer: _Answer | None = None
        self._next = 0  # the file offset of the answer's next byte

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
