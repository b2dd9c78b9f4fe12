"""Writes are durable before the commit: on local disk every file and every directory entry
is fsynced before the manifest is linked into place; on S3 every upload is acknowledged
before the manifest's PUT is sent. Checksums come from the bytes as they are written: a
save never reads a data file back."""

from __future__ import annotations

import os
import re
from typing import Any

import pytest
from crash_driver import SINGLE_COMPONENTS, TinyState, declaration

import statereg
from statereg.backends.base import StorageBackend
from statereg.backends.local import LocalBackend


def test_local_files_and_their_directories_are_fsynced_before_the_manifest(tmp_path,
                                                                          monkeypatch):
    events: list[tuple[str, str]] = []
    fsync, link = os.fsync, os.link

    def recording_fsync(fd: int) -> None:
        fsync(fd)
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))

    def recording_link(src: str, dst: str, *args: Any, **kwargs: Any) -> None:
        link(src, dst, *args, **kwargs)
        events.append(("link", os.fspath(dst)))

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "link", recording_link)
    root = tmp_path / "root"
    url = statereg.CheckpointManager(declaration(str(root), {}, SINGLE_COMPONENTS),
                                     **TinyState.trained(1).objects()).save(step=1)
    monkeypatch.undo()

    ckpt = root / "step_00000001"
    commit_at = events.index(("link", str(ckpt / "manifest.json")))
    # Small files go through `<name>.tmp-<pid>-<random>` and a rename: the same bytes.
    before = [(kind, re.sub(r"\.tmp-\d+-[0-9a-f]+$", "", path))
              for kind, path in events[:commit_at]]
    for record in statereg.read_manifest(url).files:
        path = ckpt / record.path
        synced_at = before.index(("fsync", str(path)))  # its bytes, before the manifest
        # ... and then its directory entry, also before the manifest.
        assert ("fsync", str(path.parent)) in before[synced_at:], record.path
    assert ("fsync", str(ckpt)) in before and ("fsync", str(root)) in before
    assert ("fsync", str(ckpt)) in events[commit_at:]  # the manifest's own entry, after it


@pytest.mark.parametrize("store", ["s3"], indirect=True)
def test_s3_uploads_are_acknowledged_before_the_manifest_is_put(store, monkeypatch):
    import s3fs
    from fsspec.asyn import sync_wrapper

    events: list[tuple[str, str]] = []
    call = s3fs.S3FileSystem._call_s3

    async def recording_call(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        key = kwargs.get("Key", "")
        if method in ("put_object", "complete_multipart_upload"):
            events.append(("send", key))
        out = await call(self, method, *args, **kwargs)
        if method in ("put_object", "complete_multipart_upload"):
            events.append(("acknowledged", key))
        return out

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", recording_call)
    monkeypatch.setattr(s3fs.S3FileSystem, "call_s3", sync_wrapper(recording_call))
    url = statereg.CheckpointManager(declaration(store.url, store.options, SINGLE_COMPONENTS),
                                     **TinyState.trained(1).objects()).save(step=1)
    monkeypatch.undo()

    prefix = f"{store.root.split('/', 1)[1]}/step_00000001/"
    manifest_sent = events.index(("send", f"{prefix}manifest.json"))
    acknowledged = {key for kind, key in events[:manifest_sent] if kind == "acknowledged"}
    for record in statereg.read_manifest(url, store.options).files:
        assert f"{prefix}{record.path}" in acknowledged, record.path
    assert f"{prefix}manifest.sum" in acknowledged


@pytest.mark.parametrize("store", ["local", "s3"], indirect=True)
def test_a_save_never_reads_its_data_files_back(store, monkeypatch):
    reads: list[str] = []
    for cls in (StorageBackend, LocalBackend):
        for method in ("read_bytes", "open_read"):
            original = getattr(cls, method)

            def spy(self: Any, path: str, *args: Any, _original: Any = original, **kw: Any):
                reads.append(path)
                return _original(self, path, *args, **kw)

            monkeypatch.setattr(cls, method, spy)
    statereg.CheckpointManager(declaration(store.url, store.options, SINGLE_COMPONENTS),
                               **TinyState.trained(1).objects()).save(step=1)
    monkeypatch.undo()

    data_reads = [p for p in reads if p.split("/")[-1] not in ("manifest.json", "latest")
                  and "/.claim-" not in p]
    assert data_reads == []
    statereg.verify(f"{store.url}/step_00000001", store.options)  # and the sums are right
