"""How a save and a load use a store: derived, in this one place, from what kind of store it
is (`StoreCapabilities`, which each backend states) and the declaration's storage options.

A backend states facts (node memory or a local disk or an object store, its latency, whether
it has a page cache to go around); the `IOPolicy` decided here travels explicitly to the
save steps, the DCP writer (threads, zip CRC-32s, writes around the page cache) and the
readers (threads, broadcast reads). `statereg plan` prints it. Plain data and torch-free.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from statereg import env
from statereg.backends.capabilities import StoreCapabilities
from statereg.schemas.spec import StorageSpec

# Files a rank writes and reads at once on a store whose every file waits on a network round
# trip (object stores): more in flight than on a disk.
NETWORK_THREADS = 8
# ... and on a disk or a store statereg knows nothing more about.
DEFAULT_THREADS = 2


@dataclass(frozen=True)
class IOPolicy:
    """What a save writes and a load reads at once, and how."""

    write_threads: int
    """Files each rank writes at once per component (storage.io_threads, else the store's)."""
    read_threads: int
    """Files each rank reads at once (storage.io_threads, else the store's)."""
    parallel_components: bool
    """Whether a save writes its components' files at the same time (where no component
    needs a collective)."""
    broadcast_reads: bool
    """Whether ranks that need the same bytes have one rank read them and broadcast them."""
    record_crcs: bool
    """Whether tensor records carry their zip CRC-32s, as torch.save writes them."""
    write_around_cache: bool
    """Whether tensor files are written around the page cache (O_DIRECT)."""

    def describe(self) -> str:
        """One line for `statereg plan`."""
        return (f"{self.write_threads} writers, {self.read_threads} readers per rank; "
                f"components {'together' if self.parallel_components else 'one at a time'}; "
                f"{'broadcast reads' if self.broadcast_reads else 'each rank reads'}; "
                f"zip CRC-32s {'on' if self.record_crcs else 'off'}; "
                f"{'around' if self.write_around_cache else 'through'} the page cache")


def memory_writers() -> int:
    """Files a rank writes (and reads) at once in node memory: this process's cores shared
    among the node's ranks, 2 to 8. A memory save is CPU work (copy, hash), so it scales with
    the cores it may use: 2 on a 2-core machine, 8 for one rank on a 16-core node (a 2 GB save
    there took 5.1x a memory copy with 2 writers, 2.4x with 8; benchmarks/results/journal.md,
    "Memory saves on 16 cores")."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 2
    return max(2, min(8, cpus // env.local_world_size()))


def io_policy(store: StoreCapabilities, *, io_threads: int | None = None,
              compressed: bool = False, read_cache: str = "auto") -> IOPolicy:
    """The policy for `store` under the options that bear on it: storage.io_threads,
    whether tensor files are compressed, and storage.read_cache.

    - Threads: node memory, one per core the rank may use (`memory_writers`: writing is
      copying); an object store, `NETWORK_THREADS` (each file waits on round trips); else
      `DEFAULT_THREADS`.
    - Node memory that every rank of the node reads itself (its latency "memory": no file
      comes from a peer) is read by each rank: a broadcast over gloo's TCP would be the slow
      path (bench_replica.py: a restore took 1.5x longer with it). Anything else, including
      node memory some of whose files are on peers, is read once and broadcast.
    - Node memory writes one component after another, each with its writers: a 0.5 GB save
      on two cores took 2.4-2.6x a memory copy with both components' four writers at once,
      2.2x so. A local disk does so for compressed saves, whose encoders, not the disk, set
      the pace (benchmarks/results/journal.md, "Compressed saves: one component at a time").
    - Node memory records no zip CRC-32s (torch.save's `set_crc32_options(False)` form):
      every item is checked by its xxh3 digest, and the CRC pass cost 0.2-0.3x a memory copy
      of the save (journal, "Memory saves into kept mappings, without CRC-32s"); a drain adds
      them. Compressed records always carry them (a drain would have to decode to add them).
    - Compressed files, whose load is bound by decoding, not reading, go around a page
      cache where the store has one and read_cache does not keep every page (journal,
      "Compressed saves around the page cache").
    """
    node_memory = store.medium == "node-memory"
    if node_memory:
        default = memory_writers()
    elif store.medium == "object-store":
        default = NETWORK_THREADS
    else:
        default = DEFAULT_THREADS
    return IOPolicy(
        write_threads=io_threads or default,
        read_threads=io_threads or default,
        parallel_components=not node_memory and not (
            compressed and store.medium == "local-disk"),
        broadcast_reads=not (node_memory and store.latency == "memory"),
        record_crcs=not node_memory or compressed,
        write_around_cache=compressed and store.page_cache and read_cache != "keep",
    )


def storage_policy(store: StoreCapabilities, storage: StorageSpec) -> IOPolicy:
    """The policy of a declaration's `storage` block on `store`."""
    declared = storage.compression
    return io_policy(store, io_threads=storage.io_threads,
                     compressed=declared is not None and declared.codec != "none",
                     read_cache=storage.read_cache)
