"""The commit protocol: manifest.json last, `latest` after it, retention only after both.

A checkpoint directory counts only once its manifest exists and parses. No step needs a
rename, so the protocol holds on object stores, where a single PUT is the atomic unit.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from statereg.backends.base import StorageBackend
from statereg.errors import CheckpointNotFoundError, ManifestError
from statereg.schemas.manifest import MANIFEST_NAME, Manifest, parse_manifest
from statereg.schemas.spec import SaveSpec

logger = logging.getLogger("statereg")

LATEST_NAME = "latest"
_CHECKPOINT_NAME = re.compile(r"^step_(\d{8,})$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(name: str) -> int | None:
    """The step encoded in a checkpoint directory name, or None if it is not one."""
    match = _CHECKPOINT_NAME.match(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class Committed:
    """A committed checkpoint: its directory name under the root and its manifest."""

    name: str
    manifest: Manifest

    @property
    def step(self) -> int:
        return self.manifest.step


def read_manifest_at(backend: StorageBackend, name: str) -> Manifest:
    """The manifest of checkpoint `name`; CheckpointNotFoundError if it was never committed."""
    path = f"{name}/{MANIFEST_NAME}"
    try:
        data = backend.read_bytes(path)
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"{backend.display(name)} has no {MANIFEST_NAME}: it does not exist or was never "
            "committed (an interrupted save); `statereg ls` lists the committed checkpoints"
        ) from None
    return parse_manifest(data, backend.display(path))


def list_committed(backend: StorageBackend) -> list[Committed]:
    """Every committed checkpoint under the root, oldest step first.

    Directories without a valid manifest are skipped: they are interrupted saves.
    """
    found = []
    for name in backend.list_dir(""):
        if step_of(name) is None:
            continue
        try:
            found.append(Committed(name, read_manifest_at(backend, name)))
        except CheckpointNotFoundError:
            continue
        except ManifestError as exc:
            logger.warning("skipping %s: %s", backend.display(name), exc)
    return sorted(found, key=lambda c: c.step)


def read_latest(backend: StorageBackend) -> str | None:
    """The name in the `latest` pointer, or None if there is none."""
    try:
        name = backend.read_bytes(LATEST_NAME).decode("utf-8", "replace").strip()
    except FileNotFoundError:
        return None
    return name if step_of(name) is not None else None


def latest_committed(backend: StorageBackend) -> Committed | None:
    """The checkpoint `latest` names if it is committed, else the newest committed one."""
    name = read_latest(backend)
    if name is not None:
        try:
            return Committed(name, read_manifest_at(backend, name))
        except (CheckpointNotFoundError, ManifestError) as exc:
            logger.warning("'latest' names %s, which is not usable (%s); scanning", name, exc)
    committed = list_committed(backend)
    return committed[-1] if committed else None


def commit(backend: StorageBackend, name: str, manifest: Manifest) -> None:
    """Publish a fully written checkpoint: manifest first, then the `latest` pointer."""
    backend.write_bytes(f"{name}/{MANIFEST_NAME}", manifest.to_json())
    backend.write_bytes(LATEST_NAME, name.encode())


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


def apply_retention(backend: StorageBackend, save: SaveSpec) -> list[str]:
    """Delete committed checkpoints no rule keeps; returns their names.

    The manifest goes first, so an interrupted delete leaves an uncommitted directory (which
    is ignored), never a manifest that points at missing files.
    """
    if save.keep_last is None:  # nothing to delete: spare reading every manifest
        return []
    committed = list_committed(backend)
    keep = kept_names(committed, save, read_latest(backend))
    deleted = []
    for ckpt in committed:
        if ckpt.name in keep:
            continue
        backend.remove_file(f"{ckpt.name}/{MANIFEST_NAME}")
        backend.remove_tree(ckpt.name)
        deleted.append(ckpt.name)
        logger.debug("retention deleted %s", backend.display(ckpt.name))
    return deleted
