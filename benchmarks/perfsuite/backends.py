"""Each storage backend against a raw fsspec put/get of the same bytes.

"The same bytes" are the files of one statereg checkpoint of the state (saved once to
memory://, read back): the raw put stores exactly those files with fsspec's bulk
`fs.pipe({path: bytes})` (concurrent on s3fs and gcsfs), the raw get reads them back with
`fs.cat([paths])`. statereg's save and load move the same files plus nothing but its own
work (planning, checksums, manifest, commit). On the S3 server the state is also saved and
loaded with `storage.compression: zstd`.

The servers are tests/storage_servers.py's: moto_server and gcp-storage-emulator as child
processes on 127.0.0.1, in memory. The local store drops the page cache before reads; its raw
put has no fsync (fsspec offers none), statereg's has.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec

from perfsuite.measure import PageCache, Timing, fresh_dir, measure
from perfsuite.statereg_io import Saves, spec_for
from perfsuite.workload import TrainingState
from statereg.backends.gcs import GCSBackend
from statereg.backends.s3 import S3Backend
from statereg.engine.io_policy import DEFAULT_THREADS, io_policy

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from storage_servers import gcs_options, new_bucket, s3_options, start_server

STORES = ("local", "memory", "s3", "gcs")
# The compressed save is a target on S3 only; on the (slow) GCS emulator it would add minutes.
COMPRESSED_ON = ("s3",)
_ZSTD = {"codec": "zstd", "level": 3, "float_aware": True}


IO_THREADS = {"s3": io_policy(S3Backend.kind).write_threads,
              "gcs": io_policy(GCSBackend.kind).write_threads}


@dataclass
class Store:
    """A checkpoint root on one backend, and an fsspec filesystem reaching it directly."""

    kind: str
    url: str
    options: dict[str, Any]
    fs: Any
    root: str

    def clear(self) -> None:
        self.fs.invalidate_cache()
        if self.fs.exists(self.root):
            self.fs.rm(self.root, recursive=True)
        if self.kind == "local":
            self.fs.makedirs(self.root, exist_ok=True)


@contextmanager
def open_store(kind: str, work: Path) -> Iterator[Store]:
    """A fresh root on `kind`; starts (and stops) the store's server where it has one."""
    if kind == "local":
        root = str(fresh_dir(work / "local-store"))
        # auto_mkdir: the raw put creates the checkpoint's folders, as statereg's save does.
        yield Store(kind, root, {}, fsspec.filesystem("file", auto_mkdir=True), root)
        fresh_dir(Path(root))
        return
    if kind == "memory":
        root = f"/statereg-bench-{uuid.uuid4().hex[:8]}"
        store = Store(kind, f"memory://{root}", {}, fsspec.filesystem("memory"), root)
        yield store
        store.clear()
        return
    logs = fresh_dir(work / f"{kind}-server")
    if kind == "s3":
        server = start_server("moto_server",
                              ["-m", "moto.server", "-H", "127.0.0.1", "-p", "{port}"],
                              logs, "/moto-api/")
        options, protocol = s3_options(server.endpoint), "s3"
    else:
        server = start_server("gcp-storage-emulator",
                              ["-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1",
                               "--port", "{port}", "--in-memory"], logs, "/storage/v1/b")
        options, protocol = gcs_options(server.endpoint), "gs"
    try:
        fs = fsspec.filesystem(protocol, skip_instance_cache=True, use_listings_cache=False,
                               **options)
        bucket = new_bucket(fs)
        yield Store(kind, f"{protocol}://{bucket}/run", options, fs, f"{bucket}/run")
    finally:
        server.stop()


def checkpoint_files(state: TrainingState, io_threads: int) -> dict[str, bytes]:
    """The files of one statereg checkpoint of `state` written by `io_threads` writers."""
    root = f"/statereg-bench-reference-{uuid.uuid4().hex[:8]}"
    saves = Saves(state, spec_for(f"memory://{root}", io_threads=io_threads))
    saves.save()
    fs = fsspec.filesystem("memory")
    files = {path.removeprefix(f"{root}/"): fs.cat_file(path) for path in fs.find(root)}
    fs.rm(root, recursive=True)
    return files


def _store_rows(store: Store, state: TrainingState, files: dict[str, bytes], reps: int,
                cache: PageCache) -> dict[str, Timing]:
    nbytes = sum(len(b) for b in files.values())
    paths = {f"{store.root}/{rel}": data for rel, data in files.items()}
    label = f"{store.kind}: "
    cold = cache.drop if store.kind == "local" else None

    def clear() -> None:
        store.clear()
        if store.kind == "local":
            cache.drop()

    put_note = " (no fsync)" if store.kind == "local" else ""
    rows = {
        f"{store.kind}_raw_put": measure(f"{label}raw fsspec pipe of the same files{put_note}",
                                         lambda: store.fs.pipe(paths), reps, nbytes, clear),
        f"{store.kind}_raw_get": measure(f"{label}raw fsspec cat of the same files",
                                         lambda: store.fs.cat(list(paths)), reps, nbytes, cold),
    }
    variants = [("", None)] + ([("_zstd", _ZSTD)] if store.kind in COMPRESSED_ON else [])
    for suffix, compression in variants:
        # The backend's own io_threads default, as a user gets it (the raw files match it).
        saves = Saves(state, spec_for(store.url, options=store.options, compression=compression,
                                      io_threads=None))
        what = "statereg" + (" zstd" if compression else "")
        rows[f"{store.kind}_save{suffix}"] = measure(f"{label}{what} save", saves.save, reps,
                                                     state.nbytes, clear)
        rows[f"{store.kind}_load{suffix}"] = measure(f"{label}{what} load", saves.load, reps,
                                                     state.nbytes, cold)
    store.clear()
    return rows


def run(state: TrainingState, work: Path, reps: int, cache: PageCache,
        kinds: list[str]) -> tuple[dict[str, Timing], dict[str, Any]]:
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    os.environ.setdefault("NO_GCE_CHECK", "true")
    rows: dict[str, Timing] = {}
    data: dict[str, Any] = {"state_bytes": state.nbytes, "checkpoint_files": {}}
    for kind in kinds:
        threads = IO_THREADS.get(kind, DEFAULT_THREADS)
        files = checkpoint_files(state, threads)
        data["checkpoint_files"][kind] = len(files)
        data["checkpoint_bytes"] = sum(map(len, files.values()))
        with open_store(kind, work) as store:
            rows |= _store_rows(store, state, files, reps, cache)
    return rows, data
