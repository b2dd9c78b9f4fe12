"""The I/O policy: decided in the engine from what kind of store a backend is, shown by
`statereg plan`; no storage class carries an engine decision."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from statereg.backends.azure import AzureBackend
from statereg.backends.base import StorageBackend
from statereg.backends.capabilities import StoreCapabilities
from statereg.backends.gcs import GCSBackend
from statereg.backends.kernel import in_memory
from statereg.backends.local import LocalBackend
from statereg.backends.memory import MemoryBackend
from statereg.backends.registry import open_backend
from statereg.backends.s3 import S3Backend
from statereg.backends.shm import SharedMemoryBackend
from statereg.cli import main
from statereg.engine.io_policy import IOPolicy, io_policy, memory_writers
from statereg.tiers.node_memory import NodeMemoryBackend

REPO = Path(__file__).resolve().parents[2]
W = memory_writers()
# Today's decisions, as the five class attributes held them before the policy moved to the
# engine: io threads, broadcast reads, components together (uncompressed, compressed),
# zip CRC-32s; and whether a compressed save goes around the page cache (read_cache auto).
BEFORE = {
    "generic fsspec": (StorageBackend.kind, 2, True, True, True, True, False),
    "memory://": (MemoryBackend.kind, 2, True, True, True, True, False),
    "local disk": (LocalBackend.kind, 2, True, True, False, True, True),
    "local path on a tmpfs": (LocalBackend.capabilities_at("/dev/shm/run"), 2, True, True,
                              False, True, False),
    "shm://": (SharedMemoryBackend.kind, W, False, False, False, False, False),
    # $STATEREG_SHM_DIR on a disk (warned about): compressed files went around its cache.
    "shm:// in a folder on a disk": (dataclasses.replace(SharedMemoryBackend.kind,
                                                         page_cache=True),
                                     W, False, False, False, False, True),
    "shm:// with files on peers": (dataclasses.replace(NodeMemoryBackend.kind,
                                                       latency="network"),
                                   W, True, False, False, False, False),
    "s3://": (S3Backend.kind, 8, True, True, True, True, False),
    "gs://": (GCSBackend.kind, 8, True, True, True, True, False),
    "az://": (AzureBackend.kind, 8, True, True, True, True, False),
}


@pytest.mark.parametrize("store", sorted(BEFORE))
@pytest.mark.parametrize("compressed", [False, True])
def test_the_policy_of_each_kind_of_store_is_the_decisions_its_class_held(store: str,
                                                                          compressed: bool,
                                                                          ) -> None:
    caps, threads, broadcast, together, together_compressed, crcs, around = BEFORE[store]
    policy = io_policy(caps, compressed=compressed)
    assert policy == IOPolicy(
        write_threads=threads, read_threads=threads,
        parallel_components=together_compressed if compressed else together,
        broadcast_reads=broadcast,
        record_crcs=crcs or compressed,  # compressed records always carried them
        write_around_cache=around and compressed,
    )
    # storage.io_threads sets the files written and read at once (docs/yaml-reference.md);
    # read_cache: keep keeps compressed files in the cache too.
    assert io_policy(caps, io_threads=5, compressed=compressed).write_threads == 5
    assert io_policy(caps, io_threads=5).read_threads == 5
    assert not io_policy(caps, compressed=compressed, read_cache="keep").write_around_cache


def test_an_open_backend_reports_its_kind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          ) -> None:
    assert open_backend("memory://policy").capabilities == MemoryBackend.kind
    assert open_backend("shm://run7/policy").capabilities == SharedMemoryBackend.kind
    monkeypatch.setenv("STATEREG_SHM_DIR", str(tmp_path))  # a disk, unless /tmp is a tmpfs
    assert open_backend("shm://run7/policy").capabilities.page_cache is not in_memory(
        str(tmp_path))
    monkeypatch.delenv("STATEREG_SHM_DIR")
    assert open_backend(str(tmp_path)).capabilities == LocalBackend.capabilities_at(
        str(tmp_path))
    node = NodeMemoryBackend("shm://run7/policy-peers")
    assert io_policy(node.capabilities).broadcast_reads is False
    node.locate({}, on_peers=True)  # a restore found a file only on another node
    assert io_policy(node.capabilities).broadcast_reads is True


REMOVED = ("parallel_components", "parallel_compressed_components", "broadcast_reads",
           "record_crcs", "default_io_threads")


@pytest.mark.parametrize("cls", [StorageBackend, MemoryBackend, LocalBackend,
                                 SharedMemoryBackend, NodeMemoryBackend, S3Backend,
                                 GCSBackend, AzureBackend])
def test_no_storage_class_carries_an_engine_decision(cls: type[StorageBackend]) -> None:
    assert [name for name in REMOVED if hasattr(cls, name)] == []
    assert isinstance(cls.kind, StoreCapabilities)


def test_no_context_variable_steers_writes() -> None:
    sources = {p: p.read_text() for p in (REPO / "statereg").rglob("*.py")}
    assert [p for p, text in sources.items() if "WRITE_AROUND_CACHE" in text] == []
    assert [p for p, text in sources.items()
            if "ContextVar" in text and "/backends/" in str(p)] == []


def _declaration(tmp_path: Path, url: str, storage: str = "") -> Path:
    path = tmp_path / "statereg.yaml"
    path.write_text(f"storage: {{url: {url!r}{storage}}}\ncomponents:\n  model: {{kind: model}}\n")
    return path


def test_plan_prints_the_io_policy_it_chose(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(_declaration(tmp_path, "s3://bucket/run"))]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^store: +object-store \(network latency\)$", out, re.MULTILINE)
    assert re.search(r"^I/O: +8 writers, 8 readers per rank; components together; broadcast "
                     r"reads; zip CRC-32s on; through the page cache$", out, re.MULTILINE)

    assert main(["plan", str(_declaration(tmp_path, "shm://run", ", io_threads: 3"))]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^I/O: +3 writers, 3 readers per rank; components one at a time; "
                     "each rank reads; zip CRC-32s off; through the page cache$", out,
                     re.MULTILINE)


def test_plan_json_has_the_store_and_its_io_policy(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    disk = tmp_path / "ckpts"
    yaml = _declaration(tmp_path, str(disk), ", compression: zstd")
    assert main(["plan", str(yaml), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    caps = LocalBackend.capabilities_at(str(disk))
    assert plan["store"] == dataclasses.asdict(caps)
    assert plan["io"] == dataclasses.asdict(io_policy(caps, compressed=True))
    # A compressed save on a local disk: one component at a time, around the page cache
    # (unless the test's folder is a tmpfs, where the cache is the store).
    assert plan["io"]["parallel_components"] is False
    assert plan["io"]["write_around_cache"] is caps.page_cache
