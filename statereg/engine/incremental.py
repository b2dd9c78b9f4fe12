"""Incremental saves: reference tensors that did not change since the previous checkpoint.

The previous checkpoint's manifest holds a digest per tensor item, and its DCP metadata says
where each item lives. An item whose digest is unchanged is not written again: the new DCP
metadata points at the old file (a relative path with '..', which plain DCP resolves on local
disk), and the new manifest lists that file under `references`, so verify, retention, gc and
cp know the new checkpoint depends on it.

Every save that references a file first reads it whole and checks it against its recorded
size and checksum (`reuse_index`): a damaged file is not referenced, its tensors are written
again from memory, so bit rot in a base never spreads to later checkpoints.
"""

from __future__ import annotations

import logging
import posixpath
from collections import defaultdict
from collections.abc import Iterator, Mapping

from statereg.backends.base import StorageBackend
from statereg.backends.checksum import checksum_of, new_hasher
from statereg.dcp import METADATA_NAME
from statereg.dcp.fs import normalize_path
from statereg.dcp.metadata import item_checksums, load_dcp_metadata
from statereg.dcp.reuse import Reusable, item_key
from statereg.engine.checkpoints import Committed, latest_committed, read_manifest_at
from statereg.engine.claims import Claim
from statereg.engine.verify import verify_files
from statereg.errors import (
    CheckpointDeletedError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
)
from statereg.schemas.manifest import FileRecord

logger = logging.getLogger(__name__)

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
    """Before commit: every referenced file still exists with its recorded size.

    The sizes take one listing per directory. Their contents were checked when this save
    chose to reference them (`reuse_index` reads each file whole first); this catches a
    file deleted or replaced since, by another job or by hand.
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
                    "this incremental save references it (through "
                    f"{previous.name}), so nothing was committed: save again (the next save "
                    "writes the tensors itself)"
                )


class VerifiedReuse(Mapping[str, Reusable]):
    """The items an incremental save may reference, each offered only once the file that
    holds it was read whole and matched its recorded size and checksum.

    Checked lazily, once per file per save, when the DCP writer first asks for an item of
    it (dcp/writer.py, BackendWriter._reference_unchanged): a rank reads only files it
    references. A file that fails is not referenced: its items look absent, so the writer
    writes those tensors from memory, and the save commits a checkpoint that loads.
    """

    def __init__(self, backend: StorageBackend, previous: Committed,
                 items: dict[str, Reusable]) -> None:
        self._backend = backend
        self._previous = previous
        self._items = items
        self._records = {f.path: f for f in previous.manifest.root_files(previous.name)}
        self._sound: dict[str, bool] = {}

    def __getitem__(self, key: str) -> Reusable:
        item = self._items[key]
        sound = self._sound.get(item.path)
        if sound is None:
            sound = self._sound[item.path] = self._check(item.path)
        if not sound:
            raise KeyError(key)
        return item

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def _check(self, path: str) -> bool:
        record = self._records.get(path)
        if record is None:  # DCP metadata naming a file the manifest does not list
            logger.warning("%s is not among the files %s records; this incremental save "
                           "writes the tensors stored there itself",
                           self._backend.display(path), self._previous.name)
            return False
        try:
            verify_files(self._backend, "", [record], "full")
        except CorruptCheckpointError as exc:
            logger.warning("this incremental save does not reference a damaged file: it "
                           "writes the tensors stored there itself (%s). Checkpoints that "
                           "reference the file do not load: `statereg verify` names them",
                           exc)
            return False
        return True


def reuse_index(backend: StorageBackend, previous: Committed | None,
                dcp_dir: str) -> Mapping[str, Reusable]:
    """Items of `previous` under `dcp_dir` that a new save may reference, by item key; each
    is offered only after its file was verified whole (VerifiedReuse). A `.metadata` that
    does not match its recorded checksum offers nothing: the save writes every tensor."""
    if previous is None:
        return {}
    prefix = f"{dcp_dir}/"
    digests = {key.removeprefix(prefix): digest
               for key, digest in previous.manifest.digests.items() if key.startswith(prefix)}
    if not digests:
        return {}
    where = f"{previous.manifest.data_dir(previous.name)}/{dcp_dir}"
    meta_path = f"{where}/{METADATA_NAME}"
    data = backend.read_bytes(meta_path)
    record = next((f for f in previous.manifest.files if f.path == f"{dcp_dir}/{METADATA_NAME}"),
                  None)
    if record is not None:
        hasher = new_hasher()
        hasher.update(data)
        if len(data) != record.size or checksum_of(hasher) != record.checksum:
            logger.warning("%s does not match the size and checksum %s records; this "
                           "incremental save writes every tensor of %s itself",
                           backend.display(meta_path), previous.name, dcp_dir)
            return {}
    metadata = load_dcp_metadata(data, backend.display(meta_path))
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
    return VerifiedReuse(backend, previous, found)


def reference_records(previous: Committed | None, referenced: set[str]) -> list[FileRecord]:
    """The manifest records (size, checksum) of the earlier files a new save references."""
    if not referenced:
        return []
    assert previous is not None
    known = {f.path: f for f in previous.manifest.root_files(previous.name)}
    return [known[path] for path in sorted(referenced)]
