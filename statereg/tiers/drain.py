"""The drain: a committed memory checkpoint copied to storage.url on a background thread, then
durable retention (docs/tiers.md#how-it-works). Rank 0 alone drains.

The copy is `copy_checkpoint` (the engine of `statereg cp`): every file is checked against
the memory manifest as it is copied and the durable manifest is written last, so storage.url
never shows a checkpoint the drain did not finish.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

from statereg.backends.base import StorageBackend
from statereg.engine.checkpoints import read_manifest_at, scan_root, step_of
from statereg.engine.retention import apply_retention
from statereg.engine.transfer import copy_checkpoint
from statereg.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ManifestError,
    StateregError,
)
from statereg.schemas.spec import DurableTierSpec, SaveSpec

logger = logging.getLogger(__name__)


def committed_at(backend: StorageBackend, name: str) -> bool:
    """Whether `name` under `backend` is a committed checkpoint that would load."""
    try:
        read_manifest_at(backend, name)
    except (CheckpointNotFoundError, ManifestError, CorruptCheckpointError):
        return False
    return True


class Drainer:
    """Copies memory checkpoints (read through `reader`, which reaches peer nodes) to the
    durable root, one at a time, on its own thread."""

    def __init__(self, reader: StorageBackend, memory: StorageBackend,
                 durable: StorageBackend, declared: DurableTierSpec) -> None:
        self.reader = reader
        self.memory = memory
        self.durable = durable
        self.declared = declared
        self._pool: ThreadPoolExecutor | None = None
        self._future: Future[None] | None = None
        self.draining: str | None = None  # the memory checkpoint the drain reads
        self._error: BaseException | None = None
        self.drained: list[str] = []  # checkpoints this process drained, in order
        # Due drain steps not committed since the last committed drain, and that drain's.
        self.uncommitted: list[int] = []
        self.last_committed: int | None = None
        self._raised: BaseException | None = None  # taken by save(), not raised by wait()

    def missed(self, step: int) -> None:
        """A due drain of `step` was not started (drain: skip)."""
        self.uncommitted.append(step)

    def take_error(self) -> BaseException | None:
        """A drain failure not yet raised, taken (the next save raises it)."""
        error, self._error = self._error, None
        return error

    def in_flight(self) -> bool:
        return self._future is not None and not self._future.done()

    def held(self) -> str | None:
        """The memory checkpoint the drain in flight reads, if any: retention spares it."""
        return self.draining if self.in_flight() else None

    def start(self, name: str) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="statereg-drain")
        self.draining = name
        step = step_of(name)
        if step is not None:
            self.uncommitted.append(step)
        self._future = self._pool.submit(self.drain, name)

    def drain(self, name: str) -> None:
        """Copy memory checkpoint `name` to storage.url (manifest last), then retention."""
        started = time.perf_counter()
        try:
            copy_checkpoint(self.reader, name, self.durable)
        except BaseException as exc:
            self._error = exc
            logger.error("draining %s to %s failed: %s; the next due step drains again",
                         self.memory.display(name), self.durable.url, exc)
            raise
        self.drained.append(name)
        step = step_of(name)
        if step is not None:
            self.last_committed = step
            self.uncommitted[:] = [s for s in self.uncommitted if s > step]
        logger.info("drained %s to %s in %.2f s", name, self.durable.display(name),
                    time.perf_counter() - started)
        if self.declared.keep_last is not None:
            try:
                apply_retention(self.durable, SaveSpec(keep_last=self.declared.keep_last,
                                                       keep_every=self.declared.keep_every),
                                name)
            except Exception as exc:
                logger.warning("durable retention in %s failed (%s); the next drain retries",
                               self.durable.url, exc)

    def join(self) -> None:
        """Wait for the drain in flight (its failure is kept for `raise_failure`)."""
        future, self._future = self._future, None
        if future is not None:
            future.exception()  # logged by the drain itself

    def raise_failure(self) -> None:
        """Raise a drain failure not raised yet (the memory checkpoints are intact)."""
        error, self._error = self._error, None
        if error is not None:
            raise StateregError(f"a drain to {self.durable.url} failed: {error}; the memory "
                                "tier holds the checkpoint, the next due step drains again"
                                ) from error

    def shutdown(self) -> None:
        """Wait for the drain in flight, even one whose future wait() took already, and stop
        the thread (a later `start` makes a new one)."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def flush(self) -> tuple[str | None, bool]:
        """On a signal: wait for the drain in flight, then drain the newest complete memory
        checkpoint now unless storage.url holds it. Returns its name (None when memory holds
        none) and whether this call copied it."""
        self.shutdown()
        # By manifests, not listings: on several nodes this node's folder lacks the files
        # the other nodes hold, which the drain reads from them.
        newest = scan_root(self.memory).committed
        if not newest:
            return None, False
        name = newest[-1].name
        if committed_at(self.durable, name):
            return name, False
        self.drain(name)
        return name, True
