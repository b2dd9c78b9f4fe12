"""shm://: checkpoints in host shared memory (tmpfs), which outlives the trainer process.

A file on /dev/shm survives a crashed or killed process and is gone when the node reboots,
so a memory checkpoint costs one memory copy to write and to read, and never touches a disk
or the network. Everything else is local disk: the same durable-write and containment rules
(`LocalBackend`), so the commit protocol (manifest last, checksums, exclusive create) is the
same as on any root.

`shm://NAME` is the folder `<shm>/statereg/<node>/NAME`, where `<shm>` is /dev/shm, or
$STATEREG_SHM_DIR (tests point it at a temporary folder), and `<node>` names this host:
$STATEREG_NODE, else the host name. Several simulated nodes on one machine thus get one
memory folder each, as real hosts do.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import json
import logging
import os
import re
import shutil
import socket
import stat
import time
import weakref
from typing import Any

from statereg.backends.local import LocalBackend
from statereg.errors import SpecError, StorageError

logger = logging.getLogger("statereg")

SHM_DIR_ENV = "STATEREG_SHM_DIR"
NODE_ENV = "STATEREG_NODE"
DEFAULT_SHM_DIR = "/dev/shm"
_SAFE = re.compile(r"[^A-Za-z0-9_.\-]")
# The folder under a root where a checkpoint retired by retention waits to have its files'
# pages written over by the next save (`SharedMemoryBackend.recycle`). Not a step name: no
# listing of checkpoints sees it.
RECYCLED = ".recycled"
# Open an existing file for writing from its start without freeing its pages (no O_TRUNC).
_OVERWRITE = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC
# The file a live job holds a lock on, in its memory root (`SharedMemoryBackend.hold`).
LOCK_NAME = "job.lock"


# Memory roots held by this process (`SharedMemoryBackend.hold`): record locks do not
# conflict within a process, so a second open manager on one root is refused by this.
_HOLDERS: dict[str, weakref.ref[SharedMemoryBackend]] = {}


def _holder(root: str) -> SharedMemoryBackend | None:
    ref = _HOLDERS.get(root)
    backend = ref() if ref is not None else None
    return backend if backend is not None and backend._held is not None else None


def shm_dir() -> str:
    """The shared-memory folder: $STATEREG_SHM_DIR, else /dev/shm."""
    return os.environ.get(SHM_DIR_ENV) or DEFAULT_SHM_DIR


def node_name() -> str:
    """This node's name: $STATEREG_NODE (a simulated node), else the host name."""
    return _SAFE.sub("_", os.environ.get(NODE_ENV) or socket.gethostname()) or "node"


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still allocate on the filesystem holding `path`."""
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def used_bytes(path: str) -> int:
    """Bytes held by the regular files under `path` (0 if it does not exist)."""
    total = 0
    for folder, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except FileNotFoundError:
                continue
    return total


class SharedMemoryBackend(LocalBackend):
    """Checkpoints in this node's shared memory (`shm://NAME`)."""

    schemes = ("shm",)
    # Every rank of a node reads the tmpfs at memory speed: a broadcast over gloo's TCP
    # would be the slow path (bench_replica.py: a restore took 1.5x longer with it).
    broadcast_reads = False
    # Whether a retired checkpoint's pages are written over by the next save instead of
    # being freed and allocated again (the tier engine turns it on; see `remove_tree`).
    recycle = False
    _held: weakref.finalize | None = None  # closes LOCK_NAME's descriptor: see `hold`

    def _open_filesystem(self, url: str, options: dict[str, Any]) -> tuple[Any, str]:
        name = url[len("shm://"):].strip("/")
        if not name or any(part in ("", ".", "..") for part in name.split("/")):
            raise SpecError(f"shared-memory url {url!r}: write shm://NAME, e.g. shm://run7; "
                            "NAME may not be empty nor hold '.' or '..' parts")
        base = shm_dir()
        if not os.path.isdir(base):
            raise StorageError(f"{url}: the shared-memory folder {base} does not exist; "
                               f"mount a tmpfs there or point ${SHM_DIR_ENV} at one")
        fs, _ = super()._open_filesystem("/", {})
        return fs, os.path.join(base, "statereg", node_name(), name)

    def check_room(self, needed: int, what: str) -> None:
        """Refuse, with the numbers, when the shared-memory filesystem cannot hold `needed`
        bytes (counting what this root already holds, which its retention reuses)."""
        os.makedirs(self.root, exist_ok=True)
        lock = self.full_path(LOCK_NAME)
        held = used_bytes(self.root) - (os.lstat(lock).st_size if os.path.exists(lock) else 0)
        free = free_bytes(self.root)
        if needed > free + held:
            others, stale = self._other_jobs(), ""
            if others:
                stale = (f"; other jobs' memory checkpoints on this node hold "
                         f"{sum(others.values()):,} bytes (memory outlives a job by design; "
                         "delete the folders of finished jobs to free it: "
                         f"{', '.join(f'{p} {n:,}' for p, n in others.items())})")
            raise StorageError(
                f"{self.url} ({self.root}) is too small for {what}: it needs {needed:,} bytes, "
                f"and {free:,} bytes are free plus {held:,} held by this job's memory "
                f"checkpoints{stale}. Lower tiers.memory.keep_last, enlarge the tmpfs (e.g. "
                f"`mount -o remount,size=... {shm_dir()}`), or point ${SHM_DIR_ENV} at a "
                "larger one"
            )

    def _other_jobs(self, most: int = 5) -> dict[str, int]:
        """The biggest job folders (`<run>/<identity>`) on this node other than this root,
        with the bytes they hold: what a finished job left in memory."""
        node = os.path.join(shm_dir(), "statereg", node_name())
        sizes: dict[str, int] = {}
        for run in os.listdir(node) if os.path.isdir(node) else []:
            runs = os.path.join(node, run)
            for job in os.listdir(runs) if os.path.isdir(runs) else []:
                folder = os.path.join(runs, job)
                if folder != self.root and not self.root.startswith(folder + os.sep):
                    sizes[folder] = used_bytes(folder)
        biggest = sorted(sizes.items(), key=lambda item: item[1], reverse=True)[:most]
        return {folder: size for folder, size in biggest if size}

    # -- one live job per memory root --------------------------------------------------

    def hold(self) -> None:
        """Hold this root for this process until `release()` or its exit, or refuse with the
        holder when another live process holds it.

        Two jobs saving into one memory root would each take the other's checkpoints for an
        abandoned run's and replace them (a save of step s removes what this folder holds
        from step s on), so the second one is refused at construction. A POSIX record lock
        (fcntl) is dropped by the kernel when its process ends, however it ends (SIGKILL
        included), so a restarted trainer is never locked out by its dead predecessor, and
        it is not inherited by forked DataLoader workers that may outlive it for a moment.
        Record locks do not conflict within one process, so the process also keeps a list
        of the roots it holds (`_HOLDERS`): a second open manager in the same process (two
        managers built from one declaration, a notebook cell run again while its first
        manager is still open) is refused too, until the first is closed or collected.
        """
        os.makedirs(self.root, exist_ok=True)
        if _holder(self.root) is not None:
            gc.collect()  # a manager dropped without close() may wait in a reference cycle
        if _holder(self.root) is not None:
            raise StorageError(
                f"{self.url} ({self.root}) is held by another open CheckpointManager in this "
                "process: close() it first (or `with CheckpointManager(...)`)")
        fd = os.open(self.full_path(LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if exc.errno not in (errno.EACCES, errno.EAGAIN):
                # A folder on a filesystem without record locks (ENOLCK): the tier works,
                # only a second job would go unnoticed.
                logger.warning("memory tier: cannot lock %s (%s); a second job saving into "
                               "this folder would not be detected", self.full_path(LOCK_NAME),
                               exc)
                return
            raise StorageError(
                f"{self.url} ({self.root}) is in use by another live job on this node "
                f"({holder}): two jobs saving into one memory tier would delete and replace "
                "each other's checkpoints. Stop that job, or give this one its own "
                "storage.url (and $STATEREG_RUN_ID, if set)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode(), 0)
        # A manager dropped without close() lets go of the root when it is collected.
        self._held = weakref.finalize(self, os.close, fd)
        _HOLDERS[self.root] = weakref.ref(self)

    def release(self) -> None:
        """Let another job use this root (closing the file drops the lock)."""
        if self._held is not None:
            self._held()
            self._held = None

    # -- reusing the pages of retired checkpoints ----------------------------------------

    def remove_tree(self, path: str) -> None:
        """Delete `path`; with `recycle`, a checkpoint directory at the top of the root is
        instead moved whole (one rename: it vanishes at once) to `.recycled/`, replacing what
        an earlier retirement left there, and the next save writes its files over those.

        Why: a fresh tmpfs file costs a page allocation and zeroing for every 4 KiB, and
        deleting one costs freeing them: writing 0.5 GB into new files ran at 2.5 GB/s here,
        over the pages of an existing file at 6.9 GB/s, and the unlink took 0.08 s. A file
        is taken from `.recycled/` only by a save writing the same path below its step, and
        the folder never holds more than one retired checkpoint, so the memory a tier holds
        stays within the keep_last + 1 checkpoints it is checked for at construction.
        """
        full = self.full_path(path)
        if not self.recycle or not path or "/" in path or path == RECYCLED:
            super().remove_tree(path)
            return
        self._refuse_links("delete", path)
        with self._storage_op("delete", path):
            try:
                if not stat.S_ISDIR(os.lstat(full).st_mode):
                    os.unlink(full)
                    return
            except FileNotFoundError:
                return
            self.drop_recycled()
            os.makedirs(self.full_path(RECYCLED))
            os.rename(full, self.full_path(f"{RECYCLED}/{path}"))

    def drop_recycled(self) -> None:
        """Free the pages of the retired checkpoint waiting in `.recycled/`, if any."""
        shutil.rmtree(self.full_path(RECYCLED), ignore_errors=True)

    def _open_for_write(self, path: str, full: str) -> int:
        """With `recycle`, a file of the retired checkpoint at the same path below its step
        is renamed to `full` and written over from its start (its old bytes past the new
        end are cut off when the file is closed); otherwise a new file."""
        if self.recycle:
            _, _, below = path.partition("/")
            retired = self.full_path(RECYCLED)
            try:
                names = os.listdir(retired) if below else []
            except FileNotFoundError:
                names = []
            for name in names:
                spare = f"{retired}/{name}/{below}"
                try:
                    if not stat.S_ISREG(os.lstat(spare).st_mode):
                        continue
                    os.rename(spare, full)
                except (FileNotFoundError, NotADirectoryError):
                    continue
                return os.open(full, _OVERWRITE)
        return super()._open_for_write(path, full)
