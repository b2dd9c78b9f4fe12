"""What statereg/backends/s3.py, gcs.py and azure.py add to the generic backend, on the real
servers (moto and SeaweedFS for S3, gcp-storage-emulator, Azurite)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import uuid
from typing import Any

import gcsfs.core
import pytest
import requests
import torch
from torch import nn

import statereg
from statereg.backends.azure import AzureBackend
from statereg.backends.gcs import GCSBackend
from statereg.backends.registry import backend_class, open_backend
from statereg.backends.s3 import S3Backend
from statereg.engine.io_policy import io_policy

PACKAGE = {"s3": "s3fs", "gcs": "gcsfs", "azure": "adlfs"}
SCHEME = {"s3": "s3", "gcs": "gs", "azure": "az"}


def model_only(url: str, options: dict[str, Any]) -> dict[str, Any]:
    return {"storage": {"url": url, "options": options},
            "components": {"model": {"kind": "model"}}}


@pytest.mark.parametrize(("url", "expected"), [
    ("s3://bkt/run", S3Backend), ("s3a://bkt/run", S3Backend),
    ("gs://bkt/run", GCSBackend), ("gcs://bkt/run", GCSBackend),
    ("az://container/run", AzureBackend), ("abfs://container/run", AzureBackend),
    ("abfss://container/run", AzureBackend),
])
def test_each_scheme_has_its_backend(url, expected):
    assert backend_class(url) is expected


@pytest.mark.parametrize("kind", ["s3", "gcs", "azure"])
def test_without_the_client_package_the_url_says_what_to_install(kind, monkeypatch):
    monkeypatch.setitem(sys.modules, PACKAGE[kind], None)  # import fails as if not installed
    url = f"{SCHEME[kind]}://bkt/run"
    with pytest.raises(statereg.SpecError, match=rf"pip install 'statereg\[{kind}\]'"):
        statereg.CheckpointManager(model_only(url, {}), model=nn.Linear(2, 2))


def test_the_client_packages_are_imported_only_when_their_scheme_is_used():
    code = ("import sys, statereg.backends as b; b.open_backend('memory://x'); "
            "assert not {'s3fs', 'gcsfs', 'adlfs'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_missing_bucket_is_an_error_not_an_empty_run(every_remote_store):
    scheme = every_remote_store.url.split("://")[0]
    bucket = f"statereg-missing-{uuid.uuid4().hex[:8]}"
    url = f"{scheme}://{bucket}/run"
    mgr = statereg.CheckpointManager(model_only(url, every_remote_store.options),
                                     model=nn.Linear(2, 2))
    missing = rf"{'container' if scheme == 'az' else 'bucket'} '{bucket}' does not exist"

    with pytest.raises(statereg.StorageError, match=missing) as loading:
        mgr.load()  # a resume must not silently start from scratch
    with pytest.raises(statereg.StorageError, match=missing):
        mgr.save(step=1)
    assert str(loading.value).startswith(f"list failed for {url}")
    backend = open_backend(url, every_remote_store.options)
    with pytest.raises(statereg.StorageError, match=missing):
        backend.walk()
    if every_remote_store.kind != "seaweedfs":  # SeaweedFS answers a PUT there AccessDenied
        with pytest.raises(statereg.StorageError, match=missing):
            backend.write_bytes("latest", b"step_00000001")


def test_a_file_larger_than_a_part_is_uploaded_in_parts_and_reads_back_whole(
        remote_store, monkeypatch):
    uploads: list[int] = []
    if remote_store.kind == "s3":
        monkeypatch.setattr(S3Backend, "upload_options", {"chunksize": 5 * 2**20})  # S3's least
    else:
        monkeypatch.setattr(GCSBackend, "upload_options", {"chunksize": 2**20})  # n x 256 KiB
        upload_chunk = gcsfs.core.upload_chunk

        async def counted(fs: Any, location: str, data: Any, *args: Any) -> Any:
            uploads.append(len(data))
            return await upload_chunk(fs, location, data, *args)

        monkeypatch.setattr(gcsfs.core, "upload_chunk", counted)

    torch.manual_seed(0)
    model = nn.Linear(1024, 3072)  # a 12 MiB weight
    url = statereg.CheckpointManager(model_only(remote_store.url, remote_store.options),
                                     model=model).save(step=1)
    manifest = statereg.verify(url, remote_store.options)
    largest = max(manifest.files, key=lambda f: f.size)
    assert largest.size > 12 * 2**20

    if remote_store.kind == "s3":
        etag = remote_store.fs.info(remote_store.path(f"step_00000001/{largest.path}"))["ETag"]
        assert etag.strip('"').endswith("-3")  # the server assembled three parts
    else:
        assert len(uploads) == 13 and sum(uploads) == largest.size

    restored = nn.Linear(1024, 3072)
    statereg.CheckpointManager(model_only(remote_store.url, remote_store.options),
                               model=restored).load()
    assert torch.equal(restored.weight, model.weight) and torch.equal(restored.bias, model.bias)


def test_prefixes_exist_like_directories_and_remove_tree_stays_inside_one(every_remote_store):
    remote_store = every_remote_store
    backend = open_backend(remote_store.url, remote_store.options)
    for path in ("a/b/x", "a/b/deep/y", "a/bc/z", "a/b2"):
        backend.write_bytes(path, b"data")

    assert backend.exists("a/b") and backend.exists("a/b/x")
    assert not backend.exists("a/nothing")
    assert backend.list_dir("a") == ["b", "b2", "bc"]
    assert backend.list_dir("a/nothing") == []

    backend.remove_tree("a/b")
    backend.remove_tree("a/nothing")  # a missing prefix is not an error
    assert remote_store.files() == ["a/b2", "a/bc/z"]


def test_a_gcs_token_repeated_by_the_client_library_is_withheld(gcs_store, monkeypatch):
    token = f"ya29.do-not-leak-{uuid.uuid4().hex}"

    def unreachable(url: str, params: dict[str, str], **kwargs: Any) -> Any:
        # What requests says when oauth2.googleapis.com cannot be reached, verbatim in form.
        raise requests.ConnectionError(
            f"HTTPSConnectionPool(host='oauth2.googleapis.com', port=443): Max retries "
            f"exceeded with url: /tokeninfo?access_token={params['access_token']}"
        )

    monkeypatch.setattr(requests, "get", unreachable)
    options = {**gcs_store.options, "token": token, "skip_instance_cache": True}
    with pytest.raises(statereg.StorageError) as opening:
        open_backend(gcs_store.url, options)

    message = str(opening.value)
    assert message.startswith(f"open filesystem failed for {gcs_store.url}")
    assert token not in message and "<redacted>" in message
    assert opening.value.__cause__ is None and opening.value.__suppress_context__


def test_an_emulator_behind_gcsfs_experimental_class_gets_a_warning(gcs_store, monkeypatch,
                                                                    caplog):
    # What a user gets without GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false: each operation first
    # waits 15-90 s for a gRPC bucket-type lookup that an emulator never answers.
    from gcsfs.extended_gcsfs import ExtendedGcsFileSystem

    registry = importlib.import_module("fsspec.registry")  # `fsspec.registry` is a mapping
    monkeypatch.setitem(registry._registry, "gs", ExtendedGcsFileSystem)
    open_backend(gcs_store.url, {**gcs_store.options, "skip_instance_cache": True})
    assert "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false" in caplog.text


def test_exists_and_size_see_what_another_process_wrote_after_a_listing(every_remote_store):
    remote_store = every_remote_store
    # Two filesystem instances, as two processes would have (fsspec caches instances).
    this = open_backend(remote_store.url, {**remote_store.options, "skip_instance_cache": True})
    other = open_backend(remote_store.url, {**remote_store.options, "skip_instance_cache": True})
    this.write_bytes("step_00000001/manifest.json", b"{}")
    assert this.list_dir("step_00000001") == ["manifest.json"]

    other.write_bytes("step_00000001/model/__0_0.distcp", b"tensor bytes")

    assert this.exists("step_00000001/model/__0_0.distcp")
    assert this.size("step_00000001/model/__0_0.distcp") == len(b"tensor bytes")
    assert this.list_dir("step_00000001") == ["manifest.json", "model"]


def test_azure_keeps_no_listing_cache_and_writes_like_the_other_object_stores(azure_store):
    backend = open_backend(azure_store.url, azure_store.options)
    assert isinstance(backend, AzureBackend)
    assert backend.fs.dircache.use_listings_cache is False  # adlfs caches listings otherwise
    assert io_policy(backend.capabilities) == io_policy(S3Backend.kind)
    assert io_policy(backend.capabilities).read_threads == 8
    written = backend.write_bytes("step_00000001/model/__0_0.distcp", b"tensor bytes")
    assert (written.path, written.size) == ("step_00000001/model/__0_0.distcp", 12)
    assert backend.read_bytes("step_00000001/model/__0_0.distcp") == b"tensor bytes"
    assert [(f.path, f.size) for f in backend.walk()] == [
        ("step_00000001/model/__0_0.distcp", 12)]


@pytest.fixture(params=["s3", "seaweedfs"])
def s3_kind_store(request: pytest.FixtureRequest, tmp_path: Any) -> Any:
    """A fresh root on each S3 server the tests start (moto, SeaweedFS)."""
    from tests.conftest import make_store

    return make_store(request.param, request, tmp_path)


def test_an_s3_file_is_uploaded_in_parts_while_it_is_written_and_an_abort_leaves_nothing(
        s3_kind_store, monkeypatch):
    """Parts leave as the file is built, not after: a multipart upload is under way before
    the stream closes; closing completes it (the server assembled each part); a writer that
    raised aborts its upload, leaving neither an object nor an incomplete upload."""
    monkeypatch.setattr(S3Backend, "upload_options", {"chunksize": 5 * 2**20})
    backend = open_backend(s3_kind_store.url, s3_kind_store.options)
    data = torch.randint(0, 256, (13 * 2**20,), dtype=torch.uint8).numpy().tobytes()
    done: list[Any] = []
    with backend.open_write("data/__0_0.distcp", done.append) as stream:
        stream.write(data[:11 * 2**20])  # two parts full: both on their way
        assert [u.path for u in backend.incomplete_uploads()] == ["data/__0_0.distcp"]
        stream.write(data[11 * 2**20:])
    assert done[0].size == len(data) and backend.incomplete_uploads() == []
    assert backend.read_bytes("data/__0_0.distcp") == data
    etag = s3_kind_store.fs.info(s3_kind_store.path("data/__0_0.distcp"))["ETag"]
    assert etag.strip('"').endswith("-3")

    stream = backend.open_write("data/__0_1.distcp")
    stream.write(data)
    stream.abort()
    assert backend.incomplete_uploads() == []
    assert not backend.exists("data/__0_1.distcp")


@pytest.mark.parametrize("signed", [False, True])
def test_s3_parts_leave_as_views_with_their_crc32_unsigned_unless_asked(
        s3_kind_store, monkeypatch, signed):
    """Each part goes to the socket as a view of its buffer, with the CRC32 header computed
    by the writing thread and no SHA-256 of the body (over http botocore signs every body
    unless told not to); `payload_signing_enabled: true` in config_kwargs signs them again,
    and the user's other config_kwargs are kept."""
    import base64
    import zlib

    monkeypatch.setattr(S3Backend, "upload_options", {"chunksize": 5 * 2**20})
    options = {**s3_kind_store.options, "config_kwargs": {
        "retries": {"max_attempts": 2}, **({"s3": {"payload_signing_enabled": True}}
                                           if signed else {})}}
    backend = open_backend(s3_kind_store.url, options)
    assert backend.fs.config_kwargs["retries"] == {"max_attempts": 2}
    sent: list[tuple[str, str, str, str]] = []

    def record(request: Any, **_: Any) -> None:
        body = request.body
        headers = {k: v.decode() if isinstance(v, bytes) else v
                   for k, v in request.headers.items()}
        sent.append((type(body).__name__, headers["X-Amz-Content-SHA256"],
                     headers["x-amz-checksum-crc32"],
                     base64.b64encode(zlib.crc32(body).to_bytes(4, "big")).decode()))

    backend.fs.s3.meta.events.register_last("before-send.s3.UploadPart", record)
    data = torch.randint(0, 256, (12 * 2**20,), dtype=torch.uint8).numpy().tobytes()
    with backend.open_write("data/__0_0.distcp") as stream:
        stream.write(data)
    assert backend.read_bytes("data/__0_0.distcp") == data
    assert len(sent) == 3
    for body_type, content_sha256, crc32, crc32_of_body in sent:
        assert crc32 == crc32_of_body
        if signed:
            assert len(content_sha256) == 64
        else:
            assert body_type == "memoryview" and content_sha256 == "UNSIGNED-PAYLOAD"


def test_an_s3_load_streams_ranged_chunks_into_the_tensors_within_the_read_window(
        s3_kind_store, monkeypatch):
    """A load holds at most (read_ahead + 1) x read_chunk of an object beyond its tensors
    (the whole-file buffer before: the file's size), fetches each chunk with one ranged GET,
    and is bit-identical; a byte changed on the server is found as the bytes stream in."""
    import tracemalloc

    monkeypatch.setattr(S3Backend, "read_chunk", 2**20)
    monkeypatch.setattr(S3Backend, "read_ahead", 2)
    torch.manual_seed(0)
    model = nn.Linear(2048, 2048)  # a 16 MiB weight, one data file
    spec = {**model_only(s3_kind_store.url, s3_kind_store.options)}
    spec["storage"]["io_threads"] = 1
    statereg.CheckpointManager(spec, model=model).save(step=1)
    restored = nn.Linear(2048, 2048)
    nn.init.zeros_(restored.weight)
    manager = statereg.CheckpointManager(spec, model=restored)
    tracemalloc.start()
    try:
        manager.load()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert torch.equal(restored.weight, model.weight) and torch.equal(restored.bias, model.bias)
    assert peak < 8 * 2**20, f"the load held {peak / 2**20:.1f} MiB"

    data_file = next(p for p in s3_kind_store.files() if p.endswith(".distcp"))
    raw = bytearray(s3_kind_store.fs.cat_file(s3_kind_store.path(data_file)))
    raw[len(raw) // 2] ^= 0xFF
    s3_kind_store.fs.pipe_file(s3_kind_store.path(data_file), bytes(raw))
    with pytest.raises(statereg.CorruptCheckpointError, match="hash"):
        statereg.CheckpointManager(spec, model=nn.Linear(2048, 2048)).load()
