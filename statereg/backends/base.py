"""A checkpoint root on one storage system: an fsspec filesystem plus a root path.

The engine talks only to `StorageBackend`; scheme-specific behaviour lives in subclasses
registered in `statereg.backends.registry`.
"""

from __future__ import annotations

import importlib.util
import io
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import IO, Any, ClassVar

import fsspec

from statereg.backends.checksum import HashingWriter, WrittenFile
from statereg.errors import SpecError, StorageError

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
# Operations where "not found" is an answer, not a failure.
_LOOKUPS = frozenset({"read", "open", "check", "stat", "list"})
# The operation whose "already exists" is an answer (the caller lost a race), not a failure.
EXCLUSIVE_WRITE = "exclusive write"
# Option values shown in messages, since they help to debug and are not credentials.
_SHOWN_OPTIONS = frozenset({"endpoint_url", "region_name", "project"})


def _secret_values(options: Any, key: str = "") -> set[str]:
    """String option values that may be credentials (shorter than 8 characters: not secret)."""
    if isinstance(options, dict):
        return {v for k, item in options.items() for v in _secret_values(item, str(k))}
    if isinstance(options, list):
        return {v for item in options for v in _secret_values(item, key)}
    if isinstance(options, str) and key not in _SHOWN_OPTIONS and len(options) >= 8:
        return {options}
    return set()


def _mentions(error: BaseException, secrets: set[str]) -> bool:
    """Whether `error` or any exception chained to it repeats one of `secrets`."""
    seen: list[BaseException] = []
    link: BaseException | None = error
    while link is not None and link not in seen:
        seen.append(link)
        if any(secret in str(link) for secret in secrets):
            return True
        link = link.__cause__ or link.__context__
    return False


def expand_env(options: dict[str, Any]) -> dict[str, Any]:
    """Expand ${VAR} in string option values (recursively); a missing variable is an error."""

    def expand(value: Any) -> Any:
        if isinstance(value, str):

            def sub(match: re.Match[str]) -> str:
                name = match.group(1)
                if name not in os.environ:
                    raise StorageError(
                        f"storage.options refers to ${{{name}}}, but the environment variable "
                        f"{name} is not set; export it or remove the reference"
                    )
                return os.environ[name]

            return _ENV_REF.sub(sub, value)
        if isinstance(value, dict):
            return {k: expand(v) for k, v in value.items()}
        if isinstance(value, list):
            return [expand(v) for v in value]
        return value

    return expand(options)


@dataclass(frozen=True)
class StoredFile:
    """A file found under a path: relative to the root, its size and last modification time."""

    path: str
    size: int
    mtime: float | None  # seconds since the epoch; None where the store does not say


@dataclass(frozen=True)
class IncompleteUpload:
    """A multipart upload that was started and never completed nor aborted (object stores)."""

    path: str
    upload_id: str
    initiated: float | None


def info_mtime(info: dict[str, Any]) -> float | None:
    """The modification time in an fsspec `info` dict, whatever the implementation calls it."""
    for key in ("mtime", "LastModified", "updated", "last_modified", "created", "timeCreated"):
        value = info.get(key)
        if value is None:
            continue
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return None


# Files up to this size are read with one request when their size is known.
_ONE_REQUEST = 32 * 1024 * 1024


class StorageBackend:
    """One checkpoint root. Paths given to methods are relative to the root, '/'-separated.

    The default implementation works for any fsspec filesystem: each file is buffered in memory
    and stored with one `pipe_file` (a single PUT, or a concurrent multipart upload where the
    filesystem offers it), and read back whole with one `cat_file`.
    """

    schemes: ClassVar[tuple[str, ...]] = ()
    # Options a backend adds under the user's (e.g. no listing cache on shared stores).
    default_options: ClassVar[dict[str, Any]] = {}
    # Files a rank writes and reads at once unless storage.io_threads says otherwise.
    default_io_threads: ClassVar[int] = 2
    # Keyword arguments for each `pipe_file` (e.g. the multipart part size).
    upload_options: ClassVar[dict[str, Any]] = {}
    # The fsspec implementation's package and the statereg extra that installs it.
    client_package: ClassVar[str | None] = None
    install_extra: ClassVar[str] = ""
    # Whether `create_bytes` is atomic against other processes (a conditional write on the
    # store); the generic fallback checks, then writes, which two writers can both pass.
    atomic_create: ClassVar[bool] = False

    def __init__(self, url: str, options: dict[str, Any] | None = None) -> None:
        self.url = url.rstrip("/") or url
        self._options = expand_env({**self.default_options, **(options or {})})
        self._secrets = _secret_values(self._options)
        self.fs, self.root = self._open_filesystem(self.url, self._options)

    def _open_filesystem(self, url: str, options: dict[str, Any]) -> tuple[Any, str]:
        if self.client_package and importlib.util.find_spec(self.client_package) is None:
            raise SpecError(
                f"storage url {url!r} needs the {self.client_package} package, which is not "
                f"installed; run: pip install 'statereg[{self.install_extra}]'"
            )
        with self._storage_op("open filesystem", ""):
            fs, root = fsspec.core.url_to_fs(url, **options)
        return fs, root.rstrip("/")

    # -- paths and errors ---------------------------------------------------------------

    def full_path(self, path: str) -> str:
        """The filesystem path of `path` under the root (paths are str: Path collapses '//')."""
        return f"{self.root}/{path}" if path else self.root

    def display(self, path: str = "") -> str:
        """A URL for messages: the root URL and the relative path, never the options."""
        return f"{self.url}/{path}" if path else self.url

    def _missing_bucket(self, operation: str, path: str) -> StorageError:
        bucket = self.root.split("/", 1)[0]
        return StorageError(
            f"{operation} failed for {self.display(path)}: bucket {bucket!r} does not exist. "
            "Create it, or fix the bucket name in storage.url"
        )

    @contextmanager
    def _storage_op(self, operation: str, path: str) -> Iterator[None]:
        """Report any failure as one StorageError naming the URL and the operation.

        "Not found" passes through for look-ups (callers answer it); for a write it means the
        bucket is missing. No message keeps a value from storage.options: client libraries
        may repeat credentials (gcsfs puts a raw token in a request URL), and then the chained
        error is withheld too.
        """
        try:
            yield
            return
        except FileNotFoundError as exc:
            if operation in _LOOKUPS:
                raise
            error, cause = self._missing_bucket(operation, path), exc
        except StorageError as exc:
            error, cause = exc, exc.__cause__
        except Exception as exc:  # the client libraries raise many types; report them as one
            if isinstance(exc, FileExistsError) and operation == EXCLUSIVE_WRITE:
                raise  # the answer of a conditional write: another writer was first
            detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            error, cause = StorageError(
                f"{operation} failed for {self.display(path)}: {detail}. Check that the storage "
                "is reachable and the credentials in storage.options allow it"
            ), exc
        if self._secrets and _mentions(error, self._secrets):
            message = str(error)
            for secret in self._secrets:
                message = message.replace(secret, "<redacted>")
            raise StorageError(f"{message} (the client library's error is withheld: it "
                               "repeated a value from storage.options)") from None
        raise error from cause

    # -- writing ------------------------------------------------------------------------

    def open_write(self, path: str, on_done: Callable[[WrittenFile], None] | None = None,
                   ) -> HashingWriter:
        """A stream for a new file; on close the file is stored and reported to `on_done`."""
        full = self.full_path(path)

        def put(buffer: IO[bytes]) -> None:
            # getvalue() hands over BytesIO's bytes without a copy (botocore refuses the
            # memoryview of getbuffer()). pipe_file returns once the PUT, or the multipart
            # upload's completion, is acknowledged: then the file is stored.
            with self._storage_op("write", path):
                self.fs.pipe_file(full, buffer.getvalue(),  # type: ignore[attr-defined]
                                  **self.upload_options)

        return HashingWriter(path, io.BytesIO(), put, on_done)

    def write_bytes(self, path: str, data: bytes) -> WrittenFile:
        """Store a whole small file (manifest, latest, JSON state) and return what was written."""
        done: list[WrittenFile] = []
        with self.open_write(path, done.append) as stream:
            stream.write(data)
        return done[0]

    def create_bytes(self, path: str, data: bytes) -> WrittenFile:
        """Store a small file only if nothing is stored at `path` yet; FileExistsError if so.

        Two writers racing for one path: exactly one succeeds where `atomic_create` is true
        (a conditional write the store enforces). This generic version checks, then writes.
        """
        with self._storage_op(EXCLUSIVE_WRITE, path):
            if self.fs.exists(self.full_path(path)):
                raise FileExistsError(self.display(path))
        return self.write_bytes(path, data)

    def makedirs(self, path: str) -> None:
        """Create a directory where the filesystem has them (a no-op on object stores)."""

    # -- reading ------------------------------------------------------------------------

    def read_bytes(self, path: str, limit: int | None = None) -> bytes:
        """The whole file (at most its first `limit` bytes); FileNotFoundError if missing."""
        with self._storage_op("read", path):
            if limit is None:
                return self.fs.cat_file(self.full_path(path))
            return self.fs.cat_file(self.full_path(path), start=0, end=limit)

    @contextmanager
    def open_read(self, path: str, size: int | None = None) -> Iterator[IO[bytes]]:
        """A seekable stream over the file, fetched with one whole-object read.

        `size`, when the manifest gives it, spares the size request fsspec makes first to
        choose between one GET and several (a round trip per file; one GET is best below
        fsspec's block size).
        """
        if size is not None and size <= _ONE_REQUEST:
            yield io.BytesIO(self.read_bytes(path, limit=size))
        else:
            yield io.BytesIO(self.read_bytes(path))

    def exists(self, path: str) -> bool:
        with self._storage_op("check", path):
            return bool(self.fs.exists(self.full_path(path)))

    def size(self, path: str) -> int:
        with self._storage_op("stat", path):
            return int(self.fs.size(self.full_path(path)))

    def list_dir(self, path: str = "") -> list[str]:
        """Names (not paths) of the entries directly under `path`; empty if it does not exist."""
        full = self.full_path(path)
        with self._storage_op("list", path):
            try:
                self.fs.invalidate_cache(full)
                entries = self.fs.ls(full, detail=False)
            except FileNotFoundError as exc:
                # An empty prefix and a missing bucket both arrive as FileNotFoundError; only
                # the first means "no checkpoints yet". A mistyped bucket must not silently
                # start a run from scratch.
                if self._bucket_missing(exc):
                    raise self._missing_bucket("list", path) from exc
                return []
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries})

    def _bucket_missing(self, not_found: FileNotFoundError) -> bool:
        """Whether a listing's FileNotFoundError means the bucket itself is missing."""
        return False

    def walk(self, path: str = "") -> list[StoredFile]:
        """Every file under `path` (recursively), with sizes and modification times."""
        full = self.full_path(path)
        with self._storage_op("list", path):
            try:
                self.fs.invalidate_cache(full)
                found = self.fs.find(full, detail=True)
            except FileNotFoundError:
                return []
        prefix = f"{self.root}/" if self.root else ""
        return sorted(
            (StoredFile(name.removeprefix(prefix), int(info.get("size") or 0), info_mtime(info))
             for name, info in found.items() if info.get("type", "file") != "directory"),
            key=lambda f: f.path,
        )

    def incomplete_uploads(self, path: str = "") -> list[IncompleteUpload]:
        """Multipart uploads started under `path` and never completed (none where the store
        has no such thing); `statereg gc` aborts the abandoned ones."""
        return []

    def abort_upload(self, upload: IncompleteUpload) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no multipart uploads")

    # -- deleting -----------------------------------------------------------------------

    def remove_file(self, path: str) -> None:
        with self._storage_op("delete", path):
            self.fs.rm_file(self.full_path(path))

    def remove_tree(self, path: str) -> None:
        """Delete everything under `path`; a missing path is not an error."""
        full = self.full_path(path)
        with self._storage_op("delete", path):
            try:
                self.fs.rm(full, recursive=True)
            except FileNotFoundError:
                return
