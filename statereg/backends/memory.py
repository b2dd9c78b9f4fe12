"""memory:// through fsspec's in-process MemoryFileSystem (tests, and staging in one process)."""

from __future__ import annotations

from statereg.backends.base import StorageBackend


class MemoryBackend(StorageBackend):
    """Checkpoints held in this process's memory; gone when the process exits."""

    schemes = ("memory",)
