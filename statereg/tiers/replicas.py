"""Sharing a memory checkpoint across nodes: every node's folder gets the manifest, and with
`replicate` each node's leader copies its previous node's files into its own folder
(docs/tiers.md#several-nodes-and-the-peer-replica).

The copy is the peer reading (rather than the owner pushing over the process group): it
needs no collective, so it overlaps training, and the same server answers loads and drains.
A file appears under its name only when complete and matching its manifest record.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from statereg.backends.base import StorageBackend
from statereg.engine.checkpoints import MANIFEST_SUM_NAME
from statereg.engine.world import World, caught
from statereg.errors import StateregError
from statereg.schemas.manifest import MANIFEST_NAME, FileRecord, parse_manifest
from statereg.tiers.identity import Nodes
from statereg.tiers.node_memory import NodeMemoryBackend

logger = logging.getLogger(__name__)


class Replicas:
    """The manifest sharing and the replica thread of one node's rank (several nodes only).

    `reader` reaches the peers (its `peers[i]` is node `peer_nodes[i]`'s server)."""

    def __init__(self, world: World, nodes: Nodes, memory: StorageBackend,
                 reader: NodeMemoryBackend, peer_nodes: list[int], replicate: bool) -> None:
        self.world = world
        self.nodes = nodes
        self.node = nodes.of_rank[world.rank]
        self.leads = world.rank == nodes.leader(self.node)
        self.memory = memory
        self.reader = reader
        self.peer_nodes = peer_nodes
        self.replicate = replicate
        self._thread: threading.Thread | None = None
        self._error: StateregError | None = None  # a failed copy, raised by the next save

    @property
    def thread(self) -> threading.Thread | None:
        """The replica copy in flight, if any (retention waits for it)."""
        return self._thread

    def share(self, name: str, held: Callable[[], str | None]) -> str | None:
        """After a memory save (collective): every node's folder gets the manifest, and with
        `replicate` each node leader starts copying its previous node's files of `name` into
        its own folder. Returns what rank 0's drain reads (`held()` on rank 0), which no
        node's retention may delete. A failure here costs the replica, never the save."""
        self.join()

        mine: tuple[bytes, bytes, str | None] | None = None
        if self.world.rank == 0:
            with caught() as sharing:
                mine = (self.memory.read_bytes(f"{name}/{MANIFEST_NAME}"),
                        self.memory.read_bytes(f"{name}/{MANIFEST_SUM_NAME}"), held())
            if sharing.error is not None:
                logger.warning("memory tier: cannot share the manifest of %s with the other "
                               "nodes (%s)", self.memory.display(name), sharing.error)
        listing = None
        with caught():  # a leader that cannot list its folder offers no files to copy
            if self.leads:
                listing = self.memory.walk(name)
        everyone = self.world.all_gather((mine, [(f.path, f.size) for f in listing or []]))
        shared = everyone[0][0]
        if shared is None or not self.leads:
            return None if shared is None else shared[2]
        manifest, digest, kept = shared
        if self.node != 0:
            with caught() as writing:
                self._write_manifest(name, manifest, digest)
            if writing.error is not None:
                logger.warning("memory tier: writing the manifest of %s on node %d failed "
                               "(%s)", self.memory.display(name), self.node, writing.error)
        if self.replicate:
            source = self.nodes.previous(self.node)
            files = parse_manifest(manifest, self.memory.display(name)).files
            wanted = {f"{name}/{r.path}": r for r in files}
            theirs = [(p, wanted[p]) for p, _ in everyone[self.nodes.leader(source)][1]
                      if p in wanted]
            self._thread = threading.Thread(target=self._copy, args=(source, theirs),
                                            name="statereg-replica", daemon=True)
            self._thread.start()
        return kept

    def _write_manifest(self, name: str, manifest: bytes, digest: bytes) -> None:
        """The manifest last, as a commit writes it: its sum first."""
        self.memory.write_bytes(f"{name}/{MANIFEST_SUM_NAME}", digest)
        self.memory.write_bytes(f"{name}/{MANIFEST_NAME}", manifest)

    def _copy(self, source: int, files: list[tuple[str, FileRecord]]) -> None:
        """Copy node `source`'s files into this node's folder, each checked against its
        manifest record (runs on a thread)."""
        peer = self.reader.peers[self.peer_nodes.index(source)]
        started = time.perf_counter()
        try:
            for path, record in files:
                self.reader.fetch(peer, path, record)
        except Exception as exc:
            logger.warning("memory tier: replicating node %d's files into node %d failed "
                           "(%s); a loss of node %d now restores from storage.url", source,
                           self.node, exc, source)
            self._error = StateregError(
                f"replicating node {source}'s files into node {self.node} failed ({exc}); "
                f"a loss of node {source} would restore from storage.url")
            return
        logger.debug("memory tier: replicated %d file(s) of node %d in %.2f s", len(files),
                     source, time.perf_counter() - started)

    def take_error(self) -> StateregError | None:
        """The failure of the last replica copy, if it is done and failed, taken (a copy
        still running is not waited for: the next save after it fails raises it)."""
        if self._thread is not None and self._thread.is_alive():
            return None
        error, self._error = self._error, None
        return error

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
