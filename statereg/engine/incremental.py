"""Incremental saves: reference tensors that did not change since the previous checkpoint.

The previous checkpoint's manifest holds a digest per tensor item, and its DCP metadata says
where each item lives. An item whose digest is unchanged is not written again: the new DCP
metadata points at the old file (a relative path with '..', which plain DCP resolves on local
disk), and the new manifest lists that file under `references`, so verify, retention, gc and
cp know the new checkpoint depends on it.
"""

from __future__ import annotations

import posixpath

from statereg.backends.base import StorageBackend
from statereg.backends.dcp_io import (
    METADATA_NAME,
    Reusable,
    item_key,
    load_dcp_metadata,
    normalize_path,
)
from statereg.engine.checkpoints import Committed
from statereg.schemas.manifest import FileRecord


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
    where = f"{previous.name}/{dcp_dir}"
    meta_path = f"{where}/{METADATA_NAME}"
    metadata = load_dcp_metadata(backend.read_bytes(meta_path), backend.display(meta_path))
    found = {}
    for index, info in metadata.storage_data.items():
        key = item_key(index)
        if key in digests:
            found[key] = Reusable(
                digest=digests[key],
                path=normalize_path(posixpath.join(where, info.relative_path)),
                offset=info.offset, length=info.length,
                transforms=tuple(info.transform_descriptors or ()))
    return found


def reference_records(previous: Committed | None, referenced: set[str]) -> list[FileRecord]:
    """The manifest records (size, checksum) of the earlier files a new save references."""
    if not referenced:
        return []
    assert previous is not None
    known = {f.path: f for f in previous.manifest.root_files(previous.name)}
    return [known[path] for path in sorted(referenced)]
