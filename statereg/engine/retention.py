"""Retention: which committed checkpoints the save rules keep, and deleting the rest.

Only intact checkpoints count and only intact ones are deleted; files of a deleted
checkpoint that a kept incremental checkpoint references stay, and what an earlier
retention could not finish is finished by the next one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from statereg.backends.base import StorageBackend
from statereg.engine.checkpoints import (
    RETIRED_NAME,
    Committed,
    RootScan,
    read_latest,
    referenced_files,
    refused,
    scan_root,
    skip_entry,
    step_key,
    step_of,
)
from statereg.engine.claims import (
    claim_checkpoint,
    reserved_checkpoints,
    uncommitted_names,
)
from statereg.errors import CheckpointExistsError, StorageError
from statereg.schemas.manifest import MANIFEST_NAME
from statereg.schemas.spec import SaveSpec

logger = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class _Needed:
    """What retention must not delete, learnt after the manifests of doomed checkpoints are
    gone: the files readable manifests (kept, damaged, reserved) reference, and the highest
    step of a checkpoint a live incremental save reuses whose manifest is already gone (its
    references are unknown: everything of its step or lower stays while that save runs)."""

    files: set[str]
    held_below: int | None
    holder: str | None

    def blocks(self, name: str) -> bool:
        step = step_of(name)
        return self.held_below is not None and step is not None and step <= self.held_below


def _needed(backend: StorageBackend, scan: RootScan, doomed: set[str]) -> _Needed:
    by_name = {c.name: c for c in scan.committed}
    reserved = reserved_checkpoints(backend, uncommitted_names(backend, by_name))
    files = referenced_files(c for c in scan.committed if c.name not in doomed)
    for name in reserved & set(by_name):
        files |= {f.path for f in by_name[name].manifest.root_files(name)}
    gone = sorted((n for n in reserved - set(by_name) if step_of(n) is not None), key=step_key)
    return _Needed(files, step_of(gone[-1]) if gone else None, gone[-1] if gone else None)


def _delete_unneeded(backend: StorageBackend, name: str, needed: _Needed) -> bool:
    """Delete the files of retired checkpoint `name` that nothing needs; True if the whole
    directory went. One that holds needed files keeps its marker, so a later retention
    looks at it again once they are not needed any more."""
    if needed.blocks(name):
        logger.info("retention keeps the files of %s for now: a running incremental save "
                    "reuses %s, whose references are unknown", backend.display(name),
                    needed.holder)
        return False
    if any(path.startswith(f"{name}/") for path in needed.files):
        for stored in backend.walk(name):
            if stored.path in needed.files or stored.path == f"{name}/{RETIRED_NAME}":
                continue
            if stored.kind == "directory":
                # A listing shows a directory only when nothing is in it (one an earlier
                # pass emptied, e.g. a retired checkpoint's optimizer/): removed as one.
                backend.remove_tree(stored.path)
            else:
                _remove(backend, stored.path)
        return False
    backend.remove_tree(name)
    return True


def _retry_retired(backend: StorageBackend, scan: RootScan, doomed: set[str],
                   needed: _Needed) -> list[str]:
    """Finish what an earlier retention left (it failed or was killed after removing a
    manifest), and files kept for references that nothing needs any more: directories
    without a manifest that hold RETIRED_NAME. Each is claimed as gc claims one, so a save
    of that step that starts meanwhile is refused rather than losing files."""
    known = {c.name for c in scan.committed} | set(scan.unreadable) | doomed
    finished = []
    for name in uncommitted_names(backend, known):
        try:
            retired = RETIRED_NAME in backend.list_dir(name)
        except StorageError as exc:  # another user's folder: not this run's to finish
            if not refused(exc):
                raise
            skip_entry(backend, name, exc)
            continue
        if not retired or scan.might_reference(name) or needed.blocks(name):
            continue
        if any(path.startswith(f"{name}/") for path in needed.files):
            _delete_unneeded(backend, name, needed)  # a saver of this step is refused there
            continue
        try:
            claim = claim_checkpoint(backend, name, purpose="gc")
        except CheckpointExistsError as exc:  # a save holds it, or committed it meanwhile
            logger.debug("retention leaves %s: %s", backend.display(name), exc)
            continue
        try:
            backend.remove_tree(name)  # the claim last of all
        finally:
            claim.release()
        finished.append(name)
    return finished


def apply_retention(backend: StorageBackend, save: SaveSpec, saved: str | None = None,
                    ) -> list[str]:
    """Delete committed checkpoints no rule keeps, nor is `saved` (the checkpoint the save
    that runs retention just wrote, even when its step is lower); returns their names.

    Only intact checkpoints count: their manifest matches manifest.sum and parses, and
    every file it records (their own and those they reference) is listed with its recorded
    size. A damaged newer one never pushes an intact older one out, and is itself never
    deleted (`statereg gc` and `verify` report it). Files are kept when a readable
    checkpoint that stays (kept or damaged) references them, when a live incremental save
    may reference them (its claim says so), or when an unreadable manifest of the same or
    a higher step might (docs/reliability.md).

    Each doomed checkpoint is marked (RETIRED_NAME), then the manifests go first, so an
    interrupted or failed delete leaves uncommitted, marked directories (which readers
    ignore), never a manifest that points at missing files; the next retention, or
    `statereg gc`, deletes what of them nothing needs. Claims are read only after the
    manifests are gone: a save that claims later finds its base uncommitted and does not
    reference it (engine/incremental.py, hold_previous).

    Cost: one manifest read and one listing per checkpoint directory, one listing per
    directory without a manifest, and one more listing per marked one.
    """
    if save.keep_last is None:  # nothing to delete: spare reading every manifest
        return []
    scan = scan_root(backend, check_files=True)
    keep = kept_names(scan.intact, save, read_latest(backend)) | ({saved} if saved else set())
    doomed = []
    for ckpt in scan.intact:
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
        doomed.append(ckpt.name)
    for name in doomed:
        backend.write_bytes(f"{name}/{RETIRED_NAME}", b"")
        _remove(backend, f"{name}/{MANIFEST_NAME}")
    needed = _needed(backend, scan, set(doomed))
    for name in doomed:
        _delete_unneeded(backend, name, needed)
        logger.debug("retention deleted %s", backend.display(name))
    for name in _retry_retired(backend, scan, set(doomed), needed):
        logger.info("retention removed %s, which an earlier retention left",
                    backend.display(name))
    return doomed
