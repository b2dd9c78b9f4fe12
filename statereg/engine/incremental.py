"""Incremental saves: reference tensors that did not change since the previous checkpoint.

The previous checkpoint's manifest holds a digest per tensor item, and its DCP metadata says
where each item lives. An item whose digest is unchanged is not written again: the new DCP
metadata points at the old file (a relative path with '..', which plain DCP resolves on local
disk), and the new manifest lists that file under `references`, so verify, retention, gc and
cp know the new checkpoint depends on it.
"""

from __future__ import annotations

import posixpath
from collections import defaultdict

from statereg.backends.base import StorageBackend
from statereg.backends.checksum import checksum_of, new_hasher
from statereg.backends.dcp_io import (
    METADATA_NAME,
    Reusable,
    item_checksums,
    item_key,
    load_dcp_metadata,
    normalize_path,
)
from statereg.engine.checkpoints import Committed, latest_committed, read_manifest_at
from statereg.engine.claims import Claim
from statereg.errors import (
    CheckpointDeletedError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
)
from statereg.schemas.manifest import FileRecord

# How often a save looks for a base again when retention uncommits the one it found.
_BASE_ATTEMPTS = 3


def hold_previous(backend: StorageBackend, claim: Claim) -> Committed | None:
    """The checkpoint an incremental save may reference, recorded in its claim first.

    Retention uncommits what it deletes before it reads the claims of running saves, and
    keeps the files they name; so once the claim names the base, either retention saw the
    claim (the files stay), or it had uncommitted the base already, which the re-read here
    finds, and the save looks for another base.
    """
    for _ in range(_BASE_ATTEMPTS):
        previous = latest_committed(backend)
        if previous is None:
            break
        claim.hold(previous.name)
        try:
            read_manifest_at(backend, previous.name)
        except CheckpointNotFoundError:
            continue
        return previous
    claim.hold("")
    return None


def check_references(backend: StorageBackend, previous: Committed,
                     references: list[FileRecord]) -> None:
    """Before commit: every referenced file still exists with its recorded size, and the
    files reused for the first time (the previous checkpoint's own) match their checksums.

    The sizes take one listing per directory. Reading a file the first time it is reused
    stops bit rot from spreading: a damaged base would otherwise be referenced by every
    later checkpoint, unread, since unchanged items are matched by the previous manifest's
    digests. Each file is read at most once in its life this way: the next save references
    it through a checkpoint that already checked it.
    """
    by_dir: dict[str, list[FileRecord]] = defaultdict(list)
    for record in references:
        by_dir[posixpath.dirname(record.path)].append(record)
    for directory, records in sorted(by_dir.items()):
        listed = {f.path: f.size for f in backend.walk(directory)}
        for record in records:
            size = listed.get(record.path)
            if size is None:
                raise CheckpointDeletedError(
                    f"{backend.display(record.path)}, which this incremental save references, "
                    "was deleted while the save ran (by another process's retention, or by "
                    "hand); nothing was committed: save again (the next save writes the "
                    "tensors itself), and give each job its own root"
                )
            if size != record.size:
                raise CorruptCheckpointError(
                    f"{backend.display(record.path)} has {size} bytes, {record.size} recorded; "
                    "this incremental save references it, so nothing was committed. The base "
                    f"checkpoint is damaged: delete {record.path.split('/', 1)[0]} and save again"
                )
    for record in references:
        if not record.path.startswith(f"{previous.name}/"):
            continue  # reused before: checked when the previous checkpoint was saved
        hasher = new_hasher()
        hasher.update(backend.read_bytes(record.path))
        if checksum_of(hasher) != record.checksum:
            raise CorruptCheckpointError(
                f"{backend.display(record.path)}: checksum {checksum_of(hasher)} differs from "
                f"{record.checksum} recorded by {previous.name}; this incremental save would "
                "reference the damaged file, so nothing was committed. Delete "
                f"{previous.name} (it does not load either) and save again"
            )


def reuse_index(backend: StorageBackend, previous: Committed | None,
                dcp_dir: str) -> dict[str, Reusable]:
    """Items of `previous` under `dcp_dir` that a new save may reference, by item key."""
    if previous is None:
        return {}
    prefix = f"{dcp_dir}/"
    digests = {key.removeprefix(prefix): digest
               for key, digest in previous.manifest.digests.items() if key.startswith(prefix)}
    if not digests:
        return {}
    where = f"{previous.manifest.data_dir(previous.name)}/{dcp_dir}"
    meta_path = f"{where}/{METADATA_NAME}"
    metadata = load_dcp_metadata(backend.read_bytes(meta_path), backend.display(meta_path))
    found = {}
    checksums = item_checksums(metadata)
    for index, info in metadata.storage_data.items():
        key = item_key(index)
        if key in digests:
            found[key] = Reusable(
                digest=digests[key],
                path=normalize_path(posixpath.join(where, info.relative_path)),
                offset=info.offset, length=info.length,
                transforms=tuple(info.transform_descriptors or ()),
                checksum=checksums.get(index))
    return found


def reference_records(previous: Committed | None, referenced: set[str]) -> list[FileRecord]:
    """The manifest records (size, checksum) of the earlier files a new save references."""
    if not referenced:
        return []
    assert previous is not None
    known = {f.path: f for f in previous.manifest.root_files(previous.name)}
    return [known[path] for path in sorted(referenced)]
