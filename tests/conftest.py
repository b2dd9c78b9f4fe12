"""Shared builders for the suite: tiny models, a tiny dataset and a declaration factory.

Everything here is small on purpose: the whole suite runs on CI's two CPU cores. Storage
roots live under pytest's `tmp_path`; S3, GCS and Azure roots live on real local servers (moto
and SeaweedFS for S3, gcp-storage-emulator, Azurite) that start once per session, only if a
test asks. Under pytest-xdist (scripts/test.sh runs the whole suite on two workers) each
worker is a session: it starts its own servers, on free ports, in its own temporary folders.
"""

from __future__ import annotations

import os

# gcsfs picks its filesystem class when it is imported. The experimental class asks a gRPC
# API for every bucket's type, which emulators never answer (a minute's wait per operation),
# so this must be set before anything imports gcsfs.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from storage_servers import (
    AZURITE_BLOB,
    WEED,
    ConditionIgnoringProxy,
    OutageProxy,
    ServerProcess,
    azure_options,
    azurite_args,
    gcs_options,
    new_bucket,
    s3_options,
    seaweedfs_args,
    start_server,
    wait_for_bucket_creation,
)
from torch import nn

import statereg


def pytest_configure(config: pytest.Config) -> None:
    # torchdata's StatefulDataLoader calls a deprecated torch API on every construction.
    config.addinivalue_line("filterwarnings", "ignore:'set_vital' is deprecated:UserWarning")
    config.addinivalue_line("markers", "slow: a test of tests/slow_tests.txt (left out of the "
                                       "quick subset, -m 'not slow')")


# The slow tests, by file or node id, measured (tests/slow_tests.txt says how): what the quick
# subset `./scripts/test.sh -m "not slow"` leaves out. CI runs everything.
SLOW_TESTS = Path(__file__).with_name("slow_tests.txt")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    entries = [line.split("#")[0].strip() for line in SLOW_TESTS.read_text().splitlines()]
    slow = tuple(entry for entry in entries if entry)
    for item in items:
        if item.nodeid.startswith(slow):
            item.add_marker(pytest.mark.slow)


# -- figures a test reports in the run's output ------------------------------------------

_FIGURES: list[str] = []


@pytest.fixture
def report_figure(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """`report_figure(line)`: a figure the test measured (a matrix's size, a sweep's count),
    printed in the run's "figures" section. It travels in the test's report, so it reaches
    the output from a pytest-xdist worker too, whose own stdout nobody sees."""
    return lambda line: request.node.user_properties.append(("figure", line))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call":
        _FIGURES.extend(str(value) for name, value in report.user_properties
                        if name == "figure")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _FIGURES:
        terminalreporter.section("figures")
        for line in _FIGURES:
            terminalreporter.write_line(line)


class TinyNet(nn.Module):
    """Linear -> ReLU -> Dropout -> Linear: 8 features in, 1 out."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


@pytest.fixture
def make_model() -> Callable[..., TinyNet]:
    """`make_model(seed=0, dropout=0.0)`: a TinyNet whose weights depend only on `seed`."""

    def build(seed: int = 0, dropout: float = 0.0) -> TinyNet:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            return TinyNet(dropout)

    return build


@pytest.fixture
def dataset() -> torch.utils.data.TensorDataset:
    """40 fixed samples (8 features -> 1 target), the same in every test."""
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(40, 8, generator=gen)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(40, 1, generator=gen)
    return torch.utils.data.TensorDataset(x, y)


@pytest.fixture
def make_loader(dataset: torch.utils.data.TensorDataset) -> Callable[..., Any]:
    """`make_loader(shuffle=True)`: a torchdata StatefulDataLoader, 10 batches of 4 per epoch."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    def build(shuffle: bool = True) -> StatefulDataLoader:
        return StatefulDataLoader(dataset, batch_size=4, shuffle=shuffle, num_workers=0)

    return build


@pytest.fixture
def make_spec(tmp_path) -> Callable[..., statereg.RegistrySpec]:
    """`make_spec("model", "optimizer", components={...}, save={...})`: a declaration.

    Each positional name declares a component of the kind with the same name; `components`
    adds or replaces declarations; `storage` adds storage fields; other keywords are top-level
    sections. The storage url defaults to `tmp_path / "ckpt"`.
    """

    def build(*names: str, components: dict[str, Any] | None = None, url: str | None = None,
              storage: dict[str, Any] | None = None, **sections: Any) -> statereg.RegistrySpec:
        declared: dict[str, Any] = {name: {"kind": name} for name in names}
        declared.update(components or {})
        storage = {"url": url or str(tmp_path / "ckpt"), **(storage or {})}
        data = {"storage": storage, "components": declared, **sections}
        return statereg.load_spec(data, environ={})

    return build


def sgd_batch(model: nn.Module, optimizer: torch.optim.Optimizer,
              batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """One training step on `batch` (MSE); returns the detached loss."""
    x, y = batch
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.detach()


@pytest.fixture
def train_step() -> Callable[..., torch.Tensor]:
    """`train_step(model, optimizer, (x, y))`: one optimizer step; returns the loss."""
    return sgd_batch


# -- storage servers: subprocesses on free 127.0.0.1 ports, stopped by PID ---------------


class RecordCodeRan(BaseException):
    """statereg's record code ran under $STATEREG_PLAIN_TORCH_SAVE=1: a BaseException, so no
    fallback of the code under test (the probes catch AssertionError) can swallow it."""


@pytest.fixture
def plain_torch_save(monkeypatch: pytest.MonkeyPatch) -> None:
    """$STATEREG_PLAIN_TORCH_SAVE=1, and statereg's own torch.save record code made to fail
    wherever it would still run: the test proves the switch bypasses all of it."""
    from statereg.dcp.torchsave import crc_stream, crcs, layout, read, templates

    monkeypatch.setenv("STATEREG_PLAIN_TORCH_SAVE", "1")
    monkeypatch.setattr(layout, "_plain", None)  # read again at the next record

    def bypassed(*args: object, **kwargs: object) -> None:
        raise RecordCodeRan("statereg's record code ran under STATEREG_PLAIN_TORCH_SAVE=1")

    for module, name in [(crc_stream, "save_crc_records"), (templates, "write_templated"),
                         (crcs, "_add_crcs"), (read, "_read_into"), (read, "_walked")]:
        monkeypatch.setattr(module, name, bypassed)


@pytest.fixture(params=["statereg records", "plain torch.save"])
def record_code(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Runs a test both ways: through statereg's own torch.save record code, and with
    $STATEREG_PLAIN_TORCH_SAVE=1 (`plain_torch_save`: none of that code may run). True when
    plain."""
    plain = request.param == "plain torch.save"
    if plain:
        request.getfixturevalue("plain_torch_save")
    else:
        from statereg.dcp.torchsave import layout

        monkeypatch.delenv("STATEREG_PLAIN_TORCH_SAVE", raising=False)
        monkeypatch.setattr(layout, "_plain", None)
    return plain


@pytest.fixture(scope="session", autouse=True)
def isolated_cloud_environment() -> Iterator[None]:
    """No ambient credentials, profiles, regions or emulator hosts leak into the tests, nor a
    $STATEREG_PLAIN_TORCH_SAVE (the tests that run both ways set it: `record_code`)."""
    with pytest.MonkeyPatch.context() as mp:
        for name in list(os.environ):
            if name.startswith(("AWS_", "GOOGLE_", "GCLOUD_", "AZURE_")) or name in (
                "STORAGE_EMULATOR_HOST", "CLOUDSDK_CONFIG", "STATEREG_PLAIN_TORCH_SAVE",
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


def _installed(program: Any) -> str:
    if not program.exists():
        pytest.fail(f"{program} is missing; run ./scripts/setup.sh, which installs it")
    return str(program)


@pytest.fixture(scope="session")
def azure_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The Azurite emulator's blob service (npm package, installed by scripts/setup.sh)."""
    server = start_server("azurite", azurite_args(), tmp_path_factory.mktemp("azure-server"),
                          "/devstoreaccount1?comp=list", program=_installed(AZURITE_BLOB))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def seaweedfs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """SeaweedFS's S3 gateway: a second, independent S3 implementation beside moto."""
    workspace = tmp_path_factory.mktemp("seaweedfs-server")
    server = start_server("seaweedfs", seaweedfs_args(workspace), workspace, "/",
                          program=_installed(WEED))
    yield server
    server.stop()
    # Its gRPC sockets are always made in /tmp (no flag moves them): remove this server's.
    for arg in server.process.args:
        if ".grpc=" in arg:
            Path(f"/tmp/seaweedfs-{arg.split('.')[0].lstrip('-')}-grpc-"
                 f"{arg.split('=')[1]}.sock").unlink(missing_ok=True)


@pytest.fixture(scope="session")
def azure_admin(azure_server: ServerProcess) -> Any:
    return fsspec.filesystem("az", skip_instance_cache=True, use_listings_cache=False,
                             **azure_options(azure_server.endpoint))


@pytest.fixture(scope="session")
def seaweedfs_admin(seaweedfs_server: ServerProcess) -> Any:
    fs = fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False,
                           **s3_options(seaweedfs_server.endpoint))
    wait_for_bucket_creation(fs)  # the S3 gateway answers before its filer is ready
    return fs


@pytest.fixture(scope="session")
def seaweedfs_bucket(seaweedfs_admin: Any) -> str:
    """The one bucket of the session: SeaweedFS gives each bucket its own volumes, seven at a
    time, so a bucket per test would soon run out; each test gets its own prefix instead."""
    return new_bucket(seaweedfs_admin)


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
        pytest.fail("gcsfs was imported before tests/conftest.py could set "
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
    if kind == "seaweedfs":
        server = request.getfixturevalue("seaweedfs_server")
        fs = request.getfixturevalue("seaweedfs_admin")
        root = f"{request.getfixturevalue('seaweedfs_bucket')}/run-{uuid.uuid4().hex[:12]}"
        return Store(kind, f"s3://{root}", s3_options(server.endpoint), fs, root, server)
    if kind == "azure":
        server = request.getfixturevalue("azure_server")
        fs = request.getfixturevalue("azure_admin")
        bucket = new_bucket(fs)
        return Store(kind, f"az://{bucket}/run", azure_options(server.endpoint), fs,
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


@pytest.fixture(params=["local", "memory", "s3", "seaweedfs", "gcs", "azure"])
def every_store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    """`store` on every server the tests start too: SeaweedFS (a second S3) and Azurite.
    The backend suite runs over these; the slower suites keep the four of `store`."""
    return make_store(request.param, request, tmp_path)


@pytest.fixture(params=["s3", "seaweedfs", "gcs", "azure"])
def every_remote_store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    return make_store(request.param, request, tmp_path)


@pytest.fixture
def azure_store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    return make_store("azure", request, tmp_path)


@pytest.fixture(params=["s3", "gcs"])
def remote_store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    return make_store(request.param, request, tmp_path)


@pytest.fixture
def gcs_store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    return make_store("gcs", request, tmp_path)


# -- outages -----------------------------------------------------------------------------


@pytest.fixture
def condition_ignoring_proxy(s3_server: ServerProcess) -> Iterator[Any]:
    """moto behind a relay that drops If-None-Match: an S3 server ignoring conditions."""
    proxy = ConditionIgnoringProxy(s3_server.port)
    yield proxy
    proxy.down()


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
