"""When S3 or GCS goes away, a save fails with a StorageError and the last checkpoint survives.

Retries are turned low so each failure is reported in about a second: botocore's through
`config_kwargs` (a storage option), gcsfs's by declaring no error retriable, since gcsfs's
HTTP retry count is fixed in the library (six tries, about 30 s of back-off).
"""

from __future__ import annotations

import re
import time
import uuid
from contextlib import contextmanager
from typing import Any

import gcsfs.retry
import pytest
from storage_servers import S3_FAIL_FAST, free_port, gcs_options, s3_options
from tiny_training import COMPONENTS, TinyRun, assert_identical

import statereg
import statereg.engine.save_steps

# Step 2's model files: under `writer-<token>/` on a store that needs one (the GCS emulator,
# which ignores conditional creates).
MODEL_FILES = re.compile(r"step_00000002/(writer-[0-9a-f]{32}/)?model/")


def options_for(store: Any, endpoint: str, **extra: Any) -> dict[str, Any]:
    if store.kind == "s3":
        return s3_options(endpoint, config_kwargs=S3_FAIL_FAST, **extra)
    return gcs_options(endpoint, **extra)


@contextmanager
def gcsfs_fails_fast(monkeypatch: pytest.MonkeyPatch) -> Any:
    with monkeypatch.context() as patch:
        patch.setattr(gcsfs.retry, "is_retriable", lambda exc: False)
        yield


def manager(store: Any, options: dict[str, Any], run: TinyRun) -> statereg.CheckpointManager:
    spec = {"storage": {"url": store.url, "options": options}, "components": COMPONENTS}
    return statereg.CheckpointManager(spec, **run.objects)


def test_an_unreachable_server_is_a_storage_error_naming_url_and_operation(
        remote_store, monkeypatch):
    secret = f"do-not-leak-{uuid.uuid4().hex}"
    monkeypatch.setenv("FETCH_RAW_TOKEN_EXPIRY", "false")
    dead = f"http://127.0.0.1:{free_port()}"
    credential = {"secret": secret} if remote_store.kind == "s3" else {"token": secret}
    mgr = manager(remote_store, options_for(remote_store, dead, **credential), TinyRun(seed=0))

    started = time.monotonic()
    with gcsfs_fails_fast(monkeypatch):
        with pytest.raises(statereg.StorageError) as saving:
            mgr.save(step=1)
        with pytest.raises(statereg.StorageError) as listing:
            mgr.list()

    assert time.monotonic() - started < 15
    assert str(saving.value).startswith(f"read failed for {remote_store.url}/step_00000001/")
    assert str(listing.value).startswith(f"list failed for {remote_store.url}:")
    for error in (saving.value, listing.value):
        assert "127.0.0.1" in str(error)  # the client's own reason is kept
        assert secret not in str(error)


def test_a_server_lost_before_the_manifest_keeps_the_last_checkpoint(
        remote_store, outage_proxy, monkeypatch):
    proxy = outage_proxy(remote_store.server)
    options = options_for(remote_store, proxy.endpoint)
    run = TinyRun(seed=0)
    mgr = manager(remote_store, options, run)
    run.train()
    mgr.save(step=1)
    saved = run.snapshot()
    run.train()

    commit = statereg.engine.save_steps.commit

    def server_dies_then_commit(*args: Any) -> None:
        proxy.down()
        commit(*args)

    with gcsfs_fails_fast(monkeypatch), monkeypatch.context() as patch:
        patch.setattr(statereg.engine.save_steps, "commit", server_dies_then_commit)
        with pytest.raises(statereg.StorageError) as failed:
            mgr.save(step=2)
    # The commit's first request fails: the check that this save still holds its claim.
    assert str(failed.value).startswith(
        f"list failed for {remote_store.url}/step_00000002:")

    proxy.up()
    written = remote_store.files()
    assert "step_00000002/manifest.json" not in written
    assert any(MODEL_FILES.match(p) for p in written)

    fresh = TinyRun(seed=1)
    reader = manager(remote_store, options, fresh)
    assert reader.list() == [f"{remote_store.url}/step_00000001"]
    assert reader.load().step == 1
    assert_identical(fresh.snapshot(), saved)

    mgr.save(step=2)  # the same process carries on once the server is back
    assert reader.latest() == f"{remote_store.url}/step_00000002"


def test_a_server_lost_while_tensors_upload_keeps_the_last_checkpoint(
        remote_store, outage_proxy, monkeypatch):
    proxy = outage_proxy(remote_store.server)
    options = options_for(remote_store, proxy.endpoint)
    filesystem_class = type(remote_store.fs)
    upload = filesystem_class._pipe_file

    died: list[str] = []

    async def server_dies_during_model_upload(self: Any, path: str, *args: Any, **kw: Any) -> Any:
        if MODEL_FILES.search(path) and not died:
            died.append(path)
            proxy.down()
        return await upload(self, path, *args, **kw)

    # Patched before the manager opens its filesystem: fsspec binds sync methods at creation.
    monkeypatch.setattr(filesystem_class, "_pipe_file", server_dies_during_model_upload)
    run = TinyRun(seed=0)
    mgr = manager(remote_store, options, run)
    mgr.save(step=1)

    with gcsfs_fails_fast(monkeypatch), pytest.raises(statereg.StorageError) as failed:
        mgr.save(step=2)
    assert re.search(re.escape(f"{remote_store.url}/") + MODEL_FILES.pattern, str(failed.value))

    proxy.up()
    assert "step_00000002/manifest.json" not in remote_store.files()
    reader = manager(remote_store, options, TinyRun(seed=1))
    assert reader.load().step == 1

    mgr.save(step=2)
    assert reader.latest() == f"{remote_store.url}/step_00000002"
