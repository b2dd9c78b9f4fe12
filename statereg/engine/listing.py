"""Find a root's checkpoints without a declaration: `list_checkpoints` and `latest`.

An evaluation job, a fine-tune script or a scheduler knows where a run writes (its
`storage.url`) but has no `statereg.yaml` to build a CheckpointManager from. These read
manifests only (never a tensor), so they import no torch: `statereg ls` and `statereg
verify ROOT` run on them. "Intact" is what a resume checks before it loads: the manifest
matches its manifest.sum and parses, and every file it records is there at its recorded
size (one listing per directory). A flipped byte inside a file of the right size is found
only by reading it all: `statereg.verify(url)` or `statereg verify ROOT`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from statereg.backends.base import StorageBackend
from statereg.backends.registry import open_backend, url_scheme
from statereg.engine.checkpoints import (
    Committed,
    latest_committed,
    scan_root,
)
from statereg.errors import CheckpointNotFoundError
from statereg.schemas.manifest import Manifest

_LOCAL_SCHEMES = ("", "file", "local")


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint's bookkeeping, read from its manifest without loading any tensor.

    `path` is the checkpoint's URL (what `CheckpointManager.load` and `statereg inspect`
    take); `manifest` is the whole manifest (sizes, versions, files). `damage` says why the
    checkpoint would not load, for listings asked for damaged ones too (`intact=False`);
    None for an intact one.
    """

    step: int
    tokens_seen: int | None
    extra: dict[str, Any]
    path: str
    components: tuple[str, ...]
    manifest: Manifest = field(repr=False, compare=False)
    damage: str | None = None

    @classmethod
    def of(cls, manifest: Manifest, path: str, damage: str | None = None) -> CheckpointInfo:
        return cls(manifest.step, manifest.tokens_seen, dict(manifest.extra), path,
                   tuple(manifest.components), manifest, damage)

    @property
    def name(self) -> str:
        """The checkpoint's directory under its root, e.g. 'step_00000100'."""
        return self.path.rstrip("/").rpartition("/")[2]

    @property
    def created_at(self) -> str:
        """When it was committed (UTC, ISO 8601)."""
        return self.manifest.created_at

    @property
    def total_bytes(self) -> int:
        """The bytes of its own files, as stored."""
        return self.manifest.total_bytes


def open_root(url: str | os.PathLike[str], options: dict[str, Any] | None = None,
              ) -> StorageBackend:
    """The backend of checkpoint root `url`. A local root that does not exist is refused
    (a misspelled path must not read as "no checkpoints yet"); an object store has no
    directories to miss, so an empty prefix there is just a root with no checkpoint."""
    text = os.fspath(url)
    if "://" not in text:  # a relative path: URLs that stay valid from another directory
        text = os.path.abspath(text)
    backend = open_backend(text, options)
    if url_scheme(text) in _LOCAL_SCHEMES and not backend.exists(""):
        raise CheckpointNotFoundError(
            f"{backend.display()} does not exist: no checkpoint root there; check the path "
            "(it is the storage.url the run saved to)"
        )
    return backend


def _info(backend: StorageBackend, ckpt: Committed, damage: Exception | None = None,
          ) -> CheckpointInfo:
    return CheckpointInfo.of(ckpt.manifest, backend.display(ckpt.name),
                             None if damage is None else str(damage))


def checkpoints_in(backend: StorageBackend, intact: bool = True) -> list[CheckpointInfo]:
    """`list_checkpoints` on an open backend (the CLI's `ls` and `verify ROOT`)."""
    scan = scan_root(backend, check_files=True)
    if intact:
        return [_info(backend, c) for c in scan.intact]
    return [_info(backend, c, scan.damaged.get(c.name)) for c in scan.committed]


def list_checkpoints(url: str | os.PathLike[str], *, intact: bool = True,
                     **storage_options: Any) -> list[CheckpointInfo]:
    """Every committed checkpoint under root `url`, oldest step first.

    `storage_options` are the fsspec options a declaration's `storage.options` holds
    (`key=`, `endpoint_url=`, ...). With `intact=True` (default) a checkpoint whose manifest
    or files are damaged is left out (a warning names it), as `CheckpointManager.list()`
    does; with `intact=False` it is listed with `damage` saying why it would not load.
    Interrupted saves (no manifest) are never listed. A local root that does not exist
    raises CheckpointNotFoundError.
    """
    return checkpoints_in(open_root(url, storage_options), intact)


def latest(url: str | os.PathLike[str], *, intact: bool = True,
           **storage_options: Any) -> CheckpointInfo | None:
    """The newest checkpoint under root `url` (highest step), or None when it has none.

    With `intact=True` (default) it is the one a resume would load: a damaged newer one is
    skipped (a warning names it) for the newest intact one, and a root whose checkpoints are
    all damaged raises the newest one's CorruptCheckpointError rather than looking empty.
    With `intact=False` it is the highest committed step as its manifest says, damaged or
    not (`damage` says why it would not load). A local root that does not exist raises
    CheckpointNotFoundError. Reads one manifest and one listing in the usual case.
    """
    backend = open_root(url, storage_options)
    if intact:
        found = latest_committed(backend)
        return None if found is None else _info(backend, found)
    listed = checkpoints_in(backend, intact=False)
    return listed[-1] if listed else None

