"""memory:// through fsspec's in-process MemoryFileSystem (tests, and staging in one process)."""

from __future__ import annotations

import threading

from statereg.backends.base import EXCLUSIVE_WRITE, StorageBackend
from statereg.backends.capabilities import StoreCapabilities
from statereg.backends.checksum import WrittenFile

# One store per process, so one lock makes "create if absent" atomic for every root in it.
_CREATE_LOCK = threading.Lock()


class MemoryBackend(StorageBackend):
    """Checkpoints held in this process's memory; gone when the process exits."""

    schemes = ("memory",)
    kind = StoreCapabilities("process-memory", "memory")
    atomic_create = True
    probe_exclusive = False  # the lock below makes the check and the write one step

    def _store_if_absent(self, path: str, data: bytes) -> WrittenFile:
        with _CREATE_LOCK:
            with self._storage_op(EXCLUSIVE_WRITE, path):
                if self.fs.exists(self.full_path(path)):
                    raise FileExistsError(self.display(path))
            return self.write_bytes(path, data)
