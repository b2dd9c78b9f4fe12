"""A checkpoint root on one storage system: an fsspec filesystem plus a root path.

The engine talks only to `StorageBackend`; scheme-specific behaviour lives in subclasses
registered in `statereg.backends.registry`.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import hashlib
import importlib.util
import io
import logging
import re
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import IO, Any, ClassVar, cast

import fsspec
import fsspec.asyn
import fsspec.spec

from statereg import env
from statereg.backends.capabilities import StoreCapabilities
from statereg.backends.checksum import (
    VERIFY_BLOCK,
    HashingWriter,
    WrittenFile,
    checksum_of,
    new_hasher,
)
from statereg.errors import SpecError, StorageError
from statereg.process_state import process_wide

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
# Operations where "not found" is an answer, not a failure.
_LOOKUPS = frozenset({"read", "open", "check", "stat", "list"})
# The operation whose "already exists" is an answer (the caller lost a race), not a failure.
EXCLUSIVE_WRITE = "exclusive write"
# Option values shown in messages, since they help to debug and are not credentials.
_SHOWN_OPTIONS = frozenset({"endpoint_url", "region_name", "project"})
# The storage option that makes a store without enforced exclusive creates an error rather
# than a warning. statereg consumes it; the filesystem never sees it.
REQUIRE_EXCLUSIVE = "require_exclusive"
# The object an exclusivity probe creates (twice) at the root, then deletes.
PROBE_PREFIX = ".statereg-probe-"

logger = logging.getLogger(__name__)

# Roots whose exclusive creates were probed in this process: key -> the problem found (None:
# the store refused the second create, as it must). One probe per root, one warning per root.
_probed_roots: dict[str, str | None] = {}
_probe_lock = threading.Lock()
process_wide(__name__, "_probed_roots", "exclusive creates are probed (two objects written, then "
             "deleted) and warned about once per root")
process_wide(__name__, "fsspec instance caches", "fsspec keeps a filesystem per class and "
             "options; cleared, the next open reads the credentials in the environment again",
             clear=lambda: [fs.clear_instance_cache() for fs in fsspec.registry.values()])


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
                value = env.named(name)
                if value is None:
                    raise StorageError(
                        f"storage.options refers to ${{{name}}}, but the environment variable "
                        f"{name} is not set; export it or remove the reference"
                    )
                return value

            return _ENV_REF.sub(sub, value)
        if isinstance(value, dict):
            return {k: expand(v) for k, v in value.items()}
        if isinstance(value, list):
            return [expand(v) for v in value]
        return value

    return expand(options)


@dataclass(frozen=True)
class StoredFile:
    """A file found under a path: relative to the root, its size and last modification time.

    `kind` is "file" on object stores; local disk also reports what a caller must refuse to
    read: "symlink", "fifo", "socket", "char-device", "block-device" (size 0), and "directory"
    for an empty directory.
    """

    path: str
    size: int
    mtime: float | None  # seconds since the epoch; None where the store does not say
    kind: str = "file"


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


class _BlockStream:
    """read() and seek() of a backend's file, each failure a StorageError naming the file
    (the caller's own errors pass through untouched: only the storage calls are wrapped)."""

    def __init__(self, backend: StorageBackend, path: str, raw: Any) -> None:
        self._backend, self._path, self._raw = backend, path, raw

    def read(self, size: int = -1) -> bytes:
        with self._backend._storage_op("read", self._path):
            return self._raw.read(size)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        with self._backend._storage_op("read", self._path):
            return self._raw.seek(offset, whence)


class PositionedReads(io.RawIOBase):
    """A read-only, seekable stream of file `path` of `backend` that keeps its own position
    (`_pos`); subclasses say how to `readinto`. Its size (for a seek from the end) is `size`
    where the caller knows it, else asked of the backend once."""

    _pos = 0

    def __init__(self, backend: StorageBackend, path: str, size: int | None = None) -> None:
        super().__init__()
        self._backend, self._path, self._size = backend, path, size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def _file_size(self) -> int:
        if self._size is None:
            self._size = self._backend.size(self._path)
        return self._size

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_END:
            offset += self._file_size()
        elif whence == io.SEEK_CUR:
            offset += self._pos
        self._pos = max(0, offset)
        return self._pos


class _RangeReads(PositionedReads):
    """A seekable, read-only view of a stored file of which only some byte ranges are fetched.

    `ranges` are the (start, end) runs a reader will use; each is fetched with one ranged
    read the first time a read touches it, and only the run being read is held in memory. A
    read outside every run fetches just what it asks for. A run the store returns short (a
    truncated object) reads as the end of the file there.
    """

    def __init__(self, backend: StorageBackend, path: str, ranges: Sequence[tuple[int, int]],
                 size: int | None) -> None:
        super().__init__(backend, path, size)
        self._runs = sorted(ranges)
        self._starts = [start for start, _ in self._runs]
        self._buffer_start, self._buffer = 0, b""

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        if not view:
            return 0
        at = self._pos - self._buffer_start
        if not 0 <= at < len(self._buffer):
            self._fetch(len(view))
            at = self._pos - self._buffer_start
        got = max(0, min(len(view), len(self._buffer) - at))
        view[:got] = self._buffer[at:at + got]
        self._pos += got
        return got

    def _fetch(self, wanted: int) -> None:
        """Fetch the run holding the position (or, outside every run, the bytes asked for)."""
        index = bisect.bisect_right(self._starts, self._pos) - 1
        if index >= 0 and self._pos < self._runs[index][1]:
            start, end = self._runs[index]
        else:
            start, end = self._pos, self._pos + wanted
        self._buffer = b""  # the previous run is released before the next one arrives
        if self._size is not None and start >= self._size:
            self._buffer_start = start  # the end of the file: stores refuse such a range
            return
        self._buffer_start, self._buffer = start, self._backend.read_range(self._path, start, end)


# Errors that say what the entry at a path is (a directory, not one, not empty, a loop of
# links, a name too long): they never mean the store is unreachable or the credentials wrong.
_ENTRY_CODES = frozenset({errno.EISDIR, errno.ENOTDIR, errno.ENOTEMPTY, errno.ELOOP,
                          errno.ENAMETOOLONG, errno.EEXIST})
# What a failed storage call most often needs, unless its error says otherwise.
_CHECK_ACCESS = ("Check that the storage is reachable and the credentials in storage.options "
                 "allow it")


class StorageBackend:
    """One checkpoint root. Paths given to methods are relative to the root, '/'-separated.

    The default implementation works for any fsspec filesystem: each file is buffered in memory
    and stored with one `pipe_file` (a single PUT, or a concurrent multipart upload where the
    filesystem offers it), and read back whole with one `cat_file`.
    """

    schemes: ClassVar[tuple[str, ...]] = ()
    # Options a backend adds under the user's (e.g. no listing cache on shared stores).
    default_options: ClassVar[dict[str, Any]] = {}
    # What kind of store this is (facts, not decisions): engine/io_policy.py derives how
    # to use it. `capabilities_at` refines it for one root.
    kind: ClassVar[StoreCapabilities] = StoreCapabilities("filesystem", "unknown")
    # Keyword arguments for each `pipe_file` (e.g. the multipart part size).
    upload_options: ClassVar[dict[str, Any]] = {}
    # The fsspec implementation's package and the statereg extra that installs it.
    client_package: ClassVar[str | None] = None
    install_extra: ClassVar[str] = ""
    # Whether `create_bytes` asks the store for a conditional write that it enforces (O_EXCL,
    # If-None-Match: *, ifGenerationMatch=0). Whether a remote server really honours it is
    # probed once per root (see `check_exclusive_create`).
    atomic_create: ClassVar[bool] = False
    # Whether the store's answer to a conditional create must be probed: false where this
    # process enforces it itself (link(2) on local disk, a lock for memory://).
    probe_exclusive: ClassVar[bool] = True
    # What the store calls the top level of a URL, in messages.
    bucket_word: ClassVar[str] = "bucket"
    # What to check when the store says "permission denied" (EACCES, EPERM) to a write or
    # a delete, and to a read or a listing (which must not send the user after write access).
    denied_hint: ClassVar[str] = _CHECK_ACCESS
    denied_read_hint: ClassVar[str] = _CHECK_ACCESS
    # What to check for any other failure the error does not explain itself.
    failure_hint: ClassVar[str] = _CHECK_ACCESS

    def __init__(self, url: str, options: dict[str, Any] | None = None) -> None:
        self.url = url.rstrip("/") or url
        merged = {**self.default_options, **(options or {})}
        self.require_exclusive = _flag(merged.pop(REQUIRE_EXCLUSIVE, False), self.url)
        self._options = expand_env(merged)
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

    @classmethod
    def capabilities_at(cls, url: str) -> StoreCapabilities:
        """What kind of store the root at `url` is, known without opening it (`statereg plan`
        asks before any store is reached): the class's `kind` unless the root tells more."""
        return cls.kind

    @property
    def capabilities(self) -> StoreCapabilities:
        """What kind of store this root is (`capabilities_at` of its URL)."""
        return self.capabilities_at(self.url)

    # -- paths and errors ---------------------------------------------------------------

    def full_path(self, path: str) -> str:
        """The filesystem path of `path` under the root (paths are str: Path collapses '//')."""
        return f"{self.root}/{path}" if path else self.root

    def display(self, path: str = "") -> str:
        """A URL for messages: the root URL and the relative path, never the options."""
        return f"{self.url}/{path}" if path else self.url

    def _missing_bucket(self, operation: str, path: str) -> StorageError:
        bucket, word = self.root.split("/", 1)[0], self.bucket_word
        return StorageError(
            f"{operation} failed for {self.display(path)}: {word} {bucket!r} does not exist. "
            f"Create it, or fix the {word} name in storage.url"
        )

    def _names_missing_bucket(self, error: BaseException) -> bool:
        """Whether a failed operation's error says the bucket itself is missing (clients that
        do not raise FileNotFoundError for it, e.g. Azure's ContainerNotFound)."""
        return False

    @contextmanager
    def _storage_op(self, operation: str, path: str) -> Iterator[None]:
        """Report any failure as one StorageError naming the URL and the operation.

        "Not found" passes through for look-ups (callers answer it); for a write it means the
        bucket is missing. No message keeps a value from storage.options: client libraries
        may repeat credentials (gcsfs puts a raw token in a request URL), and then the chained
        error is withheld too.
        """
        error: Exception
        cause: BaseException | None
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
            if self._names_missing_bucket(exc):
                raise self._missing_bucket(operation, path) from exc
            detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            hint = self.failure_hint
            code = exc.errno if isinstance(exc, OSError) else None
            if code in (errno.ENOSPC, errno.EDQUOT):
                hint = ("The filesystem (or your quota on it) is full: free space there "
                        "(`statereg gc ROOT` lists what failed saves left), keep fewer "
                        "checkpoints (keep_last), or save elsewhere")
            elif code == errno.EROFS:
                hint = "The filesystem is mounted read-only: save to a writable root"
            elif code in (errno.EACCES, errno.EPERM):
                hint = self.denied_read_hint if operation in _LOOKUPS else self.denied_hint
            elif code in _ENTRY_CODES:
                # The entry itself is not what the operation expected (a directory deleted
                # as a file): nothing about access or credentials.
                hint = ("The entry there is of another kind than this operation expects; "
                        "this is no storage outage")
            error, cause = StorageError(
                f"{operation} failed for {self.display(path)}: {detail}. {hint}"), exc
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

    def for_writing(self, around_cache: bool) -> StorageBackend:
        """The backend a writer opens its files through: itself, except where the I/O policy
        asks for files written around the page cache (`around_cache`: compressed data, not
        read back soon) and the store has a cache to go around (local disk)."""
        return self

    def write_bytes(self, path: str, data: bytes) -> WrittenFile:
        """Store a whole small file (manifest, latest, JSON state) and return what was written."""
        done: list[WrittenFile] = []
        with self.open_write(path, done.append) as stream:
            stream.write(data)
        return done[0]

    def create_bytes(self, path: str, data: bytes) -> WrittenFile:
        """Store a small file only if nothing is stored at `path` yet; FileExistsError if so.

        Two writers racing for one path: exactly one succeeds on a store that enforces
        conditional writes. The first create on a root checks that it does
        (`check_exclusive_create`): a warning if not, or a StorageError where
        storage.options.require_exclusive is true.
        """
        self.check_exclusive_create()
        return self._store_if_absent(path, data)

    def _store_if_absent(self, path: str, data: bytes) -> WrittenFile:
        """The conditional write itself: fsspec's `pipe_file(mode="create")`, which object
        stores' filesystems send as a conditional request (refused if the object exists)."""
        with self._storage_op(EXCLUSIVE_WRITE, path):
            self.fs.pipe_file(self.full_path(path), data,  # type: ignore[attr-defined]
                              mode="create", **self.upload_options)
        hasher = new_hasher()
        hasher.update(data)
        return WrittenFile(path, len(data), checksum_of(hasher))

    def check_exclusive_create(self) -> str | None:
        """Whether this root's store enforces exclusive creates: None if it does, else why not.

        Probed once per root and process: an object `.statereg-probe-<uuid>` is created
        exclusively twice (the store must refuse the second), then deleted. A store that
        accepts both, or a filesystem whose "create" is only fsspec's check-then-write, is
        reported with one warning per root, or refused with a StorageError on every call
        where storage.options.require_exclusive is true.
        """
        if not self.probe_exclusive:
            return None
        key = self._probe_key()
        with _probe_lock:
            first = key not in _probed_roots
            if first:
                _probed_roots[key] = self._probe_exclusive_create()
            problem = _probed_roots[key]
        if problem is None:
            return None
        if self.require_exclusive:
            raise StorageError(
                f"exclusive create is not enforced at {self.display()}: {problem}. "
                f"storage.options.{REQUIRE_EXCLUSIVE} is true, so statereg does not write "
                "here (two saves of one step could both start, and both fail). Use a store "
                f"that honours conditional writes, or drop {REQUIRE_EXCLUSIVE} to save here "
                "with a warning (each save then writes under its own writer directory)"
            )
        if first:
            logger.warning(
                "exclusive create is not enforced at %s: %s. Each save here writes under its "
                "own writer directory and reports a commit only after reading back that its "
                "manifest stands, but two saves of one step can both start and both fail; "
                "give each run its own root, or set storage.options.%s: true to refuse such "
                "a store", self.display(), problem, REQUIRE_EXCLUSIVE)
        return problem

    def _probe_key(self) -> str:
        # The root and the options that pick the server (hashed: they may hold credentials).
        options = repr(sorted(self._options.items(), key=lambda item: str(item[0])))
        digest = hashlib.sha256(options.encode()).hexdigest()[:16]
        return f"{type(self).__name__} {self.url} {digest}"

    def _probe_exclusive_create(self) -> str | None:
        """Create one probe object exclusively twice and delete it; what went wrong, if any."""
        if _inherits_check_then_write(self.fs):
            return (f"the filesystem ({type(self.fs).__name__}) has no conditional write: "
                    "fsspec checks that the path is free, then writes, which two writers "
                    "can both pass")
        probe = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
        try:
            self._store_if_absent(probe, b"first")
            try:
                self._store_if_absent(probe, b"second")
            except FileExistsError:
                return None
            return (f"the store accepted a second exclusive create of {self.display(probe)} "
                    "(it ignores If-None-Match: * or its equivalent)")
        finally:
            try:
                self.remove_file(probe)
            except (FileNotFoundError, StorageError) as exc:
                logger.warning("could not delete the probe object %s: %s",
                               self.display(probe), exc)

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

    def read_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of the file (fewer if it ends sooner), with one ranged read."""
        with self._storage_op("read", path):
            return self.fs.cat_file(self.full_path(path), start=start, end=end)

    def for_reading(self, nbytes: int) -> StorageBackend:
        """The backend one load that reads `nbytes` in all reads through: itself, except
        where that total decides how to read (local disk: through the page cache or not)."""
        return self

    @contextmanager
    def open_ranges(self, path: str, ranges: Sequence[tuple[int, int]],
                    size: int | None = None) -> Iterator[IO[bytes]]:
        """A seekable stream over the file that fetches only `ranges` (sorted, disjoint
        (start, end) runs), each with one ranged read when first read, one run held at a time.

        A load that needs part of a file (a sharded checkpoint read at another world size,
        some keys of it) moves those bytes and no others. `size`, from the manifest, answers
        a seek from the end without asking the store.
        """
        with _RangeReads(self, path, ranges, size) as stream:
            yield cast(IO[bytes], stream)  # file-like: read, readinto, seek, tell

    @contextmanager
    def open_blocks(self, path: str) -> Iterator[_BlockStream]:
        """A stream that fetches the file a block at a time (ranged reads on an object
        store), for whole-file checks that must not hold the file in memory: verify, cp.
        FileNotFoundError if the file is missing; other failures are StorageErrors."""
        with self._storage_op("open", path):
            raw = self.fs.open(self.full_path(path), "rb", block_size=VERIFY_BLOCK,
                               cache_type="none")
        try:
            yield _BlockStream(self, path, raw)
        finally:
            with contextlib.suppress(Exception):
                raw.close()

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
            except FileNotFoundError as exc:
                if self._bucket_missing(exc):
                    raise self._missing_bucket("list", path) from exc
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


def _flag(value: Any, url: str) -> bool:
    """A boolean storage option statereg consumes itself (YAML's true/false)."""
    if not isinstance(value, bool):
        raise SpecError(
            f"storage.options.{REQUIRE_EXCLUSIVE} for {url!r} must be true or false, not "
            f"{value!r}"
        )
    return value


def _inherits_check_then_write(fs: Any) -> bool:
    """Whether `fs` creates with fsspec's generic pipe_file: exists(), then an overwriting
    write, which is never atomic. A filesystem has its own only where it overrides pipe_file
    (or, for an async one, the `_pipe_file` its pipe_file wraps)."""
    cls = type(fs)
    async_base = fsspec.asyn.AsyncFileSystem
    if issubclass(cls, async_base) and cls._pipe_file is not async_base._pipe_file:
        return False
    return cls.pipe_file is fsspec.spec.AbstractFileSystem.pipe_file
