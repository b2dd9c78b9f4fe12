"""An HTTP relay in front of the S3 test server that logs every request and the bytes it
returned, one listening port per client (per rank), so a test can say who read what.

The relay forwards each request as it came (method, path, query, headers, body; the
signature stays valid because the Host header is passed on) and records the response's
status and body length. A client marks the part of its run that a test measures with
`mark(endpoint, label)`: a GET of `/__mark__/<label>`, answered by the relay itself.
"""

from __future__ import annotations

import http.client
import threading
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_MARK = "/__mark__/"
# Headers that belong to one connection, not to the request or response they travel with.
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length",
               "proxy-connection", "te", "trailer", "upgrade"}


@dataclass(frozen=True)
class Request:
    """One request the relay forwarded: what was asked and how many body bytes came back."""

    method: str
    path: str  # /bucket/key, unquoted
    query: str
    status: int
    body_bytes: int

    @property
    def is_object_read(self) -> bool:
        """A GET of an object (not a bucket listing)."""
        bucket_level = self.path.strip("/").count("/") == 0
        return self.method == "GET" and not bucket_level and "list-type" not in self.query


@dataclass
class ClientLog:
    """The requests of one client (one port), and the marks it set between them."""

    requests: list[Request | str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def between(self, start: str, end: str) -> list[Request]:
        """The requests logged after mark `start` and before mark `end`."""
        with self.lock:
            entries = list(self.requests)
        first, last = entries.index(start), entries.index(end)
        return [r for r in entries[first + 1:last] if isinstance(r, Request)]


def mark(endpoint: str, label: str) -> None:
    """Set mark `label` in the log of the client using `endpoint`."""
    with urllib.request.urlopen(f"{endpoint}{_MARK}{label}", timeout=10) as answer:
        answer.read()


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        """A client that went away (a rank that ended) is no error of the relay's."""


class RequestLog:
    """`clients` relays to `upstream` (http://host:port), each on a port of its own."""

    def __init__(self, upstream: str, clients: int) -> None:
        self.upstream = upstream
        parsed = urllib.parse.urlsplit(upstream)
        self._upstream = (parsed.hostname or "127.0.0.1", parsed.port or 80)
        self.logs = [ClientLog() for _ in range(clients)]
        self._servers = [self._serve(log) for log in self.logs]

    @property
    def endpoints(self) -> list[str]:
        return [f"http://127.0.0.1:{server.server_address[1]}" for server in self._servers]

    def close(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()

    def _serve(self, log: ClientLog) -> ThreadingHTTPServer:
        upstream = self._upstream

        class Relay(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                """Quiet: the log is the point, stderr is not."""

            def _relay(self) -> None:
                parsed = urllib.parse.urlsplit(self.path)
                if parsed.path.startswith(_MARK):
                    with log.lock:
                        log.requests.append(parsed.path.removeprefix(_MARK))
                    self.send_response(200)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                connection = http.client.HTTPConnection(*upstream, timeout=60)
                try:
                    connection.request(self.command, self.path, body=body,
                                       headers=dict(self.headers.items()))
                    answer = connection.getresponse()
                    data = answer.read()
                    headers = answer.getheaders()
                    status = answer.status
                finally:
                    connection.close()
                with log.lock:
                    log.requests.append(Request(self.command, urllib.parse.unquote(parsed.path),
                                                parsed.query, status, len(data)))
                self.send_response(status)
                for name, value in headers:
                    if name.lower() not in _HOP_BY_HOP:
                        self.send_header(name, value)
                if self.command == "HEAD":
                    size = dict((k.lower(), v) for k, v in headers).get("content-length", "0")
                    self.send_header("Content-Length", size)
                else:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _relay

        server = _QuietServer(("127.0.0.1", 0), Relay)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server
