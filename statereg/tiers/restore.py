"""Restore nearest: the newest step whose files the nodes' memory folders hold between them,
unless storage.url names a newer committed step (docs/tiers.md#how-it-works).

Each node's leader reports its folder's inventory; rank 0 decides and every rank receives
the choice. Only when storage.url lists a higher step is a durable manifest read: zero bytes
come from the durable tier otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from statereg.backends.base import StorageBackend
from statereg.backends.registry import open_backend
from statereg.engine.checkpoints import (
    Committed,
    checkpoint_name,
    read_manifest_at,
    scan_root,
    step_of,
)
from statereg.engine.world import World, caught
from statereg.tiers.drain import committed_at
from statereg.tiers.identity import Nodes, identity_folder
from statereg.tiers.node_memory import NodeMemoryBackend

logger = logging.getLogger(__name__)

# step -> (the files its manifest lists with their sizes, or None without a readable
# manifest here; the files present with their sizes). Paths are from the root (`step_N/...`).
Inventory = dict[int, tuple[dict[str, int] | None, dict[str, int]]]


def inventory(memory: StorageBackend) -> Inventory:
    """One node's folder, step by step."""
    # Every readable manifest, also one whose files are missing here (a peer may hold
    # them): list_committed would skip it.
    committed = {c.step: c for c in scan_root(memory).committed}
    found: Inventory = {}
    for entry in memory.list_dir(""):
        step = step_of(entry)
        if step is None:
            continue
        present = {f.path: f.size for f in memory.walk(entry)}
        known = committed.get(step)
        need = (None if known is None
                else {f"{entry}/{r.path}": r.size for r in known.manifest.files})
        found[step] = (need, present)
    return found


class Restorer:
    """Finds the memory copy to resume from (collective: every rank calls `nearest`)."""

    def __init__(self, world: World, nodes: Nodes, memory: StorageBackend,
                 reader: StorageBackend, durable: StorageBackend, identity: dict[str, Any],
                 run_url: str, peer_nodes: list[int]) -> None:
        self.world = world
        self.nodes = nodes
        self.node = nodes.of_rank[world.rank]
        self.leads = world.rank == nodes.leader(self.node)
        self.memory = memory
        self.reader = reader
        self.durable = durable
        self.identity = identity
        self.run_url = run_url
        self.peer_nodes = peer_nodes

    def nearest(self, unusable: frozenset[int] = frozenset(),
                before: Callable[[], None] | None = None,
                ) -> tuple[StorageBackend, Committed] | None:
        """The memory copy to resume from, or None to resume from storage.url (collective).

        Steps in `unusable` (a load of them failed) are passed over; `before` runs on each
        leader before it looks (the tier engine waits for its retention there)."""
        mine: Any = None
        if self.leads:
            if before is not None:
                before()
            with caught() as looking:
                mine = {step: found for step, found in inventory(self.memory).items()
                        if step not in unusable}
            if looking.error is not None:
                logger.warning("memory tier %s unreadable on node %d (%s)", self.memory.url,
                               self.node, looking.error)
                mine = {}
        everyone = self.world.all_gather(mine)
        decided: Any = None
        if self.world.rank == 0:
            folders = {self.nodes.of_rank[r]: inv for r, inv in enumerate(everyone)
                       if inv is not None}
            choice, holders = self._complete(folders)
            decided = (self._check_against_durable(choice, folders, unusable), holders)
        choice, holders = self.world.broadcast(decided)
        if choice is None:
            return None
        if isinstance(self.reader, NodeMemoryBackend):
            # Where some node lacks a file, ranks that need the same bytes have one of them
            # read (over HTTP if need be) and broadcast, as from remote storage; where every
            # node holds every file, each rank reads its own node's memory. The same on
            # every rank: holders are.
            every = set(range(self.nodes.count))
            self.reader.locate(
                {path: (size, [self.peer_nodes.index(n) for n in nodes if n != self.node])
                 for path, (size, nodes) in holders.items()},
                any(set(n) != every for _, n in holders.values()))
        name = checkpoint_name(choice)
        # Rank 0 reads the manifest and every rank receives it (issue 17: read once per job).
        return self.reader, Committed(name, self.world.from_leader(read_manifest_at,
                                                                   self.reader, name))

    def _complete(self, folders: dict[int, Any],
                  ) -> tuple[int | None, dict[str, tuple[int, list[int]]]]:
        """Rank 0: the newest step whose files the node folders hold between them, and which
        nodes hold each file; one log line for each newer step that is incomplete."""
        steps = sorted({step for inv in folders.values() for step, (need, _) in inv.items()
                        if need is not None}, reverse=True)
        for step in steps:
            need = next(inv[step][0] for inv in folders.values()
                        if inv.get(step, (None, None))[0] is not None)
            holders = {path: (size, [node for node, inv in sorted(folders.items())
                                     if inv.get(step, (None, {}))[1].get(path) == size])
                       for path, size in need.items()}
            missing = sorted(path for path, (_, nodes) in holders.items() if not nodes)
            if not missing:
                return step, holders
            where = "on every node" if len(folders) > 1 else ""
            logger.warning("memory tier: %s skipped: %d file(s) missing or of the wrong "
                           "size%s (first: %s)", self.memory.display(checkpoint_name(step)),
                           len(missing), f" {where}" if where else "", missing[0])
        return None, {}

    def _other_identities(self) -> list[str]:
        """Identity folders of other jobs under shm://<run_id> on this node."""
        mine = identity_folder(self.identity)
        base = open_backend(self.run_url)
        return sorted(n for n in base.list_dir("") if n != mine and n.startswith("ws"))

    def _check_against_durable(self, choice: int | None, folders: dict[int, Any],
                               unusable: frozenset[int]) -> int | None:
        """Rank 0: keep the memory step unless the durable tier has a newer committed one;
        say in one line why memory is not used (unless the resume passed over every copy
        it held: it said why for each, engine/resume.py)."""
        if choice is None:
            held = {step for inv in folders.values() for step in inv}
            others = [] if held else self._other_identities()
            if not held and unusable:
                return None
            if held:
                why = f"no step is complete across the nodes' folders (newest: {max(held)})"
            elif others:
                why = (f"it holds only checkpoints of other job identities "
                       f"({', '.join(others)}; this job is "
                       f"{identity_folder(self.identity)}: world size {self.world.size}, "
                       f"{self.nodes.count} node(s)), which are never loaded")
            else:
                why = "it holds no complete checkpoint"
            logger.warning("memory tier %s skipped: %s; restoring from %s", self.memory.url,
                           why, self.durable.url)
            return None
        newer = sorted((s for s in map(step_of, self.durable.list_dir(""))
                        if s is not None and s > choice), reverse=True)
        for step in newer:
            if committed_at(self.durable, checkpoint_name(step)):
                logger.info("memory tier: step %d is older than step %d in %s; restoring "
                            "from the durable tier", choice, step, self.durable.url)
                return None
        return choice
