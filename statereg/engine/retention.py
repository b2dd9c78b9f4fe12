"""Retention: which committed checkpoints the save rules keep, and deleting the rest.

Files of a deleted checkpoint that a kept incremental checkpoint references stay.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from statereg.backends.base import StorageBackend
from statereg.engine.checkpoints import Committed, list_committed, read_latest
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


def referenced_files(checkpoints: Iterable[Committed]) -> set[str]:
    """Root-relative paths of earlier files that these (incremental) checkpoints read."""
    return {ref.path for ckpt in checkpoints for ref in ckpt.manifest.references}


def apply_retention(backend: StorageBackend, save: SaveSpec) -> list[str]:
    """Delete committed checkpoints no rule keeps; returns their names.

    The manifest goes first, so an interrupted delete leaves an uncommitted directory (which
    is ignored, and `statereg gc` removes), never a manifest that points at missing files.
    """
    if save.keep_last is None:  # nothing to delete: spare reading every manifest
        return []
    committed = list_committed(backend)
    keep = kept_names(committed, save, read_latest(backend))
    # Files of a deleted checkpoint that a kept (incremental) one references stay.
    needed = referenced_files(c for c in committed if c.name in keep)
    deleted = []
    for ckpt in committed:
        if ckpt.name in keep:
            continue
        backend.remove_file(f"{ckpt.name}/{MANIFEST_NAME}")
        if any(path.startswith(f"{ckpt.name}/") for path in needed):
            for stored in backend.walk(ckpt.name):
                if stored.path not in needed:
                    backend.remove_file(stored.path)
        else:
            backend.remove_tree(ckpt.name)
        deleted.append(ckpt.name)
        logger.debug("retention deleted %s", backend.display(ckpt.name))
    return deleted
