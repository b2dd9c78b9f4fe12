"""Reading another node's memory tier: a read-only file server per node, and a backend that
reads this node's shared memory and, for a file it lacks, the peer node that holds it.

A memory checkpoint of a job on several nodes lives in several node folders: each node holds
the files its own ranks wrote and, with `tiers.memory.replicate`, a copy of its previous
node's files (docs/tiers.md). A rank that loads, or rank 0 that drains to storage.url, may
need a file of another node; that node's leader serves its folder over HTTP (stdlib
`ThreadingHTTPServer`, GET and HEAD with byte ranges), and `NodeMemoryBackend` falls back to
it, through fsspec's HTTP filesystem, for whatever this node lacks. Every byte read that way
is checked against the manifest like any other read, so a peer can fail a load but never
slip a wrong byte into it.

The server answers only paths under `/<token>/`, where the token is a random secret the job
shares over its process group; it never lists, writes, follows a link, or leaves its folder
(it opens files the way `LocalBackend` does, one component at a time with O_NOFOLLOW).
"""

from __future__ import annotations

import hmac
import os
import re
import secrets
import shutil
import socket
import threading
from collections.abc import Sequence
from contextlib import contextmanager, suppress
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar
from urllib.parse import unquote

from statereg.backends.base import StorageBackend, StoredFile
from statereg.backends.local import temporary_name
from statereg.backends.shm import SharedMemoryBackend
from statereg.errors import StateregError

PEER_HOST_ENV = "STATEREG_PEER_HOST"
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")
_CHUNK = 1 << 20


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
            fd = self.server.folder._open_contained("read", path)
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
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        return  # a reader that went away (a failed or finished load) is not this node's error

    def __init__(self, address: tuple[str, int], folder: SharedMemoryBackend,
                 token: str) -> None:
        super().__init__(address, _Handler)
        self.folder = folder
        self.token = token


class PeerServer:
    """Serves one node's memory folder, read-only, to the other nodes of its job."""

    def __init__(self, folder: SharedMemoryBackend, host: str | None = None) -> None:
        self.token = secrets.token_hex(16)
        self._server = _Server((host or peer_host(), 0), folder, self.token)
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="statereg-peer-server", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """What a peer opens: http://HOST:PORT/TOKEN (the token is the job's secret)."""
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/{self.token}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class PeerBackend(StorageBackend):
    """Another node's memory folder, read through its PeerServer (read-only)."""

    schemes: ClassVar[tuple[str, ...]] = ()
    client_package = "aiohttp"
    install_extra = "tiers"

    def display(self, path: str = "") -> str:
        # The URL holds the job's secret: messages name the server, never the token.
        shown = self.url.rsplit("/", 1)[0] + "/..."
        return f"{shown}/{path}" if path else shown


class NodeMemoryBackend(SharedMemoryBackend):
    """This node's memory folder; a file it lacks is read from the first peer that holds it.

    Writes and deletes stay on this node; reads fall back to peers. `holders` (path ->
    its size and the peers holding it, from the nodes' inventories) spares asking each peer
    in turn, and shows those files in `walk` as if they were here.
    """

    def __init__(self, url: str, peers: list[StorageBackend] | None = None) -> None:
        super().__init__(url)
        self.peers = list(peers or [])
        self.holders: dict[str, tuple[int, list[int]]] = {}
        # Set by the restore, alike on every rank (engine/tiers.py nearest).
        self.broadcast_reads = False
        self._found: dict[str, StorageBackend] = {}
        self._lock = threading.Lock()

    def _source(self, path: str) -> StorageBackend:
        """This node if it has `path`, else a peer that has it (FileNotFoundError if none)."""
        if not self.peers or super().exists(path):
            return self
        with self._lock:
            known = self._found.get(path)
        if known is not None:
            return known
        order = self.holders.get(path, (0, []))[1]
        order = order + [i for i in range(len(self.peers)) if i not in order]
        for index in order:
            peer = self.peers[index]
            with suppress(FileNotFoundError):
                if peer.exists(path):
                    with self._lock:
                        self._found[path] = peer
                    return peer
        return self

    def _read_from(self, path: str) -> StorageBackend | None:
        source = self._source(path)
        return None if source is self else source

    def read_bytes(self, path: str, limit: int | None = None) -> bytes:
        peer = self._read_from(path)
        if peer is None:
            return super().read_bytes(path, limit)
        return peer.read_bytes(path, limit)

    @contextmanager
    def open_read(self, path: str, size: int | None = None) -> Any:
        peer = self._read_from(path)
        if peer is None:
            with super().open_read(path, size) as stream:
                yield stream
        else:
            with peer.open_read(path, size) as stream:
                yield stream

    @contextmanager
    def open_ranges(self, path: str, ranges: Sequence[tuple[int, int]],
                    size: int | None = None) -> Any:
        peer = self._read_from(path)
        source = super() if peer is None else peer
        with source.open_ranges(path, ranges, size) as stream:
            yield stream

    def open_blocks(self, path: str) -> Any:
        peer = self._read_from(path)
        return super().open_blocks(path) if peer is None else peer.open_blocks(path)

    def exists(self, path: str) -> bool:
        return self._source(path) is not self or super().exists(path)

    def size(self, path: str) -> int:
        peer = self._read_from(path)
        return super().size(path) if peer is None else peer.size(path)

    def walk(self, path: str = "") -> list[StoredFile]:
        """This node's files under `path`, and those only peers hold (as `holders` says)."""
        here = super().walk(path)
        seen = {f.path for f in here}
        prefix = f"{path}/" if path else ""
        elsewhere = [StoredFile(p, size, None) for p, (size, nodes) in self.holders.items()
                     if p.startswith(prefix) and p not in seen and nodes]
        return sorted(here + elsewhere, key=lambda f: f.path)

    def fetch(self, peer: StorageBackend, path: str) -> None:
        """Copy `path` from `peer` into this node's folder (a replica); a reader never sees
        a part of it: it is written under a temporary name and renamed when complete."""
        if super().exists(path):
            return
        tmp = temporary_name(path)
        try:
            with peer.open_blocks(path) as source, self.open_write(tmp) as sink:
                shutil.copyfileobj(source, sink, _CHUNK)
            os.replace(self.full_path(tmp), self.full_path(path))
        finally:
            with suppress(FileNotFoundError):
                os.unlink(self.full_path(tmp))


def open_peer(url: str) -> PeerBackend:
    """A PeerBackend for a PeerServer's url; StateregError if HTTP reads are unavailable."""
    try:
        return PeerBackend(url)
    except Exception as exc:
        raise StateregError(f"cannot read a peer node's memory ({exc}); tiers over several "
                            "nodes read peers over HTTP with aiohttp: pip install "
                            "'statereg[tiers]'") from exc
