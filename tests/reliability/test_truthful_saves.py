"""Saves that tell the truth (issue 13): what save() reports is what a later load() finds.

Refused input writes nothing; a failure after the manifest is a warning, not an error; only
checkpoints that would load count, in step order, whatever the wall clock says."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import torch
from reliability_kit import assert_identical, write_manifest
from torch import nn

import statereg
import statereg.schemas.manifest
from statereg.backends.base import StorageBackend
from statereg.backends.registry import open_backend
from statereg.engine.save_steps import MAX_EXTRA_BYTES
from statereg.schemas.manifest import MAX_MANIFEST_BYTES, MAX_MANIFEST_DEPTH


def manager(store: Any, seed: int = 0, **save: Any) -> tuple[nn.Module, statereg.CheckpointManager]:
    torch.manual_seed(seed)
    model = nn.Linear(8, 4)
    spec = {"storage": {"url": store.url, "options": store.options},
            "components": {"model": {"kind": "model"}}, "save": save}
    return model, statereg.CheckpointManager(spec, model=model)


def names(urls: list[str]) -> list[str]:
    return [u.rsplit("/", 1)[-1] for u in urls]


def deep(levels: int) -> dict[str, Any]:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return {"deep": value}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tokens_seen": "1024"}, r"save\(tokens_seen='1024'\): tokens_seen must be a non-negative"),
    ({"tokens_seen": -1}, r"tokens_seen must be a non-negative int"),
    ({"extra": [("loss", 1.0)]}, r"save\(extra=\.\.\.\) must be a dict of JSON values, got list"),
    ({"extra": deep(100_000)}, rf"nests lists or dicts more than {MAX_MANIFEST_DEPTH - 1} deep"),
    ({"extra": deep(MAX_MANIFEST_DEPTH - 1)}, r"a manifest that deep is refused on load"),
    ({"extra": {"blob": "x" * (MAX_EXTRA_BYTES + 1)}},
     rf"save\(extra=\.\.\.\) is over {MAX_EXTRA_BYTES} bytes as JSON \(at key 'blob'\).*"
     rf"bounded \({MAX_MANIFEST_BYTES} bytes\)"),
    ({"step": True}, r"save\(step=True\): step must be a non-negative int"),
    ({"extra": {"ids": [1, 2**70]}}, r"holds the integer 1180591620717411303424, outside the "
                                     r"64-bit range"),
])
def test_bad_save_arguments_are_refused_before_anything_is_written(store, kwargs, message):
    _, mgr = manager(store)
    with pytest.raises(statereg.SpecError, match=message):
        mgr.save(**{"step": 1, **kwargs})
    assert store.files() == []
    mgr.save(step=1, extra=deep(MAX_MANIFEST_DEPTH - 2))  # the deepest a reader accepts
    assert mgr.load().extra == deep(MAX_MANIFEST_DEPTH - 2)


def test_a_manifest_over_the_readers_bound_is_not_committed(store, monkeypatch):
    _, mgr = manager(store)
    mgr.save(step=1)
    monkeypatch.setattr(statereg.schemas.manifest, "MAX_MANIFEST_BYTES", 1000)
    with pytest.raises(statereg.SpecError, match=r"would be \d+ bytes, over the 1000 byte bound"):
        mgr.save(step=2)
    monkeypatch.undo()
    assert names(mgr.list()) == ["step_00000001"]
    assert mgr.load().step == 1


@pytest.mark.parametrize(("failing", "warning"), [
    ("latest", "step_00000002 is committed, but writing"),
    ("step_00000001/manifest.json", "step_00000002 is committed, but retention failed"),
])
def test_failures_after_the_manifest_are_warnings_not_errors(store, monkeypatch, caplog,
                                                              failing, warning):
    model, mgr = manager(store, keep_last=1)
    mgr.save(step=1)
    backend = open_backend(store.url, store.options)
    real_remove, real_write = type(backend).remove_file, type(backend).write_bytes

    def remove_file(self: StorageBackend, path: str) -> None:
        if path == failing:
            raise statereg.StorageError(f"delete failed for {path}: the server has no delete")
        real_remove(self, path)

    def write_bytes(self: StorageBackend, path: str, data: bytes) -> Any:
        if path == failing:
            raise statereg.StorageError(f"write failed for {path}: no space left on device")
        return real_write(self, path, data)

    monkeypatch.setattr(type(backend), "remove_file", remove_file)
    monkeypatch.setattr(type(backend), "write_bytes", write_bytes)
    with caplog.at_level(logging.WARNING, logger="statereg"):
        url = mgr.save(step=2)  # no raise: step 2 is committed
    monkeypatch.undo()

    assert any(warning in r.getMessage() for r in caplog.records)
    assert names(mgr.list()) == ["step_00000001", "step_00000002"]
    fresh, other = manager(store, seed=1)
    assert other.load().path == url
    assert_identical(fresh.state_dict(), model.state_dict())
    mgr.save(step=3)  # the next save writes `latest` and its retention catches up
    assert names(mgr.list()) == ["step_00000003"]
    assert backend.read_bytes("latest") == b"step_00000003"


def test_a_manifest_write_that_succeeded_but_reported_a_failure_is_committed(store, monkeypatch):
    _, mgr = manager(store)
    backend = open_backend(store.url, store.options)
    real = type(backend).create_bytes

    def create_then_time_out(self: StorageBackend, path: str, data: bytes) -> Any:
        written = real(self, path, data)
        if path.endswith("manifest.json"):
            raise statereg.StorageError(f"write failed for {path}: read timeout")
        return written

    monkeypatch.setattr(type(backend), "create_bytes", create_then_time_out)
    mgr.save(step=1)  # the manifest is there with this save's bytes: it committed
    monkeypatch.undo()
    assert mgr.load().step == 1


def flip_in_string(store: Any, relative: str) -> None:
    """Flip a bit inside the manifest's created_at: still JSON, no longer its checksum."""
    store.fs.invalidate_cache()
    data = store.fs.cat_file(store.path(relative))
    at = data.index(b'"created_at": "') + len(b'"created_at": "')
    store.fs.pipe_file(store.path(relative), data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1:])


def test_retention_never_gives_up_an_intact_checkpoint_for_a_damaged_newer_one(store):
    _, mgr = manager(store, keep_last=2)
    mgr.save(step=1)
    mgr.save(step=2)
    flip_in_string(store, "step_00000002/manifest.json")

    mgr.save(step=3)

    assert names(mgr.list()) == ["step_00000001", "step_00000003"]  # what load() may use
    assert "step_00000002/manifest.json" in store.files()  # damaged: reported, not deleted
    assert mgr.load(step=1).step == 1
    with pytest.raises(statereg.CorruptCheckpointError, match="manifest is damaged"):
        mgr.load(step=2)


def test_resume_and_latest_go_by_step_not_by_the_wall_clock(store):
    _, mgr = manager(store)
    mgr.save(step=5)
    model, mgr = manager(store, seed=1)
    mgr.save(step=6)
    backend = open_backend(store.url, store.options)
    # The clock stepped back an hour before step 6 committed, and the process died before
    # `latest` moved: step 6 looks older than step 5, and `latest` still names step 5.
    manifest = json.loads(backend.read_bytes("step_00000006/manifest.json"))
    manifest["created_at"] = "2020-01-01T00:00:00+00:00"
    write_manifest(backend, "step_00000006", json.dumps(manifest, indent=1).encode())
    backend.write_bytes("latest", b"step_00000005")

    fresh, resumed = manager(store, seed=2)
    assert resumed.load().step == 6
    assert_identical(fresh.state_dict(), model.state_dict())
    resumed.save(step=7)  # never refused as "step 6 exists"
    assert backend.read_bytes("latest") == b"step_00000007"
