"""Exclusive creates: of racing writers exactly one wins, on every store the tests start; a
store that does not enforce them is detected once per root and reported, never trusted.
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any

import pytest
from storage_servers import new_bucket, s3_options

import statereg
from statereg.backends.base import PROBE_PREFIX, StorageBackend
from statereg.backends.registry import open_backend

RACERS = 8


def race(make_backend: Any, path: str) -> dict[int, BaseException | None]:
    """RACERS threads, each with its own backend (as separate processes would have), create
    `path` at once with their own bytes; the outcome of each."""
    start = threading.Barrier(RACERS)
    outcome: dict[int, BaseException | None] = {}

    def racer(number: int) -> None:
        backend = make_backend()
        start.wait()
        try:
            backend.create_bytes(path, f"writer {number}".encode())
            outcome[number] = None
        except BaseException as exc:  # every outcome is asserted below
            outcome[number] = exc

    threads = [threading.Thread(target=racer, args=(n,)) for n in range(RACERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return outcome


def fresh_options(store: Any) -> dict[str, Any]:
    # fsspec caches one filesystem instance per option set; another process has its own.
    return {**store.options, "skip_instance_cache": True} if store.remote else store.options


def assert_one_winner(outcome: dict[int, BaseException | None], stored: bytes) -> None:
    winners = [n for n, error in outcome.items() if error is None]
    losers = {type(error) for error in outcome.values() if error is not None}
    assert len(outcome) == RACERS
    assert len(winners) == 1, f"{len(winners)} of {RACERS} racing creates won"
    assert losers == {FileExistsError}
    assert stored == f"writer {winners[0]}".encode()  # nobody overwrote the winner


def test_of_racing_exclusive_creates_exactly_one_wins(every_store, caplog):
    if every_store.kind == "gcs":
        pytest.skip("gcp-storage-emulator ignores ifGenerationMatch=0 (see the next tests)")
    outcome = race(lambda: open_backend(every_store.url, fresh_options(every_store)),
                   "step_00000001/.claim-0")
    assert_one_winner(outcome, every_store.fs.cat_file(every_store.path("step_00000001/.claim-0")))
    assert "not enforced" not in caplog.text  # each server was probed and honours it
    assert every_store.files() == ["step_00000001/.claim-0"]  # the probe object is gone


def test_the_generic_fsspec_backend_creates_conditionally(azure_store):
    # Before the Azure module, az:// went through the generic backend, whose create was
    # exists() then an overwriting write: on Azurite 8 of 8 racing creates "won".
    url, options = azure_store.url, fresh_options(azure_store)
    outcome = race(lambda: StorageBackend(url, options), "claim")
    assert_one_winner(outcome, azure_store.fs.cat_file(azure_store.path("claim")))


def test_a_store_that_ignores_conditional_creates_is_reported_once(gcs_store, caplog):
    backend = open_backend(gcs_store.url, gcs_store.options)
    caplog.set_level(logging.WARNING, logger="statereg")

    backend.create_bytes("a", b"1")
    problem = backend.check_exclusive_create()
    backend.create_bytes("b", b"2")
    open_backend(gcs_store.url, gcs_store.options).create_bytes("c", b"3")

    assert problem is not None and "accepted a second exclusive create" in problem
    warnings = [r.getMessage() for r in caplog.records if "not enforced" in r.getMessage()]
    assert len(warnings) == 1, warnings  # once per root, however many creates and backends
    assert warnings[0].startswith(f"exclusive create is not enforced at {gcs_store.url}:")
    assert "require_exclusive: true" in warnings[0]
    assert gcs_store.files() == ["a", "b", "c"]  # no probe object left behind


def test_an_s3_server_that_ignores_if_none_match_is_detected(condition_ignoring_proxy,
                                                             s3_admin, caplog):
    bucket = new_bucket(s3_admin)
    url, options = f"s3://{bucket}/run", s3_options(condition_ignoring_proxy.endpoint)
    backend = open_backend(url, options)

    backend.create_bytes("claim", b"first")
    backend.create_bytes("claim", b"second")  # what such a server does: it overwrites

    assert s3_admin.cat_file(f"{bucket}/run/claim") == b"second"
    assert caplog.text.count(f"exclusive create is not enforced at {url}: the store accepted "
                             "a second exclusive create") == 1
    with pytest.raises(statereg.StorageError, match="require_exclusive is true"):
        open_backend(url, {**options, "require_exclusive": True}).create_bytes("other", b"x")
    assert s3_admin.find(bucket) == [f"{bucket}/run/claim"]  # no probe object, no "other"


def test_require_exclusive_refuses_such_a_store_before_writing(gcs_store, make_model):
    options = {**gcs_store.options, "require_exclusive": True}
    declaration = {"storage": {"url": gcs_store.url, "options": options},
                   "components": {"model": {"kind": "model"}}}
    mgr = statereg.CheckpointManager(declaration, model=make_model())

    with pytest.raises(statereg.StorageError) as saving:
        mgr.save(step=1)

    message = str(saving.value)
    assert message.startswith(f"exclusive create is not enforced at {gcs_store.url}: the "
                              "store accepted a second exclusive create")
    assert "storage.options.require_exclusive is true" in message
    assert gcs_store.files() == []  # not even a claim: nothing was written


def test_require_exclusive_passes_where_the_store_honours_it(every_remote_store):
    if every_remote_store.kind == "gcs":
        pytest.skip("gcp-storage-emulator ignores ifGenerationMatch=0")
    options = {**every_remote_store.options, "require_exclusive": True}
    backend = open_backend(every_remote_store.url, options)
    assert backend.check_exclusive_create() is None
    backend.create_bytes("claim", b"mine")
    with pytest.raises(FileExistsError):
        backend.create_bytes("claim", b"theirs")
    assert every_remote_store.fs.cat_file(every_remote_store.path("claim")) == b"mine"
    assert "require_exclusive" not in str(backend.fs.storage_options)  # statereg's own


def test_a_filesystem_that_only_checks_then_writes_is_reported(tmp_path, caplog):
    # fsspec's LocalFileSystem has no pipe_file of its own: "create" is exists() then write.
    root = tmp_path / f"generic-{uuid.uuid4().hex[:8]}"
    root.mkdir()
    url = f"file://{root}"
    StorageBackend(url).create_bytes("claim", b"1")
    assert "has no conditional write" in caplog.text
    assert "LocalFileSystem" in caplog.text

    with pytest.raises(statereg.StorageError, match="has no conditional write"):
        StorageBackend(url, {"require_exclusive": True}).create_bytes("other", b"2")
    assert (root / "claim").read_bytes() == b"1" and not (root / "other").exists()
    assert not list(tmp_path.rglob(f"{PROBE_PREFIX}*"))


def test_require_exclusive_must_be_a_boolean():
    with pytest.raises(statereg.SpecError,
                       match=r"storage.options.require_exclusive for 'memory://x' must be "
                             r"true or false, not 'yes'"):
        open_backend("memory://x", {"require_exclusive": "yes"})
