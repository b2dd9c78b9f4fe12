"""Real storage servers for the backend suite, and one `store` fixture over every backend.

S3 is moto's standalone server and GCS is gcp-storage-emulator, each a subprocess on a free
127.0.0.1 port, started once per session (only if a test asks for it) and stopped by PID.
Every test gets its own bucket (or directory, or memory:// root), so tests never see each
other's checkpoints.
"""

from __future__ import annotations

import os

# gcsfs picks its filesystem class when it is imported. The experimental class asks a gRPC
# API for every bucket's type, which emulators never answer (a minute's wait per operation),
# so this must be set before anything imports gcsfs.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import pytest
from storage_servers import (
    OutageProxy,
    ServerProcess,
    gcs_options,
    new_bucket,
    s3_options,
    start_server,
)

# -- servers -----------------------------------------------------------------------------


@pytest.fixture(scope="session", autouse=True)
def isolated_cloud_environment() -> Iterator[None]:
    """No ambient credentials, profiles, regions or emulator hosts leak into the tests."""
    with pytest.MonkeyPatch.context() as mp:
        for name in list(os.environ):
            if name.startswith(("AWS_", "GOOGLE_", "GCLOUD_")) or name in (
                "STORAGE_EMULATOR_HOST", "CLOUDSDK_CONFIG",
            ):
                mp.delenv(name)
        mp.setenv("AWS_CONFIG_FILE", os.devnull)
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        mp.setenv("NO_GCE_CHECK", "true")
        yield


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(
        "moto_server", ["-m", "moto.server", "-H", "127.0.0.1", "-p", "{port}"],
        tmp_path_factory.mktemp("s3-server"), "/moto-api/",
    )
    yield server
    server.stop()


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(
        "gcp-storage-emulator",
        ["-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1", "--port", "{port}",
         "--in-memory"],
        tmp_path_factory.mktemp("gcs-server"), "/storage/v1/b",
    )
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_admin(s3_server: ServerProcess) -> Any:
    """A filesystem the tests use to create buckets and to look at or damage objects."""
    return fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False,
                             **s3_options(s3_server.endpoint))


@pytest.fixture(scope="session")
def gcs_admin(gcs_server: ServerProcess) -> Any:
    fs = fsspec.filesystem("gs", skip_instance_cache=True, use_listings_cache=False,
                           **gcs_options(gcs_server.endpoint))
    if type(fs).__name__ == "ExtendedGcsFileSystem":
        pytest.fail("gcsfs was imported before tests/backends/conftest.py could set "
                    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false; run with that variable exported")
    return fs


# -- one store per backend ---------------------------------------------------------------


@dataclass
class Store:
    """A fresh checkpoint root on one backend, and direct access to its objects."""

    kind: str
    url: str
    options: dict[str, Any]
    fs: Any
    root: str
    server: ServerProcess | None = None

    @property
    def remote(self) -> bool:
        return self.server is not None

    def path(self, relative: str) -> str:
        """The filesystem path of `relative` under the root, for `self.fs`."""
        return f"{self.root}/{relative}"

    def files(self) -> list[str]:
        """Every object (file) under the root, relative to it, sorted."""
        self.fs.invalidate_cache()
        try:
            found = self.fs.find(self.root)
        except FileNotFoundError:
            return []
        prefix = f"{self.root.rstrip('/')}/"
        return sorted(p.removeprefix(prefix) for p in found)


def make_store(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if kind == "local":
        root = str(tmp_path / "checkpoints")
        return Store(kind, root, {}, fsspec.filesystem("file"), root)
    if kind == "memory":
        root = f"/statereg-{uuid.uuid4().hex[:12]}"  # memory:// is process-global
        fs = fsspec.filesystem("memory")
        request.addfinalizer(lambda: fs.rm(root, recursive=True) if fs.exists(root) else None)
        return Store(kind, f"memory://{root}", {}, fs, root)
    if kind == "s3":
        server = request.getfixturevalue("s3_server")
        fs = request.getfixturevalue("s3_admin")
        bucket = new_bucket(fs)
        return Store(kind, f"s3://{bucket}/run", s3_options(server.endpoint), fs,
                     f"{bucket}/run", server)
    if kind == "gcs":
        server = request.getfixturevalue("gcs_server")
        fs = request.getfixturevalue("gcs_admin")
        bucket = new_bucket(fs)
        return Store(kind, f"gs://{bucket}/run", gcs_options(server.endpoint), fs,
                     f"{bucket}/run", server)
    raise ValueError(kind)


@pytest.fixture(params=["local", "memory", "s3", "gcs"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    return make_store(request.param, request, tmp_path)


@pytest.fixture(params=["s3", "gcs"])
def remote_store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    return make_store(request.param, request, tmp_path)


@pytest.fixture
def gcs_store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    return make_store("gcs", request, tmp_path)


# -- outages -----------------------------------------------------------------------------


@pytest.fixture
def outage_proxy() -> Iterator[Any]:
    """outage_proxy(server) -> an OutageProxy in front of it, taken down after the test."""
    proxies: list[OutageProxy] = []

    def make(server: ServerProcess) -> OutageProxy:
        proxies.append(OutageProxy(server.port))
        return proxies[-1]

    yield make
    for proxy in proxies:
        proxy.down()
