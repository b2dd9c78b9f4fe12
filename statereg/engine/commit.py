"""The commit protocol: claim, files, manifest.sum, manifest.json, `latest`; retention after.

A checkpoint directory counts only once its manifest exists, parses and matches its
manifest.sum. No step needs a rename, so the protocol holds on object stores, where a single
PUT is the atomic unit. docs/reliability.md walks through each step and what a crash at
each one leaves behind.

Concurrent savers: before the first file, the saver claims the directory by creating
`.claim-NNNNN` exclusively (a conditional write on object stores, link(2) on local disk).
The claim names its process and is renewed while the save runs; another saver of the same
step is refused while the claim is live, and takes a stale one over by creating the next
number, which only one can do. The manifest itself is created exclusively too, so two savers
can never both believe they committed one step.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime

from statereg.backends.base import StorageBackend, checksum_of, new_hasher
from statereg.errors import (
    CheckpointExistsError,
    CheckpointInProgressError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ManifestError,
    StorageError,
)
from statereg.schemas.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    Manifest,
    parse_manifest,
)
from statereg.schemas.spec import SaveSpec

logger = logging.getLogger("statereg")

LATEST_NAME = "latest"
# The manifest's own checksum, written just before the manifest (absent in checkpoints
# written before it existed, which are read without it).
MANIFEST_SUM_NAME = "manifest.sum"
CLAIM_PREFIX = ".claim-"
_CHECKPOINT_NAME = re.compile(r"^step_(\d{8,})$")
_CLAIM_NAME = re.compile(r"^\.claim-(\d{5,})$")
_CLAIM_TEMPORARY = re.compile(r"^\.claim-\d{5,}\.tmp-")
_SUM_LINE = re.compile(r"^xxh3_64:[0-9a-f]{16}$")
# A claim nobody renewed for this long is stale (its saver died on another host).
CLAIM_LEASE_S = float(os.environ.get("STATEREG_CLAIM_LEASE_S", "120"))
_CLAIM_ATTEMPTS = 5


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


# -- reading manifests ---------------------------------------------------------------------


def manifest_checksum(data: bytes) -> str:
    hasher = new_hasher()
    hasher.update(data)
    return checksum_of(hasher)


def check_manifest_sum(backend: StorageBackend, name: str, data: bytes) -> None:
    """Compare the manifest bytes with manifest.sum; CorruptCheckpointError if they differ.

    A checkpoint without manifest.sum was written before statereg wrote one and is read as
    it is: its files are still checked against their sizes and checksums.
    """
    sum_path = f"{name}/{MANIFEST_SUM_NAME}"
    try:
        recorded = backend.read_bytes(sum_path).decode("ascii", "replace").strip()
    except FileNotFoundError:
        return
    path = backend.display(f"{name}/{MANIFEST_NAME}")
    if not _SUM_LINE.match(recorded):
        raise CorruptCheckpointError(
            f"{backend.display(sum_path)} is damaged (it does not hold an xxh3_64 checksum), so "
            f"{path} cannot be checked: load an earlier checkpoint"
        )
    actual = manifest_checksum(data)
    if actual != recorded:
        raise CorruptCheckpointError(
            f"{path}: checksum {actual} differs from {recorded} recorded in {MANIFEST_SUM_NAME} "
            f"({len(data)} bytes read); the manifest is damaged: load an earlier checkpoint"
        )


def read_manifest_at(backend: StorageBackend, name: str, check: bool = True) -> Manifest:
    """The manifest of checkpoint `name`; CheckpointNotFoundError if it was never committed.

    `check` compares it with manifest.sum first (one more small read); listings skip that.
    """
    path = f"{name}/{MANIFEST_NAME}"
    try:
        # One byte past the bound is enough to refuse it: a hostile multi-GB manifest is
        # never read whole.
        data = backend.read_bytes(path, limit=MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"{backend.display(name)} has no {MANIFEST_NAME}: it does not exist or was never "
            "committed (an interrupted save); `statereg ls` lists the committed checkpoints"
        ) from None
    if check:
        check_manifest_sum(backend, name, data)
    manifest = parse_manifest(data, backend.display(path))
    step = step_of(name)
    if step is not None and manifest.step != step:
        raise ManifestError(
            f"{backend.display(path)}: the manifest says step {manifest.step}, the directory "
            f"is {name}; the manifest is damaged or was moved: load an earlier checkpoint"
        )
    return manifest


def _usable(backend: StorageBackend, name: str, damaged: list[Exception]) -> Committed | None:
    """The committed checkpoint `name`, or None (its damage, if any, added to `damaged`)."""
    try:
        return Committed(name, read_manifest_at(backend, name))
    except CheckpointNotFoundError:
        return None
    except (ManifestError, CorruptCheckpointError) as exc:
        logger.warning("skipping %s: %s", backend.display(name), exc)
        damaged.append(exc)
        return None


def list_committed(backend: StorageBackend) -> list[Committed]:
    """Every committed checkpoint under the root, oldest step first.

    Directories without a valid manifest are skipped: they are interrupted saves.
    """
    found = []
    for name in backend.list_dir(""):
        if step_of(name) is None:
            continue
        try:
            found.append(Committed(name, read_manifest_at(backend, name, check=False)))
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


def _created(committed: Committed) -> datetime | None:
    try:
        return datetime.fromisoformat(committed.manifest.created_at)
    except (TypeError, ValueError):
        return None


def _committed_before(newer_step: Committed, pointed: Committed) -> bool:
    """Whether `newer_step` was committed before `pointed` (a rollback to a lower step).

    Commit times have one-second resolution; within the same second the higher step wins.
    """
    a, b = _created(newer_step), _created(pointed)
    if a is None or b is None:
        return False
    try:
        return a < b
    except TypeError:  # one naive, one aware: not comparable, so not provably before
        return False


def latest_committed(backend: StorageBackend) -> Committed | None:
    """The checkpoint to resume from: the one `latest` names, or a newer committed one.

    The manifest commits a checkpoint and `latest` is written after it, so a crash between
    the two leaves a committed checkpoint of a higher step that `latest` does not name yet;
    it wins unless it was committed before the one `latest` names (a rollback).

    Uncommitted directories are skipped. A damaged checkpoint (its manifest does not match
    manifest.sum, or does not parse) is skipped with a warning in favour of an older intact
    one; if no intact one is left, its error is raised: a damaged root never looks empty,
    which would silently restart training from scratch.
    """
    damaged: list[Exception] = []
    pointer_name = read_latest(backend)
    pointer = _usable(backend, pointer_name, damaged) if pointer_name is not None else None
    if pointer_name is not None and pointer is None:
        logger.warning("'latest' names %s, which is not usable; scanning", pointer_name)
    names = sorted((n for n in backend.list_dir("") if step_of(n) is not None), key=step_of)
    for name in reversed(names):
        if pointer is not None and step_of(name) <= pointer.step:  # type: ignore[operator]
            break
        if name == pointer_name:
            continue
        found = _usable(backend, name, damaged)
        if found is None:
            continue
        if pointer is None or not _committed_before(found, pointer):
            return found
    if pointer is None and damaged:
        raise damaged[0]
    return pointer


# -- claims: one saver per checkpoint directory ----------------------------------------------


def _host_id() -> str:
    """This machine (and PID namespace): two processes with equal ids can see each other's PIDs."""
    parts = [socket.gethostname()]
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        parts.append(f.read().strip())
    with contextlib.suppress(OSError):
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    return hashlib.sha256("/".join(parts).encode()).hexdigest()[:16]


_HOST_ID = _host_id()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class ClaimInfo:
    """What a claim file says: who saves the directory, since when, last renewed when."""

    token: str
    host: str
    host_id: str
    pid: int
    thread: str
    started_at: float
    renewed_at: float
    lease_s: float

    @classmethod
    def parse(cls, data: bytes) -> ClaimInfo | None:
        try:
            raw = json.loads(data)
            return cls(token=str(raw["token"]), host=str(raw["host"]),
                       host_id=str(raw["host_id"]), pid=int(raw["pid"]),
                       thread=str(raw["thread"]), started_at=float(raw["started_at"]),
                       renewed_at=float(raw["renewed_at"]), lease_s=float(raw["lease_s"]))
        except (ValueError, TypeError, KeyError, UnicodeDecodeError):
            return None

    def to_json(self) -> bytes:
        return json.dumps(self.__dict__, sort_keys=True).encode()

    def describe(self) -> str:
        return f"process {self.pid} on {self.host}"


def claim_file(number: int) -> str:
    return f"{CLAIM_PREFIX}{number:05d}"


def claim_number(entry: str) -> int | None:
    match = _CLAIM_NAME.match(entry)
    return int(match.group(1)) if match else None


def claim_state(info: ClaimInfo | None, now: float | None = None) -> tuple[bool, str]:
    """(live, why): whether the save holding a claim may still be running, and why.

    Live: a save in another thread of this process; a running process on this machine that
    renewed it within its lease; on another machine, a renewal within the lease.
    """
    if info is None:
        return False, "an unreadable claim"
    now = time.time() if now is None else now
    quiet = now - info.renewed_at
    if info.host_id == _HOST_ID:
        if info.pid == os.getpid():
            claim = _ACTIVE.get(info.token)
            if claim is not None and claim.owner is not threading.current_thread() \
                    and claim.owner.is_alive():
                return True, f"a save in thread {claim.owner.name!r} of this process"
            return False, "an earlier save of this process that ended"
        if not _pid_alive(info.pid):
            return False, f"process {info.pid} on this machine, which has exited"
    if quiet > info.lease_s:
        return False, f"{info.describe()}, silent for {quiet:.0f} s (lease {info.lease_s:.0f} s)"
    return True, f"{info.describe()}, renewed {max(quiet, 0):.0f} s ago"


def read_claims(backend: StorageBackend, name: str) -> list[int]:
    """The claim numbers in directory `name`, ascending."""
    return sorted(n for n in map(claim_number, backend.list_dir(name)) if n is not None)


def read_claim(backend: StorageBackend, name: str, number: int) -> ClaimInfo | None:
    try:
        return ClaimInfo.parse(backend.read_bytes(f"{name}/{claim_file(number)}"))
    except FileNotFoundError:
        return None


@dataclass(eq=False)
class Claim:
    """This process's claim on one checkpoint directory, renewed until released."""

    backend: StorageBackend
    name: str
    number: int
    info: ClaimInfo
    owner: threading.Thread = field(default_factory=threading.current_thread)
    _stop: threading.Event = field(default_factory=threading.Event)
    _renewer: threading.Thread | None = None

    @property
    def path(self) -> str:
        return f"{self.name}/{claim_file(self.number)}"

    @property
    def active(self) -> bool:
        return _ACTIVE.get(self.info.token) is self

    def start(self) -> None:
        _ACTIVE[self.info.token] = self
        scope = getattr(_SCOPES, "stack", None)
        if scope:
            scope[-1].append(self)
        self._renewer = threading.Thread(target=self._renew, daemon=True,
                                         name=f"statereg-claim-{self.name}")
        self._renewer.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.info.lease_s / 4):
            renewed = ClaimInfo(**{**self.info.__dict__, "renewed_at": time.time()})
            try:
                self.backend.write_bytes(self.path, renewed.to_json())
            except Exception as exc:  # the save itself will report a storage failure
                logger.debug("renewing %s failed: %s", self.backend.display(self.path), exc)

    def _stop_renewing(self) -> None:
        _ACTIVE.pop(self.info.token, None)
        self._stop.set()
        if self._renewer is not None and self._renewer is not threading.current_thread():
            self._renewer.join(timeout=30)

    def check_owner(self) -> None:
        """Raise if another saver took the directory over (this one looked dead to it)."""
        numbers = read_claims(self.backend, self.name)
        if numbers and numbers[-1] == self.number:
            return
        self._stop_renewing()
        holder = read_claim(self.backend, self.name, numbers[-1]) if numbers else None
        by = f" by {holder.describe()}" if holder is not None else ""
        raise CheckpointInProgressError(
            f"{self.backend.display(self.name)} was taken over{by} while this save was writing "
            f"it (this save's claim lapsed, or `statereg gc` removed it); nothing was committed "
            "by this save: save again, or a different step"
        )

    def release(self) -> None:
        """Stop renewing and delete the claim file (best effort: a stale claim is harmless)."""
        if not self.active and self._stop.is_set():
            return
        self._stop_renewing()
        try:
            self.backend.remove_file(self.path)
        except (FileNotFoundError, StorageError) as exc:
            logger.debug("could not remove %s: %s", self.backend.display(self.path), exc)


_ACTIVE: dict[str, Claim] = {}  # token -> claim, for claims of this process
_SCOPES = threading.local()


@contextlib.contextmanager
def claim_scope() -> Iterator[None]:
    """Release, on leaving, every claim taken inside and not committed (a failed save)."""
    stack = getattr(_SCOPES, "stack", None)
    if stack is None:
        stack = _SCOPES.stack = []
    stack.append([])
    try:
        yield
    finally:
        for claim in stack.pop():
            claim.release()


@atexit.register
def _release_all() -> None:
    for claim in list(_ACTIVE.values()):
        with contextlib.suppress(Exception):
            claim.release()


def _active_claim(backend: StorageBackend, name: str) -> Claim | None:
    """The claim this thread took on `name` (a save claims and commits on one thread)."""
    for claim in list(_ACTIVE.values()):
        if claim.name == name and claim.owner is threading.current_thread() \
                and type(claim.backend) is type(backend) and claim.backend.root == backend.root:
            return claim
    return None


def refuse_committed(backend: StorageBackend, name: str) -> None:
    """CheckpointExistsError if `name` has a manifest (statereg never overwrites one)."""
    try:
        read_manifest_at(backend, name, check=False)
    except CheckpointNotFoundError:
        return
    except ManifestError as exc:
        raise CheckpointExistsError(
            f"{backend.display(name)} has a {MANIFEST_NAME} that does not parse ({exc}); "
            "statereg never overwrites a manifest: inspect it, or save a different step"
        ) from None
    raise CheckpointExistsError(
        f"{backend.display(name)} is already a committed checkpoint; save a different step, "
        "or delete it first (statereg never overwrites a committed checkpoint)"
    )


def refuse_referenced(backend: StorageBackend, name: str) -> None:
    """CheckpointExistsError if committed (incremental) checkpoints read files under `name`:
    retention keeps those in the directory of a deleted checkpoint."""
    needed = referenced_files(list_committed(backend))
    held = sorted(path for path in needed if path.startswith(f"{name}/"))
    if held:
        raise CheckpointExistsError(
            f"{backend.display(name)} holds {len(held)} file(s) that committed incremental "
            f"checkpoints reference (e.g. {held[0]}); statereg does not remove them while "
            "those checkpoints exist: save a different step"
        )


def claim_checkpoint(backend: StorageBackend, name: str, purpose: str = "save") -> Claim:
    """Claim directory `name` for one save; clear leftovers of an interrupted save of it.

    Refuses a committed step (CheckpointExistsError) and a step another live save holds
    (CheckpointInProgressError). A stale claim is taken over by creating the next number.
    """
    for _ in range(_CLAIM_ATTEMPTS):
        refuse_committed(backend, name)
        numbers = read_claims(backend, name)
        number, why = 0, ""
        if numbers:
            holder = read_claim(backend, name, numbers[-1])
            live, why = claim_state(holder)
            if live:
                raise CheckpointInProgressError(
                    f"{backend.display(name)} is being saved by {why}; two saves of one step "
                    "cannot both commit. Save a different step, or wait for that save; a claim "
                    f"whose process is gone lapses {CLAIM_LEASE_S:.0f} s after its last renewal"
                )
            number = numbers[-1] + 1
        now = time.time()
        info = ClaimInfo(token=uuid.uuid4().hex, host=socket.gethostname(), host_id=_HOST_ID,
                         pid=os.getpid(), thread=threading.current_thread().name,
                         started_at=now, renewed_at=now, lease_s=CLAIM_LEASE_S)
        claim = Claim(backend, name, number, info)
        try:
            backend.create_bytes(claim.path, info.to_json())
        except FileExistsError:
            continue  # another saver took this number first: look again
        try:
            refuse_committed(backend, name)  # committed between the first check and the claim
            # Not another saver's claim being created (`.claim-N.tmp-…`, local disk): its
            # link fails or wins on its own, and it removes its temporary file itself.
            leftovers = [e for e in backend.list_dir(name)
                         if e != claim_file(number) and not _CLAIM_TEMPORARY.match(e)]
            if leftovers:
                refuse_referenced(backend, name)
            if leftovers and purpose != "gc":
                logger.warning("removing leftovers of an interrupted %s in %s%s", purpose,
                               backend.display(name), f" (claimed by {why})" if why else "")
                for entry in leftovers:
                    backend.remove_tree(f"{name}/{entry}")
        except BaseException:
            claim._stop.set()
            with contextlib.suppress(Exception):
                backend.remove_file(claim.path)
            raise
        claim.start()
        return claim
    raise CheckpointInProgressError(
        f"{backend.display(name)}: other saves kept claiming this step; save a different step"
    )


# -- committing --------------------------------------------------------------------------------


def commit(backend: StorageBackend, name: str, manifest: Manifest,
           move_latest: bool = True) -> None:
    """Publish a fully written checkpoint: manifest.sum, then the manifest (both created
    exclusively; the manifest commits it), then the `latest` pointer; release the claim."""
    claim = _active_claim(backend, name)
    if claim is not None:
        claim.check_owner()
    data = manifest.to_json()
    try:
        # Both created exclusively: a save that lost a race never overwrites the winner's.
        for path, content in ((f"{name}/{MANIFEST_SUM_NAME}",
                               f"{manifest_checksum(data)}\n".encode()),
                              (f"{name}/{MANIFEST_NAME}", data)):
            try:
                backend.create_bytes(path, content)
            except FileExistsError:
                raise CheckpointExistsError(
                    f"{backend.display(name)} was committed by another save first (or is being "
                    "committed by one); this save's files were not used. Two saves of one step "
                    "cannot both commit: give each run its own root or step"
                ) from None
        if move_latest:
            backend.write_bytes(LATEST_NAME, name.encode())
    finally:
        if claim is not None:
            claim.release()


# -- retention ---------------------------------------------------------------------------------


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

