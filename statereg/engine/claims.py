"""Claims: one saver per checkpoint directory, with a renewed lease.

Concurrent savers: before the first file, the saver claims the directory by creating
`.claim-NNNNN` exclusively (a conditional write on object stores, link(2) on local disk).
The claim names its process and is renewed while the save runs; another saver of the same
step is refused while the claim is live, and takes a stale one over by creating the next
number, which only one can do. The claim is handed to publish.commit(), which checks it is
still this saver's and releases it; claim_scope() releases the claims of a failed save.
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
from dataclasses import dataclass, field, replace
from typing import Any

from statereg import env
from statereg.backends.base import StorageBackend
from statereg.engine.checkpoints import (
    MANIFEST_SUM_NAME,
    RETIRED_NAME,
    Committed,
    Listings,
    RootScan,
    file_damage,
    read_manifest_at,
    refused,
    scan_root,
    skip_entry,
    step_of,
)
from statereg.engine.verify import verify_files
from statereg.errors import (
    CheckpointExistsError,
    CheckpointInProgressError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ManifestError,
    StateregError,
    StorageError,
)
from statereg.process_state import process_wide
from statereg.schemas.manifest import MANIFEST_NAME, WRITER_DIR_PREFIX

logger = logging.getLogger(__name__)

CLAIM_PREFIX = ".claim-"
_CLAIM_NAME = re.compile(r"^\.claim-(\d{5,})$")
_CLAIM_TEMPORARY = re.compile(r"^\.claim-\d{5,}\.tmp-")
# A claim nobody renewed for this long is stale (its saver died on another host).
# $STATEREG_CLAIM_LEASE_S sets it (read as each claim is taken).
CLAIM_LEASE_S = 120.0
_CLAIM_ATTEMPTS = 5


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
    # An incremental save: the committed checkpoint whose files (its own and those it
    # references) it may reference. Retention keeps them while this claim is live.
    reuses: str = ""

    @classmethod
    def parse(cls, data: bytes) -> ClaimInfo | None:
        try:
            raw = json.loads(data.decode("utf-8"))  # ours are UTF-8 (RFC 8259)
            return cls(token=str(raw["token"]), host=str(raw["host"]),
                       host_id=str(raw["host_id"]), pid=int(raw["pid"]),
                       thread=str(raw["thread"]), started_at=float(raw["started_at"]),
                       renewed_at=float(raw["renewed_at"]), lease_s=float(raw["lease_s"]),
                       reuses=str(raw.get("reuses", "")))
        except (ValueError, TypeError, KeyError, UnicodeDecodeError):
            return None

    def to_json(self) -> bytes:
        return json.dumps(self.__dict__, sort_keys=True).encode()

    def describe(self) -> str:
        return f"process {self.pid} on {self.host}"


def lost_race(backend: StorageBackend, name: str, how: str) -> CheckpointExistsError:
    """The error of a saver that lost a race for step directory `name` with another writer
    on a store that does not enforce conditional creates (`how`: what it found)."""
    return CheckpointExistsError(
        f"{backend.display(name)}: this save lost a race with another writer saving the same "
        f"step ({how}); the store at {backend.display()} does not enforce conditional "
        "creates, so both could start. Nothing was committed by this save, and the checkpoint "
        "that stands, if any, is the other writer's, whole. Give each job its own root or "
        "steps, or use a store that honours conditional writes (storage.options."
        "require_exclusive: true refuses one that does not; see docs/storage.md)"
    )


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
    """The claim's record, or None where it is gone or unreadable (not a regular file)."""
    try:
        return ClaimInfo.parse(backend.read_bytes(f"{name}/{claim_file(number)}"))
    except (FileNotFoundError, CorruptCheckpointError):
        return None


@dataclass(eq=False)
class Claim:
    """This process's claim on one checkpoint directory, renewed until released."""

    backend: StorageBackend
    name: str
    number: int
    info: ClaimInfo
    # Whether the store enforces exclusive creates. Where it does not, another saver's
    # claim can land on this one's name: renewals and the release read the claim first and
    # leave another saver's alone.
    exclusive: bool = True
    owner: threading.Thread = field(default_factory=threading.current_thread)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
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
            try:
                self._rewrite()
            except CheckpointExistsError:
                self._stop.set()  # another saver's claim stands: commit() reports it
            except Exception as exc:  # the save itself will report a storage failure
                logger.debug("renewing %s failed: %s", self.backend.display(self.path), exc)

    def _mine(self) -> bool:
        """Whether the claim stored under this claim's name is this one (token and all)."""
        current = read_claim(self.backend, self.name, self.number)
        return current is not None and current.token == self.info.token

    def _rewrite(self, **changes: Any) -> None:
        # Under the lock: a renewal must never write back an info older than hold()'s.
        with self._lock:
            if not self.exclusive and not self._mine():
                raise lost_race(self.backend, self.name,
                                f"its claim {claim_file(self.number)} replaced this one's")
            info = replace(self.info, renewed_at=time.time(), **changes)
            self.backend.write_bytes(self.path, info.to_json())
            self.info = info

    def freeze(self) -> None:
        """Stop renewing (the claim stays this save's until released): a commit on a store
        without exclusive creates must not write its claim over a later saver's."""
        self._stop.set()
        if self._renewer is not None and self._renewer is not threading.current_thread():
            self._renewer.join(timeout=30)

    def hold(self, name: str) -> None:
        """Record in the claim that this save may reference files of checkpoint `name`
        (empty: none). Retention reads it after uncommitting what it deletes and keeps
        those files while the claim is live."""
        self._rewrite(reuses=name)

    def _stop_renewing(self) -> None:
        _ACTIVE.pop(self.info.token, None)
        self._stop.set()
        if self._renewer is not None and self._renewer is not threading.current_thread():
            self._renewer.join(timeout=30)

    def check_owner(self) -> None:
        """Raise if another saver took the directory over (this one looked dead to it), or
        wrote over this claim (a store that ignores conditional creates): the newest claim
        must be this one, token and all."""
        numbers = read_claims(self.backend, self.name)
        holder = read_claim(self.backend, self.name, numbers[-1]) if numbers else None
        if numbers and numbers[-1] == self.number and holder is not None \
                and holder.token == self.info.token:
            return
        self._stop_renewing()
        if not self.exclusive and (not numbers or numbers[-1] == self.number):
            # Written over or deleted by a saver that created the same name: a race the
            # store let through, not a lapsed lease.
            raise lost_race(self.backend, self.name,
                            f"its claim {claim_file(self.number)} replaced this one's"
                            if numbers else "this save's claim was removed by it")
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
            if not self.exclusive and not self._mine():
                return  # another saver's claim landed on this name: it is that saver's
            self.backend.remove_file(self.path)
        except (FileNotFoundError, StorageError) as exc:
            logger.debug("could not remove %s: %s", self.backend.display(self.path), exc)


_ACTIVE: dict[str, Claim] = {}  # token -> claim, for claims of this process
_SCOPES = threading.local()
process_wide(__name__, "_ACTIVE", "the claims this process holds, whoever took them: two savers "
             "see each other's as live, and atexit releases them (docs/design.md)", kept=True)
process_wide(__name__, "_SCOPES", "each thread's open claim scopes, released on leaving",
             kept=True)


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


def refuse_committed(backend: StorageBackend, name: str, retire: bool = False) -> None:
    """CheckpointExistsError if `name` has a manifest (statereg never overwrites an intact
    checkpoint).

    `retire` (a save of that step): a committed checkpoint that re-verifies as damaged is
    retired instead (`retire_damaged`), so a damaged checkpoint never blocks the step it
    occupies: a resume skips it, and the run's next save of that step replaces it. The
    re-verification reads every byte of it (docs/reliability.md, "A run always comes back").
    """
    try:
        manifest = read_manifest_at(backend, name, check=retire)
    except CheckpointNotFoundError:
        return
    except ManifestError as exc:
        raise CheckpointExistsError(
            f"{backend.display(name)} has a {MANIFEST_NAME} that does not parse ({exc}); "
            "statereg never overwrites a manifest: inspect it, or save a different step"
        ) from None
    except CorruptCheckpointError as exc:
        if not retire:
            raise
        damage: CorruptCheckpointError = exc
        writer = None
    else:
        if not retire:
            raise CheckpointExistsError(
                f"{backend.display(name)} is already a committed checkpoint; save a different "
                "step, or delete it first (statereg never overwrites a committed checkpoint)"
            )
        found = recheck(backend, Committed(name, manifest))
        if found is None:
            raise CheckpointExistsError(
                f"{backend.display(name)} is already a committed checkpoint, and intact (every "
                "file re-verified against its manifest); save a different step, or delete it "
                "first (statereg never overwrites an intact committed checkpoint)"
            )
        damage, writer = found, manifest.data_dir(name) if manifest.writer else None
    retire_damaged(backend, name, damage, writer)


def recheck(backend: StorageBackend, ckpt: Committed) -> CorruptCheckpointError | None:
    """Why committed checkpoint `ckpt` cannot load, re-verified: a file it records (its own
    or one it references) missing, resized, or with another checksum; None if it is intact.
    Reads every byte of it, in bounded blocks."""
    damage = file_damage(backend, ckpt, Listings(backend))
    if damage is not None:
        return damage
    try:
        verify_files(backend, "", list(ckpt.manifest.root_files(ckpt.name)), "full")
    except CorruptCheckpointError as exc:
        return exc
    return None


def retire_damaged(backend: StorageBackend, name: str, damage: StateregError,
                   writer: str | None = None) -> None:
    """Uncommit damaged checkpoint `name` so a save of its step can replace it: mark it
    retired (as retention marks what it deletes), then delete its manifest and the writer
    directory its manifest named; the save's claim then removes the rest as leftovers, and
    gc or the next retention finishes an interrupted one. Refused (CheckpointExistsError)
    while another checkpoint needs its files (`blocking_readers`): deleting them would
    damage that one too."""
    shown = backend.display(name)
    readers = blocking_readers(backend, name)
    if readers:
        reader, why = readers[0]
        raise CheckpointExistsError(
            f"{shown} is damaged ({damage}), but {backend.display(reader)} needs its files "
            f"({why}), so this save cannot replace it: save a different step, or delete "
            f"{', '.join(r for r, _ in readers)} and {name} by hand"
        )
    logger.warning("%s is damaged (%s); this save of its step retires it: its manifest and "
                   "files are deleted and the new checkpoint takes its place", shown, damage)
    backend.write_bytes(f"{name}/{RETIRED_NAME}", b"")
    for path in (f"{name}/{MANIFEST_NAME}", f"{name}/{MANIFEST_SUM_NAME}"):
        try:
            backend.remove_file(path)
        except (FileNotFoundError, StorageError):
            if backend.exists(path):  # another saver of this step removed it first: fine
                raise
    if writer is not None:
        backend.remove_tree(writer)


def blocking_readers(backend: StorageBackend, name: str,
                     scan: RootScan | None = None) -> list[tuple[str, str]]:
    """The checkpoints whose files under directory `name` must stay, each with why: a
    committed (incremental) checkpoint that references files there, unless those files
    already fail its own records (missing, resized or another checksum: the damage is done,
    and it loads never); and a manifest of the same or a higher step that matches its sum but
    does not parse (a newer statereg's?), which may reference them. A damaged manifest
    (another sum) references nothing that could load; a save of its step retires it."""
    scan = scan_root(backend) if scan is None else scan
    step = step_of(name) or 0
    found = [(u, f"its manifest cannot be read ({exc})")
             for u, exc in sorted(scan.unreadable.items(), key=lambda item: step_of(item[0]) or 0)
             if u != name and (step_of(u) or 0) >= step
             and not isinstance(exc, CorruptCheckpointError)]
    for ckpt in scan.committed:
        refs = [r for r in ckpt.manifest.references if r.path.startswith(f"{name}/")]
        if ckpt.name == name or not refs:
            continue
        try:
            verify_files(backend, "", refs, "full")
        except CorruptCheckpointError:
            continue  # broken by this very damage already: keeping the files saves nothing
        found.append((ckpt.name, f"it references {len(refs)} file(s) there (e.g. "
                                 f"{refs[0].path})"))
    return found


def refuse_referenced(backend: StorageBackend, name: str) -> None:
    """CheckpointExistsError if other checkpoints need files under `name` (`blocking_readers`):
    retention keeps those in the directory of a deleted checkpoint."""
    readers = blocking_readers(backend, name)
    if readers:
        reader, why = readers[0]
        raise CheckpointExistsError(
            f"{backend.display(name)} holds files that {backend.display(reader)} needs ({why}); "
            "statereg does not remove them while it exists: save a different step, or delete "
            f"{reader} first"
        )


def reserved_checkpoints(backend: StorageBackend, names: Iterable[str]) -> set[str]:
    """The checkpoints that live claims in directories `names` say their saves may reference."""
    held = set()
    for name in names:
        try:
            numbers = read_claims(backend, name)
        except StorageError as exc:  # another user's folder: no claim of this run's
            if not refused(exc):
                raise
            skip_entry(backend, name, exc)
            continue
        info = read_claim(backend, name, numbers[-1]) if numbers else None
        if info is not None and info.reuses and claim_state(info)[0]:
            held.add(info.reuses)
    return held


def uncommitted_names(backend: StorageBackend, committed: Iterable[str]) -> list[str]:
    """Checkpoint directories under the root that are not in `committed` (saves in progress,
    interrupted ones, damaged ones)."""
    known = set(committed)
    return [n for n in backend.list_dir("") if step_of(n) is not None and n not in known]


# At most this many claim names in a row may be taken by entries the listing does not show
# (links, FIFOs, sockets on local disk) before a save gives up and names them.
_HIDDEN_CLAIMS = 16


def _hidden_entry(backend: StorageBackend, name: str, number: int) -> str | None:
    """What occupies claim `number` of `name` although the listing does not show it (a link
    or a special file: list_dir leaves those out), e.g. "symlink"; None if nothing does, or a
    claim the listing shows (another saver's, created since)."""
    if number in read_claims(backend, name):
        return None
    path = f"{name}/{claim_file(number)}"
    try:
        found = backend.walk(path)
    except (FileNotFoundError, StateregError):
        return None
    kinds = [f.kind for f in found if f.path == path]
    return kinds[0] if kinds and kinds[0] not in ("file", "directory") else None


def _remove_hidden(backend: StorageBackend, name: str, numbers: list[int]) -> None:
    """Delete the hostile entries at claim `numbers`, once this saver's claim (a higher number)
    is the newest. A saver that creates a real claim at one of these numbers afterwards finds
    this newer claim above it and gives its own up (`claim_checkpoint`). A link is deleted
    itself, never what it points to."""
    for number in numbers:
        path = f"{name}/{claim_file(number)}"
        try:
            backend.remove_file(path)
        except FileNotFoundError:
            continue
        except StorageError as exc:
            logger.warning("could not delete %s, which is not a claim statereg wrote (%s); "
                           "delete it by hand", backend.display(path), exc)
            continue
        logger.warning("deleted %s: it was not a claim statereg writes (a link or a special "
                       "file), and it blocked saves of this step", backend.display(path))


class _Superseded(Exception):
    """A claim was created below another saver's newer one: it must be given up."""


def claim_checkpoint(backend: StorageBackend, name: str, purpose: str = "save") -> Claim:
    """Claim directory `name` for one save; clear leftovers of an interrupted save of it.

    Refuses a committed step (CheckpointExistsError) and a step another live save holds
    (CheckpointInProgressError). A stale claim is taken over by creating the next number.

    A claim that is no claim statereg writes is never a live one: garbage or a directory is
    an unreadable claim (taken over, then removed with the other leftovers); a link or a
    special file, which the listing does not show, is skipped (the next number is created)
    and deleted itself once this saver holds the directory. Too many of them in a row is a
    StorageError naming them.
    """
    lease_s = env.claim_lease_s(CLAIM_LEASE_S)
    hidden: list[int] = []
    attempts = 0
    while attempts < _CLAIM_ATTEMPTS:
        refuse_committed(backend, name, retire=purpose == "save")
        numbers = read_claims(backend, name)
        number, why = 0, ""
        if numbers:
            holder = read_claim(backend, name, numbers[-1])
            live, why = claim_state(holder)
            if live:
                raise CheckpointInProgressError(
                    f"{backend.display(name)} is being saved by {why}; two saves of one step "
                    "cannot both commit. Save a different step, or wait for that save; a claim "
                    f"whose process is gone lapses {lease_s:.0f} s after its last renewal"
                )
            number = numbers[-1] + 1
        if hidden and hidden[-1] >= number:
            number = hidden[-1] + 1
        now = time.time()
        info = ClaimInfo(token=uuid.uuid4().hex, host=socket.gethostname(), host_id=_HOST_ID,
                         pid=os.getpid(), thread=threading.current_thread().name,
                         started_at=now, renewed_at=now, lease_s=lease_s)
        claim = Claim(backend, name, number, info)
        # Registered before the claim file exists: another thread of this process that
        # lists it meanwhile must see a live save, not "an earlier save of this process
        # that ended" (it would take the step over, and both would write it).
        _ACTIVE[info.token] = claim
        try:
            backend.create_bytes(claim.path, info.to_json())
        except FileExistsError:
            _ACTIVE.pop(info.token, None)
            kind = _hidden_entry(backend, name, number)
            if kind is None:
                attempts += 1
                continue  # another saver took this number first: look again
            hidden.append(number)
            if len(hidden) >= _HIDDEN_CLAIMS:
                shown = ", ".join(backend.display(f"{name}/{claim_file(n)}") for n in hidden)
                raise StorageError(
                    f"{backend.display(name)} cannot be claimed: {len(hidden)} claim names in a "
                    f"row are taken by links or special files ({shown}), which are no claims "
                    "statereg writes; delete them (and nothing they point to), then save again"
                ) from None
            continue
        except BaseException:
            _ACTIVE.pop(info.token, None)
            raise
        claim.exclusive = backend.check_exclusive_create() is None
        try:
            # Defence in depth, for a store that ignores conditional creates: a saver whose
            # claim was written over lost the race, and leaves every file alone.
            mine = read_claim(backend, name, number)
            if mine is None or mine.token != info.token:
                raise lost_race(backend, name, f"claimed by {mine.describe()} at the same "
                                f"moment" if mine else "its claim is gone")
            if any(n > number for n in read_claims(backend, name)):
                # The newest claim holds the directory. This number came from a listing made
                # before another saver, which had skipped the same link or special file,
                # claimed the next number and deleted that entry: it is free now, but below
                # a live claim. Give it up and look again (found by the model-based test:
                # both saved the step, the second failing inside DCP).
                raise _Superseded
            refuse_committed(backend, name)  # committed between the first check and the claim
            # Not another saver's claim being created (`.claim-N.tmp-…`, local disk): its
            # link fails or wins on its own, and it removes its temporary file itself. Nor,
            # where creates are not exclusive, another writer's directory: a racing saver
            # may be writing it, and a manifest that stands names only its own writer's.
            leftovers = [e for e in backend.list_dir(name)
                         if e != claim_file(number) and not _CLAIM_TEMPORARY.match(e)
                         and (claim.exclusive or not e.startswith(WRITER_DIR_PREFIX))]
            if leftovers:
                refuse_referenced(backend, name)
            if leftovers and purpose != "gc":
                if RETIRED_NAME in leftovers:  # a retired checkpoint's files: said already
                    logger.info("removing the files of the retired checkpoint in %s",
                                backend.display(name))
                else:
                    logger.warning("removing leftovers of an interrupted %s in %s%s", purpose,
                                   backend.display(name), f" (claimed by {why})" if why else "")
                for entry in leftovers:
                    backend.remove_tree(f"{name}/{entry}")
            if hidden and purpose != "gc":  # gc removes the whole directory itself
                _remove_hidden(backend, name, hidden)
        except BaseException as exc:
            _ACTIVE.pop(info.token, None)
            claim._stop.set()
            with contextlib.suppress(Exception):
                if claim.exclusive or claim._mine():  # never another saver's claim
                    backend.remove_file(claim.path)
            if not isinstance(exc, _Superseded):
                raise
            attempts += 1
            continue
        claim.start()
        return claim
    raise CheckpointInProgressError(
        f"{backend.display(name)}: other saves kept claiming this step; save a different step"
    )
