"""Finding committed checkpoints: directory names, manifests and their checksums, `latest`.

A checkpoint directory counts only once its manifest exists, parses and matches its
manifest.sum (publish.py writes them in that order). Listings that decide what a run keeps
or resumes from (list(), resume, retention, gc) also check every file the manifest records
against the sizes a listing of its directory gives: a missing or resized file makes the
checkpoint damaged. Everything here only reads.
"""

from __future__ import annotations

import errno
import logging
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from statereg.backends.base import StorageBackend
from statereg.backends.checksum import check_size, checksum_of, missing, new_hasher
from statereg.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ManifestError,
    StorageError,
)
from statereg.process_state import process_wide
from statereg.schemas.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, parse_manifest

logger = logging.getLogger(__name__)

LATEST_NAME = "latest"
# The manifest's own checksum, written just before the manifest (absent in checkpoints
# written before it existed, which are read without it).
MANIFEST_SUM_NAME = "manifest.sum"
RETIRED_NAME = ".retired"
"""Written into a checkpoint directory just before retention (or a save that retires a
damaged checkpoint of its step) removes its manifest, removed with the last of its files: a
directory with it and without a manifest is what a retention left (interrupted, or keeping
files a kept checkpoint references), and the next retention deletes what of it nothing
needs any more."""
_CHECKPOINT_NAME = re.compile(r"^step_(\d{8,})$")
_SUM_LINE = re.compile(r"^xxh3_64:[0-9a-f]{16}$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(name: str) -> int | None:
    """The step encoded in a checkpoint directory name, or None if it is not one."""
    match = _CHECKPOINT_NAME.match(name)
    return int(match.group(1)) if match else None


def step_key(name: str) -> int:
    """A sort key of checkpoint directory names by step (-1 for a name that is not one)."""
    step = step_of(name)
    return -1 if step is None else step


@dataclass(frozen=True)
class Committed:
    """A committed checkpoint: its directory name under the root and its manifest."""

    name: str
    manifest: Manifest

    @property
    def step(self) -> int:
        return self.manifest.step


def referenced_files(checkpoints: Iterable[Committed]) -> set[str]:
    """Root-relative paths of earlier files that these (incremental) checkpoints read."""
    return {ref.path for ckpt in checkpoints for ref in ckpt.manifest.references}


# -- reading manifests ---------------------------------------------------------------------


def manifest_checksum(data: bytes) -> str:
    hasher = new_hasher()
    hasher.update(data)
    return checksum_of(hasher)


def check_manifest_sum(backend: StorageBackend, name: str, data: bytes) -> None:
    """Compare the manifest bytes with manifest.sum; CorruptCheckpointError if they differ.

    A checkpoint without manifest.sum was written before statereg wrote one and is read as
    it is: its files are still checked against their sizes and checksums.
    """
    sum_path = f"{name}/{MANIFEST_SUM_NAME}"
    try:
        recorded = backend.read_bytes(sum_path).decode("ascii", "replace").strip()
    except FileNotFoundError:
        return
    path = backend.display(f"{name}/{MANIFEST_NAME}")
    if not _SUM_LINE.match(recorded):
        raise CorruptCheckpointError(
            f"{backend.display(sum_path)} is damaged (it does not hold an xxh3_64 checksum), so "
            f"{path} cannot be checked: load an earlier checkpoint"
        )
    actual = manifest_checksum(data)
    if actual != recorded:
        raise CorruptCheckpointError(
            f"{path}: checksum {actual} differs from {recorded} recorded in {MANIFEST_SUM_NAME} "
            f"({len(data)} bytes read); the manifest is damaged: load an earlier checkpoint"
        )


def read_manifest_at(backend: StorageBackend, name: str, check: bool = True) -> Manifest:
    """The manifest of checkpoint `name`; CheckpointNotFoundError if it was never committed.

    `check` compares it with manifest.sum first (one more small read); listings skip that.
    """
    path = f"{name}/{MANIFEST_NAME}"
    try:
        # One byte past the bound is enough to refuse it: a hostile multi-GB manifest is
        # never read whole.
        data = backend.read_bytes(path, limit=MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"{backend.display(name)} has no {MANIFEST_NAME}: it does not exist or was never "
            "committed (an interrupted save); `statereg ls` lists the committed checkpoints"
        ) from None
    if check:
        check_manifest_sum(backend, name, data)
    manifest = parse_manifest(data, backend.display(path))
    step = step_of(name)
    if step is not None and manifest.step != step:
        raise ManifestError(
            f"{backend.display(path)}: the manifest says step {manifest.step}, the directory "
            f"is {name}; the manifest is damaged or was moved: load an earlier checkpoint"
        )
    return manifest


# -- entries this run cannot read ---------------------------------------------------------

# Errors of a read that say the entry itself is not this user's to read (another user's
# folder on a shared root) or not a folder at all (garbage under a checkpoint's name), never
# an outage: the root's listing just worked.
_REFUSALS = frozenset({errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.ELOOP, errno.EISDIR,
                       errno.ENAMETOOLONG})
_named: set[tuple[str, str]] = set()  # (entry URL, why) already warned about
_named_lock = threading.Lock()
process_wide(__name__, "_named", "one warning per unreadable entry of a root, not one per listing")


def refused(exc: BaseException) -> bool:
    """Whether a StorageError of a read under one entry means that entry cannot be read by
    this user or is not a directory (permission denied, a file or garbage under a
    checkpoint's name), rather than that the store is unreachable."""
    cause = exc.__cause__
    return (isinstance(exc, StorageError) and isinstance(cause, OSError)
            and cause.errno in _REFUSALS)


def skip_entry(backend: StorageBackend, name: str, exc: BaseException) -> None:
    """Say once per process that entry `name` is skipped as not this run's: listings,
    resume, retention and gc go on with the rest of the root."""
    shown = backend.display(name)
    key = (shown, type(exc.__cause__).__name__)
    with _named_lock:
        if key in _named:
            return
        _named.add(key)
    logger.warning("skipping %s: this user cannot read it as a checkpoint (%s); statereg "
                   "treats it as not this run's (another user's, or not a checkpoint) and "
                   "goes on with the rest of the root", shown, exc)


# What happens to a damaged checkpoint a resume skips (claims.retire_damaged).
_RETIRES = " (the run's save of step %d re-verifies it and, damaged, replaces it)"


def _usable(backend: StorageBackend, name: str, damaged: list[Exception]) -> Committed | None:
    """The committed checkpoint `name`, or None (its damage, if any, added to `damaged`)."""
    try:
        return Committed(name, read_manifest_at(backend, name))
    except CheckpointNotFoundError:
        return None
    except StorageError as exc:
        if not refused(exc):
            raise
        skip_entry(backend, name, exc)
        return None
    except ManifestError as exc:
        logger.warning("skipping %s: %s", backend.display(name), exc)
        damaged.append(exc)
        return None
    except CorruptCheckpointError as exc:
        logger.warning("skipping %s: %s%s", backend.display(name), exc, _RETIRES % step_of(name))
        damaged.append(exc)
        return None


class Listings:
    """Sizes of stored files, one listing (`walk`) per top-level directory, made when first
    asked and kept: a scan of N checkpoints lists each directory once, also the directory of
    an incremental base that many checkpoints reference."""

    def __init__(self, backend: StorageBackend) -> None:
        self.backend = backend
        self._dirs: dict[str, dict[str, tuple[int, str]]] = {}

    def stored(self, path: str) -> tuple[int, str] | None:
        """(size, kind) of the file at root-relative `path`, or None if it is not there."""
        top = path.split("/", 1)[0]
        listed = self._dirs.get(top)
        if listed is None:
            listed = self._dirs[top] = {f.path: (f.size, f.kind)
                                        for f in self.backend.walk(top)}
        return listed.get(path)


def file_damage(backend: StorageBackend, ckpt: Committed,
                listings: Listings) -> CorruptCheckpointError | None:
    """Why `ckpt` cannot load by what a listing shows, or None: the first file its manifest
    records (its own and the earlier files it references) that is missing, not a regular
    file, or of another size than recorded. Costs only listings (`listings` keeps them); a
    flipped byte in a file of the right size is found by `verify` or a load, not here."""
    for record in ckpt.manifest.root_files(ckpt.name):
        where = backend.display(record.path)
        found = listings.stored(record.path)
        if found is None:
            return missing(where, record)
        size, kind = found
        if kind != "file":
            return CorruptCheckpointError(
                f"{where} is a {kind}, not a regular file; the manifest lists a file of "
                f"{record.size} bytes. The checkpoint is damaged: load an earlier one"
            )
        try:
            check_size(where, record, size)
        except CorruptCheckpointError as exc:
            return exc
    return None


@dataclass(frozen=True)
class RootScan:
    """Every checkpoint directory of a root that has a manifest, sorted by step.

    `committed` has a manifest that would load (matches manifest.sum, parses, names its
    step); `unreadable` has a manifest that does not: damaged, or written in a way this
    statereg cannot read. What an unreadable one references is unknown, so retention and gc
    keep every file it might reference (docs/reliability.md, "Unreadable manifests").
    `damaged` (filled by a scan with `check_files`): committed checkpoints a file of which is
    missing or resized; they are in `committed` (their references are known and kept), not
    in `intact`, and retention neither counts nor deletes them.
    """

    committed: list[Committed]
    unreadable: dict[str, Exception]
    damaged: dict[str, CorruptCheckpointError] = field(default_factory=dict)
    # Entries under a checkpoint's name this user cannot read at all (another user's
    # folder, a file): not this run's, skipped by everything (`skip_entry`), shown by gc.
    refused: dict[str, StorageError] = field(default_factory=dict)

    @property
    def intact(self) -> list[Committed]:
        """The committed checkpoints whose files all are there with their recorded sizes
        (all of `committed` when the scan did not check files)."""
        return [c for c in self.committed if c.name not in self.damaged]

    def might_reference(self, name: str) -> str | None:
        """The unreadable checkpoint that might read files of checkpoint `name`, if any.

        A checkpoint references only files of lower steps (and its own): an unreadable
        manifest at step S may need anything under a directory of step S or lower.
        """
        step = step_of(name)
        for other in sorted(self.unreadable, key=lambda n: step_of(n) or 0):
            if step is not None and step <= (step_of(other) or 0):
                return other
        return None


def scan_root(backend: StorageBackend, check_files: bool = False) -> RootScan:
    """Every checkpoint directory with a manifest, each checked against its manifest.sum.

    `check_files`: also check every committed checkpoint's files against the sizes in its
    manifest (`damaged`), at one listing per directory that holds them.
    """
    found: list[Committed] = []
    unreadable: dict[str, Exception] = {}
    skipped: dict[str, StorageError] = {}
    for name in sorted((n for n in backend.list_dir("") if step_of(n) is not None),
                       key=step_key):
        try:
            found.append(Committed(name, read_manifest_at(backend, name)))
        except CheckpointNotFoundError:
            continue
        except StorageError as exc:
            if not refused(exc):
                raise
            skip_entry(backend, name, exc)
            skipped[name] = exc
        except (ManifestError, CorruptCheckpointError) as exc:
            logger.warning("skipping %s: %s", backend.display(name), exc)
            unreadable[name] = exc
    damaged = {}
    if check_files:
        listings = Listings(backend)
        for ckpt in found:
            damage = file_damage(backend, ckpt, listings)
            if damage is not None:
                logger.warning("skipping %s, which is damaged: %s", backend.display(ckpt.name),
                               damage)
                damaged[ckpt.name] = damage
    return RootScan(found, unreadable, damaged, skipped)


def list_committed(backend: StorageBackend) -> list[Committed]:
    """Every committed checkpoint under the root that would load, oldest step first.

    Directories without a manifest are interrupted saves; one whose manifest does not match
    its manifest.sum, or does not parse, or a file of which is missing or has another size
    than its manifest records, is damaged: both are skipped (with a warning for a damaged
    one), so `ls` and `list()` show what `load()` may use. Cost: one manifest read and one
    listing per checkpoint directory (and per directory an incremental checkpoint references).
    """
    return scan_root(backend, check_files=True).intact


def read_latest(backend: StorageBackend) -> str | None:
    """The name in the `latest` pointer, or None if there is none."""
    try:
        name = backend.read_bytes(LATEST_NAME).decode("utf-8", "replace").strip()
    except FileNotFoundError:
        return None
    except CorruptCheckpointError as exc:  # a link or a FIFO: no usable pointer
        logger.warning("ignoring %s: %s", backend.display(LATEST_NAME), exc)
        return None
    return name if step_of(name) is not None else None


def latest_committed(backend: StorageBackend) -> Committed | None:
    """The checkpoint to resume from: the intact committed checkpoint of the highest step.

    Step order, not commit time and not the `latest` pointer: a clock that stepped back, or
    a crash between the manifest and `latest`, cannot make a lower step win (which would
    make every later save of the higher step fail as already committed). `latest` is
    written for tools that read it; statereg itself scans from the highest step down, and
    usually reads one manifest.

    Uncommitted directories are skipped. A damaged checkpoint (its manifest does not match
    manifest.sum, or does not parse, or a file it records is missing or resized by a listing
    of its directory) is skipped with a warning in favour of an older intact one; if no
    intact one is left, the newest one's error is raised: a damaged root never looks empty,
    which would silently restart training from scratch. Cost: per checkpoint tried, one
    manifest read and one listing per directory its files are in (usually one).
    """
    damaged: list[Exception] = []
    listings = Listings(backend)
    names = sorted((n for n in backend.list_dir("") if step_of(n) is not None), key=step_key)
    for name in reversed(names):
        found = _usable(backend, name, damaged)
        if found is None:
            continue
        damage = file_damage(backend, found, listings)
        if damage is None:
            return found
        logger.warning("skipping %s, which is damaged: %s%s", backend.display(name), damage,
                       _RETIRES % step_of(name))
        damaged.append(damage)
    if damaged:
        raise damaged[0]
    return None
