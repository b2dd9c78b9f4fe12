"""What kind of store a backend is: facts about the medium, never decisions.

A backend says what it is (`StorageBackend.kind`, refined per root by `capabilities_at`);
how to use it (files written at once, components written together, broadcast reads, zip
CRC-32s, writes around the page cache) is decided in one place from these facts and the
declaration's options: `statereg.engine.io_policy`, shown by `statereg plan`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# Where the bytes live:
#   node-memory     this node's shared memory (shm://, the memory tier): every process of
#                   the node reads the same pages; a write is a memory copy (CPU work).
#   process-memory  this process's memory (memory://, fsspec's in-process store).
#   local-disk      a local path (a disk, or a tmpfs mount: then its latency is "memory").
#   object-store    S3, GCS, Azure Blob: every file is a request over the network.
#   filesystem      any other fsspec filesystem, of which statereg knows nothing more.
Medium = Literal["node-memory", "process-memory", "local-disk", "object-store", "filesystem"]
# What one read or write of a file waits on.
Latency = Literal["memory", "disk", "network", "unknown"]


@dataclass(frozen=True)
class StoreCapabilities:
    """The facts about a store that its I/O policy is derived from (engine/io_policy.py)."""

    medium: Medium
    latency: Latency
    # Whether writes pass through this node's page cache and can go around it (O_DIRECT): a
    # local disk; not a tmpfs, where the cache is the store.
    page_cache: bool = False

    def describe(self) -> str:
        """One phrase for `statereg plan`: "local-disk (disk latency, page cache)"."""
        cache = ", page cache" if self.page_cache else ""
        return f"{self.medium} ({self.latency} latency{cache})"
