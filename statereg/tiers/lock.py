"""One live job per memory folder: the lock the tier engine holds on `job.lock` while open.

Two jobs saving into one memory folder would each take the other's checkpoints for an
abandoned run's and replace them (a save of step s removes what the folder holds from step
s on), so the second one is refused at construction, before it writes or deletes anything.

The lock is an open file description lock (`F_OFD_SETLK`, Linux): the kernel drops it when
the last descriptor of it closes, so when its process ends however it ends (SIGKILL
included), and unlike a POSIX record lock (`lockf`) it conflicts between two descriptors of
one process too: a second open manager on the same folder in the same process (two managers
built from one declaration, a notebook cell run again) is refused by the kernel, with no
list of held folders kept in the process. A forked child (a DataLoader worker) closes its
copy of the descriptor at once, so a worker that outlives its trainer for a moment never
locks out the restarted trainer. OFD locks conflict with record locks, so a holder that uses
`lockf` (an older statereg) is seen too.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gc
import json
import logging
import os
import socket
import struct
import time
import weakref
from typing import Any

from statereg.errors import StorageError

logger = logging.getLogger(__name__)

# The file a live job holds a lock on, in its memory folder.
LOCK_NAME = "job.lock"
# F_OFD_SETLK is Linux's (3.15+); elsewhere a record lock, with no in-process refusal.
_OFD_SETLK: int | None = getattr(fcntl, "F_OFD_SETLK", None)


def _flock(kind: int) -> bytes:
    """A `struct flock` over the whole file (l_start 0, l_len 0; l_pid 0 as OFD requires)."""
    return struct.pack("hhxxxxqqixxxx", kind, os.SEEK_SET, 0, 0, 0)


def lockf(fd: int, operation: int) -> None:
    """`fcntl.lockf(fd, LOCK_EX | LOCK_NB)` with an OFD lock where there is one: the
    exclusive lock on the whole file, not waiting (OSError EAGAIN/EACCES if held)."""
    if _OFD_SETLK is None:
        fcntl.lockf(fd, operation)
    else:
        fcntl.fcntl(fd, _OFD_SETLK, _flock(fcntl.F_WRLCK))


def _lock(fd: int) -> None:
    lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


class JobLock:
    """The lock of one open tier engine on its memory folder (`folder/job.lock`).

    `acquire()` refuses, naming the holder, when another live job (or another open manager
    of this process) holds the folder; `release()` (the engine's close) or the collection of
    this object lets go.
    """

    def __init__(self, folder: str, url: str) -> None:
        self.folder = folder
        self.url = url
        self.path = os.path.join(folder, LOCK_NAME)
        self._closer: weakref.finalize | None = None

    @property
    def held(self) -> bool:
        return self._closer is not None and self._closer.alive

    def acquire(self) -> None:
        """Hold the folder for this job until `release()`, or refuse with its holder."""
        os.makedirs(self.folder, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            refusal = self._take(fd)
        except BaseException:
            os.close(fd)
            raise
        if refusal is not None:
            os.close(fd)
            if isinstance(refusal, StorageError):
                raise refusal
            # A folder on a filesystem without record locks (ENOLCK): the tier works, only a
            # second job would go unnoticed.
            logger.warning("memory tier: cannot lock %s (%s); a second job saving into this "
                           "folder would not be detected", self.path, refusal)
            return
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode(), 0)
        self._closer = weakref.finalize(self, os.close, fd)
        # A forked child (a DataLoader worker) must not keep the lock's description alive.
        me = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _drop_in_child(me))

    def _take(self, fd: int) -> Exception | None:
        """Lock `fd`; the StorageError refusing the folder when another live job or open
        manager holds it, or the OSError of a filesystem without locks; None once held."""
        try:
            _lock(fd)
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EAGAIN):
                return exc
        else:
            return None
        holder = self._holder(fd)
        if holder.get("pid") != os.getpid():
            return self._refusal(holder)
        # Held in this process: by an open manager, or by one dropped without close() that
        # waits in a reference cycle for the collector. Collect once, then ask again.
        gc.collect()
        try:
            _lock(fd)
        except OSError:
            return StorageError(
                f"{self.url} ({self.folder}) is held by another open CheckpointManager in "
                "this process: close() it first (or `with CheckpointManager(...)`)")
        return None

    def _holder(self, fd: int) -> dict[str, Any]:
        text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        try:
            found = json.loads(text)
        except ValueError:
            found = None
        return found if isinstance(found, dict) else {"holder": text or "unknown"}

    def _refusal(self, holder: dict[str, Any]) -> StorageError:
        return StorageError(
            f"{self.url} ({self.folder}) is in use by another live job on this node "
            f"({json.dumps(holder)}): two jobs saving into one memory tier would delete and "
            "replace each other's checkpoints. Stop that job, or give this one its own "
            "storage.url (and $STATEREG_RUN_ID, if set)")

    def release(self) -> None:
        """Let another job use the folder (closing the descriptor drops the lock)."""
        if self._closer is not None:
            self._closer()
            self._closer = None


def _drop_in_child(lock: weakref.ref[JobLock]) -> None:
    """In a forked child: close this process's copy of a held lock's descriptor."""
    found = lock()
    info = found._closer.detach() if found is not None and found._closer is not None else None
    if info is not None:
        with contextlib.suppress(OSError):
            os.close(info[2][0])
        found._closer = None  # type: ignore[union-attr]
