"""Publishing a fully written checkpoint: manifest.sum, manifest.json, then `latest`.

No step needs a rename, so the protocol holds on object stores, where a single PUT is the
atomic unit. The manifest is created exclusively, so two savers can never both believe they
committed one step. On a store that does not enforce exclusive creates, a save's files lie
under its own writer directory (its manifest's `writer`), and the saver reads back which
manifest stands before it reports a commit (_commit_unexcluded). docs/reliability.md walks
through each step and what a crash at each one leaves behind.
"""

from __future__ import annotations

import contextlib
import logging

from statereg.backends.base import StorageBackend
from statereg.engine.checkpoints import (
    LATEST_NAME,
    MANIFEST_SUM_NAME,
    manifest_checksum,
    read_latest,
    step_of,
)
from statereg.engine.claims import Claim, lost_race
from statereg.errors import (
    CheckpointExistsError,
    ManifestError,
    StateregError,
    StorageError,
)
from statereg.schemas.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    Manifest,
    committable_json,
    parse_manifest,
)

# Rounds of reading back manifest.json and manifest.sum until they agree (each round after
# the first follows a racing writer's write; two writers settle in one or two).
_SETTLE_ROUNDS = 8

logger = logging.getLogger(__name__)


def _create(backend: StorageBackend, path: str, content: bytes, name: str) -> None:
    """Create `path` exclusively. Finding it already there with exactly `content` is success:
    a client library that retried this saver's own PUT, after a timeout that hid its
    success, finds its own object."""
    try:
        backend.create_bytes(path, content)
        return
    except FileExistsError:
        lost = True
    except StorageError:
        lost = False
        with contextlib.suppress(FileNotFoundError, StorageError):
            if backend.read_bytes(path) == content:
                return  # the write failed to answer, not to happen
        raise
    if lost:
        with contextlib.suppress(FileNotFoundError, StorageError):
            if backend.read_bytes(path) == content:
                return
        raise CheckpointExistsError(
            f"{backend.display(name)} was committed by another save first (or is being "
            "committed by one); this save's files were not used. Two saves of one step "
            "cannot both commit: give each run its own root or step"
        )


def _point_latest(backend: StorageBackend, name: str) -> None:
    """Write `latest`, unless it names a higher committed step (load goes by step order:
    `latest` is for tools that read it, and must agree). A failure is a warning: the
    checkpoint is committed whatever happens to the pointer."""
    try:
        current = read_latest(backend)
        if current is not None and (step_of(current) or 0) > (step_of(name) or 0) \
                and backend.exists(f"{current}/{MANIFEST_NAME}"):
            return
        backend.write_bytes(LATEST_NAME, name.encode())
    except (OSError, StateregError) as exc:
        logger.warning("%s is committed, but writing %s failed (%s); load() finds it by "
                       "step, and the next save writes the pointer again",
                       backend.display(name), backend.display(LATEST_NAME), exc)


def commit(backend: StorageBackend, name: str, manifest: Manifest, claim: Claim | None,
           move_latest: bool = True) -> None:
    """Publish a fully written checkpoint: manifest.sum, then the manifest (both created
    exclusively; the manifest commits it), then the `latest` pointer.

    `claim` is the one claim_checkpoint() returned for `name`: it is checked to be still this
    saver's before anything is published (CheckpointInProgressError if another saver took the
    directory over) and released afterwards, committed or not. None publishes unclaimed.

    Raises only while nothing is committed: a manifest the reader would refuse (too large,
    or any value parse_manifest refuses or reads back differently) is refused here
    (SpecError), and once the manifest exists, a failure to write `latest` is a warning.
    """
    try:
        # The reader's own check, before anything is published: a manifest no reader
        # accepts is never committed (SpecError; committable_json).
        data = committable_json(manifest, backend.display(f"{name}/{MANIFEST_NAME}"))
        if manifest.writer is not None:
            _commit_unexcluded(backend, name, data, claim)
        else:
            if claim is not None:
                claim.check_owner()
            _create(backend, f"{name}/{MANIFEST_SUM_NAME}",
                    f"{manifest_checksum(data)}\n".encode(), name)
            _create(backend, f"{name}/{MANIFEST_NAME}", data, name)
    finally:
        if claim is not None:
            claim.release()
    if move_latest:
        _point_latest(backend, name)


def _read(backend: StorageBackend, path: str) -> bytes | None:
    try:
        return backend.read_bytes(path, limit=MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        return None


def _settle(backend: StorageBackend, name: str) -> bytes | None:
    """The manifest that stands in `name`, after making `manifest.sum` agree with it.

    Two savers racing on a store without exclusive creates may leave one's manifest with the
    other's sum. Whichever manifest stands was written whole by one PUT and names only its
    own writer's files, so its checksum is the right sum: each racing saver writes it and
    reads both again until they agree, so the last to write leaves them agreeing. Only a
    manifest that parses and carries a writer token (one this protocol wrote) is repaired.
    """
    for _ in range(_SETTLE_ROUNDS):
        data = _read(backend, f"{name}/{MANIFEST_NAME}")
        if data is None:
            return None
        want = f"{manifest_checksum(data)}\n".encode()
        if _read(backend, f"{name}/{MANIFEST_SUM_NAME}") == want:
            return data
        try:
            standing = parse_manifest(data, backend.display(f"{name}/{MANIFEST_NAME}"))
        except ManifestError:
            return data
        if standing.writer is None:
            return data
        backend.write_bytes(f"{name}/{MANIFEST_SUM_NAME}", want)
    return _read(backend, f"{name}/{MANIFEST_NAME}")


def _commit_unexcluded(backend: StorageBackend, name: str, data: bytes,
                       claim: Claim | None) -> None:
    """Commit on a store that does not enforce exclusive creates, where a second saver of
    the same step can get past its claim: refuse a manifest that already stands, write
    manifest.sum and manifest.json (this save's files are under its own writer directory,
    which no other saver writes), make the sum agree with the manifest that stands
    (_settle), and report a commit only if that manifest is this save's and its claim is
    still the newest. Otherwise CheckpointExistsError: this save lost the race, and its
    files stay where the manifest that stands may name them.
    """
    if claim is not None:
        claim.freeze()  # a renewal must not write this claim over a later saver's
        claim.check_owner()
    if _read(backend, f"{name}/{MANIFEST_NAME}") is not None:
        raise lost_race(backend, name, "it committed first")
    _create(backend, f"{name}/{MANIFEST_SUM_NAME}",
            f"{manifest_checksum(data)}\n".encode(), name)
    _create(backend, f"{name}/{MANIFEST_NAME}", data, name)
    if _settle(backend, name) != data:
        raise lost_race(backend, name, "its manifest was written after this one's")
    if claim is not None:
        claim.check_owner()
