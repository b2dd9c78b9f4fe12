"""Find and remove what interrupted saves leave behind, never a committed checkpoint.

Leftovers are: checkpoint directories without a manifest (a save or a retention delete that
was interrupted), stray temporary files at the root (`latest.tmp-...`), and on S3 multipart
uploads started under the root and never completed. A directory with a manifest.json is
never touched, even one that does not parse (it may come from a newer statereg, or be worth
salvaging by hand). Anything younger than the grace period is reported and kept, since a
save may be writing it right now; a directory whose claim is live is kept whatever its age.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, replace

from statereg.backends.base import IncompleteUpload, StorageBackend
from statereg.engine.checkpoints import (
    Committed,
    RootScan,
    read_manifest_at,
    referenced_files,
    refused,
    scan_root,
    skip_entry,
    step_of,
)
from statereg.engine.claims import (
    claim_checkpoint,
    claim_state,
    read_claim,
    read_claims,
    reserved_checkpoints,
    uncommitted_names,
)
from statereg.engine.retention import RETIRED_NAME
from statereg.errors import (
    CheckpointExistsError,
    CheckpointInProgressError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ManifestError,
    StateregError,
    StorageError,
)
from statereg.schemas.manifest import MANIFEST_NAME, WRITER_DIR_PREFIX

logger = logging.getLogger(__name__)

DEFAULT_GRACE_S = 3600.0
# `<name>.tmp-<pid>` or `<name>.tmp-<pid>-<random>`: local writes go through such a name.
_TEMPORARY = re.compile(r"\.tmp-\d+(-[0-9a-f]+)?$")

UNCOMMITTED = "uncommitted checkpoint"
TEMPORARY = "temporary file"
UPLOAD = "incomplete upload"
DAMAGED = "unparsable manifest"
DAMAGED_FILES = "damaged checkpoint"
UPLOADS_UNLISTED = "incomplete uploads"
UNREADABLE = "unreadable entry"
ORPHAN_WRITER = "orphan writer directory"


@dataclass(frozen=True)
class Leftover:
    """One thing gc found: what, where (relative to the root), how big and old, and what
    happens to it (`delete` in a dry run; `deleted` after `--delete`; `keep: why`)."""

    kind: str
    path: str
    size: int
    age_s: float | None
    action: str
    upload: IncompleteUpload | None = None

    @property
    def deletable(self) -> bool:
        return self.action in ("delete", "deleted")


def _age(mtime: float | None, now: float) -> float | None:
    return None if mtime is None else max(0.0, now - mtime)


def _decide(age: float | None, grace_s: float) -> str:
    if age is not None and age < grace_s:
        return f"keep: younger than the grace period ({grace_s:.0f} s); a save may be writing it"
    return "delete"


@dataclass(frozen=True)
class _Held:
    """A checkpoint a live incremental save reuses (its claim names it) whose manifest is
    gone (another job's retention uncommitted it): what it references is unknown, so every
    directory of its step or lower stays while that save runs."""

    name: str

    def covers(self, name: str) -> bool:
        step, held = step_of(name), step_of(self.name)
        return step is not None and held is not None and step <= held


def _directory(backend: StorageBackend, name: str, grace_s: float, now: float,
               needed: set[str], scan: RootScan, held: _Held | None) -> Leftover | None:
    try:
        read_manifest_at(backend, name, check=False)
        return None  # committed: never touched
    except CheckpointNotFoundError:
        pass
    except (ManifestError, CorruptCheckpointError) as exc:  # e.g. a FIFO or link: keep it
        files = backend.walk(name)
        return Leftover(DAMAGED, name, sum(f.size for f in files), None,
                        f"keep: {MANIFEST_NAME} exists but does not parse ({exc}); gc never "
                        "removes a directory with a manifest: inspect it by hand")
    files = backend.walk(name)
    if not files:
        return None  # nothing stored (an object store has no empty directories)
    times = [f.mtime for f in files if f.mtime is not None]
    age = _age(max(times) if times else None, now)
    # What a retention left (its marker): its own, whatever the age of the files.
    retired = any(f.path == f"{name}/{RETIRED_NAME}" for f in files)
    action = "delete" if retired else _decide(age, grace_s)
    # By path, present or not: a reference to a file of it that is gone still names it (the
    # checkpoint that reads it is damaged, not freed), and a saver's claim refuses it too.
    referenced = sum(1 for path in needed if path.startswith(f"{name}/"))
    if referenced:
        action = (f"keep: {referenced} of its files are referenced by committed incremental "
                  "checkpoints (or a running incremental save); retention removes the rest")
    if held is not None and held.covers(name):
        action = (f"keep: a running incremental save reuses {held.name}, whose manifest is "
                  f"gone, so the files it references are unknown; gc keeps every directory "
                  f"up to {held.name} until that save ends")
    reader = scan.might_reference(name)
    if reader is not None:
        action = (f"keep: the manifest of {reader} cannot be read, and it may reference files "
                  f"of {name}; repair or delete {reader} by hand first")
    numbers = read_claims(backend, name)
    if numbers:
        live, why = claim_state(read_claim(backend, name, numbers[-1]), now)
        if live:
            action = f"keep: a save holds it ({why})"
    return Leftover(UNCOMMITTED, name, sum(f.size for f in files), age, action)


def _refused(name: str, exc: StorageError) -> Leftover:
    """An entry under a checkpoint's name this user cannot read (another user's folder on a
    shared root, a file): not this run's, so gc neither reads nor deletes it."""
    return Leftover(UNREADABLE, name, 0, None,
                    f"keep: this user cannot read it ({exc}); not this run's: its owner "
                    "deletes it, or rename it if it is garbage")


def _orphans(backend: StorageBackend, ckpt: Committed) -> list[str]:
    """The writer directories in committed checkpoint `ckpt` that its manifest does not name:
    on a store without conditional creates, what a save of the same step killed after its
    data writes left beside the one that committed (or a racing saver's, which lost)."""
    own = ckpt.manifest.data_dir(ckpt.name)
    try:
        entries = backend.list_dir(ckpt.name)
    except StorageError as exc:
        if not refused(exc):
            raise
        skip_entry(backend, ckpt.name, exc)
        return []
    return [f"{ckpt.name}/{e}" for e in entries
            if e.startswith(WRITER_DIR_PREFIX) and f"{ckpt.name}/{e}" != own]


def _orphan_writers(backend: StorageBackend, ckpt: Committed, grace_s: float, now: float,
                    needed: set[str]) -> list[Leftover]:
    """Leftovers for `_orphans` of `ckpt`: deletable past the grace period, unless a live
    claim holds the step (a racing saver writes it now) or a manifest references a file."""
    found = []
    numbers = read_claims(backend, ckpt.name)
    live, why = (claim_state(read_claim(backend, ckpt.name, numbers[-1]), now) if numbers
                 else (False, ""))
    for path in _orphans(backend, ckpt):
        files = backend.walk(path)
        times = [f.mtime for f in files if f.mtime is not None]
        age = _age(max(times) if times else None, now)
        action = _decide(age, grace_s)
        if live:
            action = f"keep: a save holds {ckpt.name} ({why})"
        if any(p.startswith(f"{path}/") for p in needed):
            action = "keep: committed incremental checkpoints reference files in it"
        found.append(Leftover(ORPHAN_WRITER, path, sum(f.size for f in files), age, action))
    return found


def find_leftovers(backend: StorageBackend, grace_s: float = DEFAULT_GRACE_S,
                   now: float | None = None) -> list[Leftover]:
    """Everything gc would remove under the root, and what it would keep and why."""
    now = time.time() if now is None else now
    found: list[Leftover] = []
    stored = {f.path: f for f in backend.walk("") if "/" not in f.path}
    # Unparsable manifests reference what they might: everything of their step or lower.
    scan = scan_root(backend, check_files=True)
    needed = referenced_files(scan.committed)  # damaged checkpoints' references stay too
    by_name = {c.name: c for c in scan.committed}
    gone = []
    for reused in reserved_checkpoints(backend, uncommitted_names(backend, by_name)):
        if reused in by_name:
            needed |= {f.path for f in by_name[reused].manifest.root_files(reused)}
        elif step_of(reused) is not None:
            gone.append(reused)
    held = _Held(max(gone, key=lambda n: step_of(n) or 0)) if gone else None
    for name, damage in scan.damaged.items():
        found.append(Leftover(
            DAMAGED_FILES, name, by_name[name].manifest.total_bytes, None,
            f"keep: {damage}; gc never removes a checkpoint with a manifest: check it with "
            f"`statereg verify`, then delete {name} by hand (retention neither counts nor "
            "deletes it)"))
    for entry in backend.list_dir(""):
        if entry in scan.refused:
            found.append(_refused(entry, scan.refused[entry]))
        elif step_of(entry) is not None:
            try:
                leftover = _directory(backend, entry, grace_s, now, needed, scan, held)
            except StorageError as exc:
                if not refused(exc):
                    raise
                skip_entry(backend, entry, exc)
                leftover = _refused(entry, exc)
            if leftover is not None:
                found.append(leftover)
        elif _TEMPORARY.search(entry) and entry in stored:
            age = _age(stored[entry].mtime, now)
            found.append(Leftover(TEMPORARY, entry, stored[entry].size, age,
                                  _decide(age, grace_s)))
    # Links and special files under a checkpoint's name: listings leave them out (no
    # checkpoint is one); gc names them, and never follows nor deletes them.
    for entry, info in sorted(stored.items()):
        if step_of(entry) is not None and info.kind not in ("file", "directory"):
            found.append(Leftover(UNREADABLE, entry, 0, None,
                                  f"keep: a {info.kind}, not a checkpoint directory; statereg "
                                  "never follows it: remove it by hand if it is garbage"))
    for ckpt in scan.committed:
        found.extend(_orphan_writers(backend, ckpt, grace_s, now, needed))
    kept_dirs = {f.path for f in found if not f.deletable}
    try:
        uploads = backend.incomplete_uploads("")
    except StorageError as exc:
        # Directories were listed just now, so access works: the store does not list
        # multipart uploads (ListMultipartUploads is optional on S3-compatible servers).
        cause = exc.__cause__
        detail = (str(cause).splitlines()[0] if cause is not None and str(cause)
                  else "no detail")
        found.append(Leftover(
            UPLOADS_UNLISTED, "-", 0, None,
            f"unknown: this store did not list incomplete multipart uploads ({detail}); it "
            "may not support ListMultipartUploads. Everything else was checked; abort "
            "abandoned uploads with the store's own tools or a lifecycle rule"))
        uploads = []
    for upload in uploads:
        top = upload.path.split("/", 1)[0]
        age = _age(upload.initiated, now)
        action = _decide(age, grace_s)
        if top in kept_dirs:
            action = f"keep: under {top}, which is kept"
        found.append(Leftover(UPLOAD, upload.path, 0, age, action, upload))
    return sorted(found, key=lambda f: (f.path, f.kind))


def _remove(backend: StorageBackend, leftover: Leftover) -> Leftover:
    if leftover.kind == UPLOAD and leftover.upload is not None:
        backend.abort_upload(leftover.upload)
    elif leftover.kind == TEMPORARY:
        backend.remove_tree(leftover.path)
    elif leftover.kind == ORPHAN_WRITER:
        # Looked at again now: its checkpoint's manifest still names another writer (a
        # manifest that names this one, or none, keeps it), and no save holds the step.
        name = leftover.path.split("/", 1)[0]
        try:
            ckpt = Committed(name, read_manifest_at(backend, name))
        except StateregError as exc:
            raise CheckpointExistsError(f"{name} changed since it was listed ({exc})") from None
        if leftover.path not in _orphans(backend, ckpt) or _claimed(backend, name):
            raise CheckpointExistsError(
                f"{backend.display(leftover.path)} is in use again: a save of {name} holds "
                "it, or its manifest names it now")
        backend.remove_tree(leftover.path)
    else:
        # Claim the directory as a saver would: that refuses it if a save started meanwhile
        # (its claim is live) or committed it meanwhile, and removes everything in it.
        claim = claim_checkpoint(backend, leftover.path, purpose="gc")
        try:
            backend.remove_tree(leftover.path)  # the claim last of all
        finally:
            claim.release()
    return replace(leftover, action="deleted")


def _claimed(backend: StorageBackend, name: str) -> bool:
    """Whether a live claim holds directory `name` now (a save started since gc listed it)."""
    try:
        numbers = read_claims(backend, name)
        return bool(numbers) and claim_state(read_claim(backend, name, numbers[-1]))[0]
    except StateregError:
        return False


def collect_garbage(backend: StorageBackend, delete: bool = False,
                    grace_s: float = DEFAULT_GRACE_S) -> list[Leftover]:
    """Find leftovers; with `delete`, remove the deletable ones. Returns what was found,
    each with the action taken (a dry run reports `delete` for what it would remove)."""
    found = find_leftovers(backend, grace_s)
    if not delete:
        return found
    done = []
    # Directories before uploads under them: their claim refuses a save started meanwhile.
    for leftover in sorted(found, key=lambda f: f.kind == UPLOAD):
        if not leftover.deletable:
            done.append(leftover)
            continue
        try:
            done.append(_remove(backend, leftover))
            logger.info("gc removed %s %s", leftover.kind, backend.display(leftover.path))
        except CheckpointInProgressError as exc:
            # Kept only for a save that holds the directory now; otherwise the dry run
            # promised a deletion gc could not do, and the CLI must say so (exit 1).
            held = _claimed(backend, leftover.path)
            done.append(replace(leftover, action=f"{'keep' if held else 'failed'}: {exc}"))
        except CheckpointExistsError as exc:  # committed since it was listed
            done.append(replace(leftover, action=f"keep: {exc}"))
        except StateregError as exc:
            done.append(replace(leftover, action=f"failed: {exc}"))
    return sorted(done, key=lambda f: (f.path, f.kind))
