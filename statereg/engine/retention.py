"""Retention: which committed checkpoints the save rules keep, and deleting the rest.

Files of a deleted checkpoint that a kept incremental checkpoint references stay.
"""

from __future__ import annotations

import logging

from statereg.backends.base import StorageBackend
from statereg.engine.checkpoints import (
    Committed,
    read_latest,
    referenced_files,
    scan_root,
)
from statereg.engine.claims import reserved_checkpoints, uncommitted_names
from statereg.errors import StorageError
from statereg.schemas.manifest import MANIFEST_NAME
from statereg.schemas.spec import SaveSpec

logger = logging.getLogger("statereg")


def best_checkpoints(committed: list[Committed], save: SaveSpec) -> list[Committed]:
    """The checkpoints `save.keep_best` names, best first (empty when not declared)."""
    rule = save.keep_best
    if rule is None:
        return []
    scored = [c for c in committed if isinstance(c.manifest.extra.get(rule.metric), (int, float))]
    scored.sort(key=lambda c: c.manifest.extra[rule.metric], reverse=rule.mode == "max")
    return scored[: rule.count]


def kept_names(committed: list[Committed], save: SaveSpec, latest: str | None) -> set[str]:
    """Names retention keeps: newest keep_last, multiples of keep_every, keep_best, latest."""
    if save.keep_last is None:
        return {c.name for c in committed}
    keep = {c.name for c in committed[-save.keep_last:]}
    if save.keep_every is not None:
        keep |= {c.name for c in committed if c.step % save.keep_every == 0}
    keep |= {c.name for c in best_checkpoints(committed, save)}
    if latest is not None:
        keep.add(latest)
    return keep


def _remove(backend: StorageBackend, path: str) -> None:
    """Delete one file; one that is already gone (another process's retention, two jobs on
    one root) is not an error. Some stores report a missing file as a failed delete."""
    try:
        backend.remove_file(path)
    except (FileNotFoundError, StorageError):
        if backend.exists(path):
            raise


def apply_retention(backend: StorageBackend, save: SaveSpec, saved: str | None = None,
                    ) -> list[str]:
    """Delete committed checkpoints no rule keeps, nor is `saved` (the checkpoint the save
    that runs retention just wrote, even when its step is lower); returns their names.

    Only checkpoints that would load count (their manifest matches manifest.sum and
    parses): a damaged newer one never pushes an intact older one out, and is itself never
    deleted (it is reported by `statereg gc`). Files are kept when a kept checkpoint
    references them, when a live incremental save may reference them (its claim says so),
    or when an unreadable manifest of the same or a higher step might (docs/reliability.md).

    The manifests go first, so an interrupted delete leaves uncommitted directories (which
    are ignored, and `statereg gc` removes), never a manifest that points at missing files.
    Claims are read only after that: a save that claims later finds its base uncommitted
    and does not reference it (engine/incremental.py, hold_previous).
    """
    if save.keep_last is None:  # nothing to delete: spare reading every manifest
        return []
    scan = scan_root(backend)
    committed = scan.committed
    keep = kept_names(committed, save, read_latest(backend)) | ({saved} if saved else set())
    doomed = []
    for ckpt in committed:
        if ckpt.name in keep:
            continue
        reader = scan.might_reference(ckpt.name)
        if reader is not None:
            logger.warning(
                "retention keeps %s: the manifest of %s cannot be read (%s), and it may "
                "reference files of %s; repair or delete %s by hand (`statereg gc` reports it)",
                backend.display(ckpt.name), backend.display(reader), scan.unreadable[reader],
                ckpt.name, reader)
            continue
        doomed.append(ckpt)
    for ckpt in doomed:
        _remove(backend, f"{ckpt.name}/{MANIFEST_NAME}")
    by_name = {c.name: c for c in committed}
    reserved = reserved_checkpoints(backend, uncommitted_names(backend, by_name))
    needed = referenced_files(c for c in committed if c.name in keep)
    for name in reserved & set(by_name):
        needed |= {f.path for f in by_name[name].manifest.root_files(name)}
    for ckpt in doomed:
        if any(path.startswith(f"{ckpt.name}/") for path in needed):
            for stored in backend.walk(ckpt.name):
                if stored.path not in needed:
                    _remove(backend, stored.path)
        else:
            backend.remove_tree(ckpt.name)
        logger.debug("retention deleted %s", backend.display(ckpt.name))
    return [c.name for c in doomed]
