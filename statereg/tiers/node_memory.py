"""This node's memory folder as the tier engine uses it: the room it needs, and reads that
fall back to the peer node holding a file this node lacks.

The storage-level part (the `shm://` scheme, page reuse, containment) is
backends/shm.py, torch-free like every backend; what only the tier needs is here.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from contextlib import contextmanager, suppress
from dataclasses import replace
from typing import Any

from statereg.backends.base import StoredFile
from statereg.backends.capabilities import StoreCapabilities
from statereg.backends.checksum import Recorded, verify_stream
from statereg.backends.local import temporary_name
from statereg.backends.shm import (
    SHM_DIR_ENV,
    SharedMemoryBackend,
    free_bytes,
    node_dir,
    shm_dir,
    used_bytes,
)
from statereg.backends.stores import ReadOnlyStore
from statereg.errors import StorageError
from statereg.tiers.lock import LOCK_NAME


def check_room(memory: SharedMemoryBackend, needed: int, what: str) -> None:
    """Refuse, with the numbers, when the shared-memory filesystem cannot hold `needed`
    bytes in `memory` (counting what its root already holds, which its retention reuses)."""
    os.makedirs(memory.root, exist_ok=True)
    lock = os.path.join(memory.root, LOCK_NAME)
    held = used_bytes(memory.root) - (os.lstat(lock).st_size if os.path.exists(lock) else 0)
    free = free_bytes(memory.root)
    if needed > free + held:
        others, stale = other_jobs(memory.root), ""
        if others:
            stale = (f"; other jobs' memory checkpoints on this node hold "
                     f"{sum(others.values()):,} bytes (memory outlives a job by design; "
                     "delete the folders of finished jobs to free it: "
                     f"{', '.join(f'{p} {n:,}' for p, n in others.items())})")
        raise StorageError(
            f"{memory.url} ({memory.root}) is too small for {what}: it needs {needed:,} "
            f"bytes, and {free:,} bytes are free plus {held:,} held by this job's memory "
            f"checkpoints{stale}. Lower tiers.memory.keep_last, enlarge the tmpfs (e.g. "
            f"`mount -o remount,size=... {shm_dir()}`), or point ${SHM_DIR_ENV} at a "
            "larger one"
        )


def other_jobs(root: str, most: int = 5) -> dict[str, int]:
    """The biggest job folders (`<run>/<identity>`) on this node other than `root`, with the
    bytes they hold: what a finished job left in memory."""
    node = node_dir()
    sizes: dict[str, int] = {}
    for run in os.listdir(node) if os.path.isdir(node) else []:
        runs = os.path.join(node, run)
        for job in os.listdir(runs) if os.path.isdir(runs) else []:
            folder = os.path.join(runs, job)
            if folder != root and not root.startswith(folder + os.sep):
                sizes[folder] = used_bytes(folder)
    biggest = sorted(sizes.items(), key=lambda item: item[1], reverse=True)[:most]
    return {folder: size for folder, size in biggest if size}


class NodeMemoryBackend(SharedMemoryBackend):
    """This node's memory folder; a file it lacks is read from the first peer that holds it.

    Writes and deletes stay on this node; reads fall back to peers. `holders` (path ->
    its size and the peers holding it, from the nodes' inventories) spares asking each peer
    in turn, and shows those files in `walk` as if they were here.
    """

    def __init__(self, url: str, peers: Sequence[ReadOnlyStore] | None = None) -> None:
        super().__init__(url)
        self.peers = list(peers or [])
        self.holders: dict[str, tuple[int, list[int]]] = {}
        # Whether some file of the step being loaded is on peers only (`locate`).
        self.on_peers = False
        self._found: dict[str, ReadOnlyStore] = {}
        self._lock = threading.Lock()

    def locate(self, holders: dict[str, tuple[int, list[int]]], on_peers: bool) -> None:
        """What a restore found (tiers/restore.py, alike on every rank): which peers hold
        each file of the step it loads, and whether some node lacks a file (`on_peers`):
        then reads cross the network (`capabilities`), and the I/O policy has ranks
        broadcast what one of them reads instead of each reading its own node's memory."""
        with self._lock:
            self.holders = dict(holders)
            self._found.clear()
        self.on_peers = on_peers

    @property
    def capabilities(self) -> StoreCapabilities:
        """Node memory; of network latency while some file is on peers only."""
        here = super().capabilities
        return replace(here, latency="network") if self.on_peers else here

    def _read_from(self, path: str) -> ReadOnlyStore | None:
        """None if this node has `path`, else a peer that has it; None (this node, whose
        read then says the file is missing) if none has it. A peer that cannot be asked is
        passed over; its StorageError is raised if no other peer has the file."""
        if not self.peers or super().exists(path):
            return None
        with self._lock:
            known = self._found.get(path)
        if known is not None:
            return known
        order = self.holders.get(path, (0, []))[1]
        order = order + [i for i in range(len(self.peers)) if i not in order]
        unreachable: StorageError | None = None
        for index in order:
            peer = self.peers[index]
            try:
                found = peer.exists(path)
            except StorageError as exc:
                unreachable = unreachable or exc
                continue
            if found:
                with self._lock:
                    self._found[path] = peer
                return peer
        if unreachable is not None:
            raise unreachable
        return None

    def read_bytes(self, path: str, limit: int | None = None) -> bytes:
        """The bytes from this node, else from a peer holding them; a peer that fails (down,
        stalled past its deadline, or answering what was not asked: a StorageError naming
        it) is passed over for the next peer that holds the file."""
        peer = self._read_from(path)
        if peer is None:
            return super().read_bytes(path, limit)
        tried: list[ReadOnlyStore] = []
        while True:
            try:
                return peer.read_bytes(path, limit)
            except StorageError:
                tried.append(peer)
                with self._lock:
                    self._found.pop(path, None)
                following = self._next_holder(path, tried)
                if following is None:
                    raise
                peer = following

    def _next_holder(self, path: str, tried: list[ReadOnlyStore]) -> ReadOnlyStore | None:
        """A peer not in `tried` that answers that it holds `path` (None if none does)."""
        for peer in self.peers:
            if peer in tried:
                continue
            try:
                if peer.exists(path):
                    return peer
            except StorageError:
                tried.append(peer)
        return None

    @contextmanager
    def open_read(self, path: str, size: int | None = None) -> Any:
        peer = self._read_from(path)
        if peer is None:
            with super().open_read(path, size) as stream:
                yield stream
        else:
            with peer.open_read(path, size) as stream:
                yield stream

    @contextmanager
    def open_ranges(self, path: str, ranges: Sequence[tuple[int, int]],
                    size: int | None = None) -> Any:
        peer = self._read_from(path)
        if peer is None:
            with super().open_ranges(path, ranges, size) as stream:
                yield stream
        else:
            with peer.open_ranges(path, ranges, size) as stream:
                yield stream

    def open_blocks(self, path: str) -> Any:
        peer = self._read_from(path)
        return super().open_blocks(path) if peer is None else peer.open_blocks(path)

    def exists(self, path: str) -> bool:
        return self._read_from(path) is not None or super().exists(path)

    def size(self, path: str) -> int:
        peer = self._read_from(path)
        return super().size(path) if peer is None else peer.size(path)

    def list_dir(self, path: str = "") -> list[str]:
        """This node's entries under `path`, and those only peers hold (as `holders` says):
        a layout that finds its files by listing (safetensors) finds them on a node that
        lacks them, as `walk` does."""
        names = set(super().list_dir(path))
        prefix = f"{path}/" if path else ""
        names.update(p[len(prefix):].split("/", 1)[0] for p, (_, nodes) in self.holders.items()
                     if p.startswith(prefix) and nodes)
        return sorted(names)

    def walk(self, path: str = "") -> list[StoredFile]:
        """This node's files under `path`, and those only peers hold (as `holders` says)."""
        here = super().walk(path)
        seen = {f.path for f in here}
        prefix = f"{path}/" if path else ""
        elsewhere = [StoredFile(p, size, None) for p, (size, nodes) in self.holders.items()
                     if p.startswith(prefix) and p not in seen and nodes]
        return sorted(here + elsewhere, key=lambda f: f.path)

    def fetch(self, peer: ReadOnlyStore, path: str, record: Recorded) -> None:
        """Copy `path` from `peer` into this node's folder (a replica), checked against its
        manifest `record` as it is copied; a reader never sees a part of it, nor a copy that
        does not match (the peer's file rewritten under it, say by the page reuse of a
        retired checkpoint): it is written under a temporary name and renamed when whole
        and verified (else CorruptCheckpointError, and no replica)."""
        if super().exists(path):
            return
        tmp = temporary_name(path)
        try:
            with peer.open_blocks(path) as source, self.open_write(tmp) as sink:
                verify_stream(peer.display(path), record, source, sink.write)
            os.replace(self.full_path(tmp), self.full_path(path))
        finally:
            with suppress(FileNotFoundError):
                os.unlink(self.full_path(tmp))
