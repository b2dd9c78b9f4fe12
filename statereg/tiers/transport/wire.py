"""The peer transport's wire protocol: how request and answer heads are parsed (with h11) and
written, what the MACs that authenticate them cover, and the bounds both ends hold to.

Both ends frame a head themselves (up to the blank line, at most `MAX_HEAD` bytes: the
server's selector thread reads heads without a thread per connection, and the client reads
bodies from the socket straight into the caller's buffer, so neither hands its socket to a
parser); what lies between is parsed by h11, a maintained HTTP/1.1 parser, with a fresh h11
connection per head. Nothing here touches a socket except `kernel_timeouts`.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import socket
import struct

import h11

# The longest request or answer head either end reads (the blank line excluded).
MAX_HEAD = 8192
# The Authorization scheme of a request: `statereg-hmac t=STAMP,n=NONCE,m=MAC`.
SCHEME = "statereg-hmac"
REASONS = {200: "OK", 206: "Partial Content", 400: "Bad Request", 403: "Forbidden",
           404: "Not Found", 416: "Range Not Satisfiable", 503: "Service Unavailable"}
CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+)$")
UNSATISFIABLE = re.compile(r"^bytes \*/(\d+)$")
RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")
HEX = re.compile(r"^[0-9a-f]+$")
STAMP = re.compile(r"^\d+\.\d{3}$")
# Headers an end acts on: a head that repeats one is refused rather than one copy picked.
_SINGLE_REQUEST = ("host", "authorization", "range", "connection")
_SINGLE_ANSWER = ("content-length", "content-range", "x-statereg-proof", "connection")


class HeadError(Exception):
    """A head that is not the HTTP/1.1 this transport speaks; the message says what."""


def authority(host: str, port: int) -> str:
    """HOST:PORT as a URL and a MAC name it ([HOST]:PORT for an IPv6 address)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def request_mac(secret: bytes, method: str, authority: str, target: str, wanted: str,
                stamp: str, nonce: str) -> str:
    """The HMAC-SHA256 a request carries: its method, the server's address, the target, the
    Range asked ('' for none), its time stamp and nonce, under the job's secret."""
    message = "\n".join(("request", method, authority, target, wanted, stamp, nonce))
    return hmac.new(secret, message.encode(), hashlib.sha256).hexdigest()


def answer_mac(secret: bytes, nonce: str, status: int, content_range: str,
               length: str) -> str:
    """The HMAC-SHA256 an answer carries (X-Statereg-Proof): the request's nonce, and the
    answer's status, Content-Range and Content-Length, under the job's secret."""
    message = "\n".join(("answer", nonce, str(status), content_range, length))
    return hmac.new(secret, message.encode(), hashlib.sha256).hexdigest()


def _fields(headers: list[tuple[bytes, bytes]], single: tuple[str, ...]) -> dict[str, str]:
    """h11's header list as lower-case name -> value; a repeated name in `single` is a
    HeadError (h11 already refuses a repeated Content-Length that disagrees)."""
    fields: dict[str, str] = {}
    for name_bytes, value_bytes in headers:
        name, value = name_bytes.decode("latin-1"), value_bytes.decode("latin-1")
        if name in fields and name in single:
            raise HeadError(f"a repeated {name} header")
        fields[name] = value
    return fields


def parse_request(raw: bytes) -> tuple[str, str, dict[str, str]] | None:
    """A request head (without its blank line) as (method, target, headers), or None if it
    is not one: the server answers that 400. Only the head is read: whatever body the head
    announces is not this function's (the server serves GET and HEAD only)."""
    if len(raw) > MAX_HEAD:
        return None
    parser = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD + 4)
    try:
        parser.receive_data(raw + b"\r\n\r\n")
        event = parser.next_event()
        if not isinstance(event, h11.Request):
            return None
        headers = _fields(list(event.headers), _SINGLE_REQUEST)
    except (h11.ProtocolError, HeadError):
        return None
    return event.method.decode("latin-1"), event.target.decode("latin-1"), headers


def parse_answer(raw: bytes, method: str) -> tuple[int, dict[str, str]]:
    """An answer head (without its blank line) to a `method` request as (status, headers);
    HeadError saying what is wrong where it is not an HTTP/1.1 answer."""
    if len(raw) > MAX_HEAD:
        raise HeadError(f"an answer head longer than {MAX_HEAD} bytes")
    parser = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD + 4)
    parser.send(h11.Request(method=method, target="/", headers=[("Host", "peer")]))
    parser.send(h11.EndOfMessage())
    try:
        parser.receive_data(raw + b"\r\n\r\n")
        event = parser.next_event()
    except h11.ProtocolError as exc:
        first = raw.split(b"\r\n", 1)[0].decode("latin-1")
        raise HeadError(f"an answer that is not HTTP/1.1 ({exc}; {first[:60]!r})") from None
    if not isinstance(event, h11.Response):  # an informational (1xx) answer, or none
        status = getattr(event, "status_code", None)
        raise HeadError(f"an answer that is not a final one (HTTP {status})")
    return event.status_code, _fields(list(event.headers), _SINGLE_ANSWER)


def request_head(method: str, target: str, host: str, mac_fields: str, wanted: str) -> bytes:
    """A request's head: `mac_fields` is `t=STAMP,n=NONCE,m=MAC`, `wanted` the Range ('')."""
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}",
             f"Authorization: {SCHEME} {mac_fields}"]
    if wanted:
        lines.append(f"Range: {wanted}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def answer_head(secret: bytes, status: int, nonce: str, content_range: str, length: int,
                close: bool = False) -> bytes:
    """An answer's head, with the proof that the job's server wrote it."""
    lines = [f"HTTP/1.1 {status} {REASONS[status]}",
             f"Content-Length: {length}", "Accept-Ranges: bytes",
             "X-Statereg-Proof: " + answer_mac(secret, nonce, status, content_range,
                                               str(length))]
    if content_range:
        lines.append(f"Content-Range: {content_range}")
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def bare_answer(status: int) -> bytes:
    """What an unauthenticated request gets: the status alone, and the connection closes."""
    return (f"HTTP/1.1 {status} {REASONS[status]}\r\nContent-Length: 0\r\n"
            "Connection: close\r\n\r\n").encode()


def kernel_timeouts(connection: socket.socket, seconds: float) -> None:
    """Make a blocking socket's sends and receives fail (EAGAIN) after `seconds` without
    progress, as SO_SNDTIMEO / SO_RCVTIMEO do, leaving it blocking for Python: `sendfile`
    then sends a whole body in one call (a Python-level timeout polls once per buffer)."""
    seconds = max(seconds, 0.001)
    value = struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
