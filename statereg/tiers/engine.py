"""Memory-first tiers: save often into shared memory, drain some saves to storage.url, and
resume from the nearest complete copy (docs/tiers.md).

    save(step) -> memory due?  Saver on the memory root (same protocol: manifest last)
               -> memory retention (keep_last, never the checkpoint a drain is reading)
               -> durable due? rank 0 drains it on a thread: copy_checkpoint(memory -> storage.url),
                               which commits manifest last, then durable retention
               -> several nodes: the manifest goes to every node's folder, each node's
                  leader applies retention to its folder, and with `replicate` copies its
                  previous node's files into its own (a background thread, joined at the
                  next memory save)
    load()     -> nearest(): the newest step whose files the nodes' folders hold between them,
                  unless storage.url names a newer committed step (read only then); a rank
                  reads a file its node lacks from the peer node that holds it (transport/)

This module composes the tier's jobs, each in its own module: identity.py (which folder),
lock.py (one live job per folder), memory.py (retention), replicas.py (sharing across
nodes), drain.py (to storage.url), restore.py (nearest), transport/ (the peer server and
client), node_memory.py (this node's folder, falling back to peers).

The memory root is `shm://<run_id>/<identity>` on each node: the identity folder names the
job (world size, which ranks share a node, its groups, storage.url), so a job never adopts
another job's files. A node replaced by a new host keeps its place in the topology, so its
ranks restore from the peer's replica.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from statereg.backends.base import StorageBackend
from statereg.backends.shm import SharedMemoryBackend, node_name
from statereg.engine.checkpoints import Committed
from statereg.engine.plan import RankPlan, compile_plan
from statereg.engine.resume import Rung
from statereg.engine.saver import SaveHandle, Saver
from statereg.engine.world import World, caught
from statereg.errors import SpecError, StateregError, StorageError
from statereg.schemas.spec import RegistrySpec
from statereg.state.protocols import TensorState
from statereg.tiers.drain import Drainer
from statereg.tiers.identity import (
    IDENTITY_NAME,
    Nodes,
    identity_folder,
    job_identity,
    node_bytes,
    run_id,
)
from statereg.tiers.lock import JobLock
from statereg.tiers.memory import MemoryRetention
from statereg.tiers.node_memory import NodeMemoryBackend, check_room
from statereg.tiers.replicas import Replicas
from statereg.tiers.restore import Restorer
from statereg.tiers.transport import (
    GLOO_IFNAME_ENV,
    PEER_HOST_ENV,
    PeerServer,
    network_namespace,
    open_peer,
    peer_address,
    unusable_across_machines,
)

logger = logging.getLogger(__name__)

__all__ = ["TierEngine", "rank_bytes", "run_id"]

# Seconds a leader gives its neighbour's server to answer the reachability check at
# construction (a wrong address fails there, not at the first replica).
_PING_TIMEOUT_S = 10.0


def rank_bytes(spec: RegistrySpec, world: World, adapters: dict[str, Any]) -> list[int]:
    """Bytes of one checkpoint of the live state that each rank writes (collective)."""
    sizes = {}
    for name, adapter in adapters.items():
        if isinstance(adapter, TensorState):
            tensors = adapter.capture().tensors
            sizes[name] = [(key, t.numel() * t.element_size()) for key, t in tensors.items()]
    plan = compile_plan(spec, world.layout, None, sizes)
    return world.all_gather(sum(t.nbytes or 0 for t in plan.tasks if t.takes_part))


class MemoryCopies:
    """The memory tier's copies of the run's checkpoints, nearest first: the first source of
    a resume (engine/resume.py). A memory copy is a cache of storage.url: one that is
    damaged, deleted meanwhile, or whose reads fail (a peer node that stalled or lied: a
    StorageError naming it; other ranks get the agreed error) is passed over for the next
    nearest, then for storage.url. A SpecError is the request's own fault: every copy would
    refuse it."""

    def __init__(self, nearest: Callable[[frozenset[int]],
                                         tuple[StorageBackend, Committed] | None]) -> None:
        self._nearest = nearest
        self._unusable: set[int] = set()  # steps whose load failed

    def after(self, failed: Rung | None, error: StateregError | None) -> Rung | None:
        if failed is not None:
            self._unusable.add(failed.committed.step)
        found = self._nearest(frozenset(self._unusable))
        return None if found is None else Rung(*found)

    def skip(self, failed: Rung, error: StateregError) -> tuple[str, str]:
        if isinstance(error, SpecError):
            raise error
        return f"memory copy {failed.display()} unusable ({error})", ""

    def exhausted(self, failed: Rung, error: StateregError) -> None:
        return  # storage.url holds nothing either: a fresh start


class TierEngine:
    """The tiers of one run: a Saver on the memory root, retention, replicas, the drain, and
    restore. Owns the lock on its memory folder (released at close)."""

    def __init__(self, spec: RegistrySpec, durable: StorageBackend, world: World,
                 adapters: dict[str, Any]) -> None:
        assert spec.tiers is not None
        self.spec = spec
        self.tiers = spec.tiers
        self.durable = durable
        self.world = world
        self.nodes = Nodes.from_names(world.all_gather(node_name()))
        self.node = self.nodes.of_rank[world.rank]
        self.leads = world.rank == self.nodes.leader(self.node)
        self.replicate = self.tiers.memory.replicate is not None and self.nodes.count > 1
        self.identity = job_identity(spec, world, self.nodes)
        self.run_url = self.tiers.memory.url.replace("{run_id}", self.identity["run_id"])
        folder = f"{self.run_url}/{identity_folder(self.identity)}"
        # This node's folder: saves, retention and inventories see it alone; retention's
        # retired checkpoint lends its tmpfs pages to the next save. Loads and drains read
        # through `reader`, which also reads the files other nodes hold.
        self.memory = SharedMemoryBackend(folder, recycle=True)
        self.reader: StorageBackend = self.memory
        self.lock = JobLock(self.memory.root, self.memory.url)
        needed = (self.tiers.memory.keep_last + 1) * node_bytes(
            self.nodes, rank_bytes(spec, world, adapters), self.node, self.replicate)
        with caught() as preparing:
            self._prepare_memory(needed)
        try:
            world.agree(preparing.error, f"opening the memory tier {self.memory.url}")
        except BaseException:
            self.lock.release()
            raise
        self._server: PeerServer | None = None
        self._peer_nodes: list[int] = []
        self._replicas: Replicas | None = None
        if self.nodes.count > 1:
            self._connect_peers(folder)
        self._retention = MemoryRetention(self.memory, self.tiers.memory.keep_last)
        self._drainer = Drainer(self.reader, self.memory, durable, self.tiers.durable)
        self._restorer = Restorer(world, self.nodes, self.memory, self.reader, durable,
                                  self.identity, self.run_url, self._peer_nodes)
        self._saver = Saver(spec, self.memory, world)
        self._failed: int | None = None  # the step of the last memory save, if not committed

    @property
    def drained(self) -> list[str]:
        """Checkpoints this process drained, in order."""
        return self._drainer.drained

    def _prepare_memory(self, needed: int) -> None:
        """Hold this node's folder for this job (one live job per folder); refuse a tmpfs too
        small for keep_last + 1 checkpoints; record the identity."""
        if not self.leads:
            return
        self.memory.make_private()  # this user's folders, 0700, each checked (no link)
        self.lock.acquire()
        held = "this node's state" + (" and its peer's replica" if self.replicate else "")
        check_room(self.memory, needed, f"tiers.memory.keep_last {self.tiers.memory.keep_last} "
                                        f"checkpoints of {held} plus the one being written")
        if not self.memory.exists(IDENTITY_NAME):
            self.memory.write_bytes(IDENTITY_NAME, json.dumps(self.identity, indent=1).encode())

    def _connect_peers(self, folder: str) -> None:
        """Each node's leader serves its folder; every rank reads other nodes through them,
        its next node first (the one holding its replica). Collective.

        Fails early, on every rank alike: an address another machine cannot reach (a
        loopback address, where the nodes do not share one network namespace) is refused
        before anything listens, and each leader then reaches its neighbours' servers once,
        so a wrong address is an error here instead of a replica or drain failing later."""
        found = None
        with caught() as finding:
            if self.leads:
                found = peer_address()
        self.world.agree(finding.error, "finding this node's peer address")
        everyone = self.world.all_gather((found, network_namespace()))
        spaces = {space for _, space in everyone}
        if len(spaces) != 1 or None in spaces:  # really several machines (or unknown)
            for rank, (address, _) in enumerate(everyone):
                why = None if address is None else unusable_across_machines(address[0])
                if why is not None:
                    raise StorageError(
                        f"memory tier: node {self.nodes.of_rank[rank]} (rank {rank}) would "
                        f"serve its memory to the other nodes at {address[0]} (from "
                        f"{address[1]}), {why}: the job's {self.nodes.count} nodes could not "
                        f"reach it, so no replica and no drain of its files would work. Set "
                        f"${PEER_HOST_ENV} on each node to its own address on the network the "
                        f"nodes share (the address of the interface gloo uses, which "
                        f"${GLOO_IFNAME_ENV} names; setting ${GLOO_IFNAME_ENV} alone also "
                        "works), or fix the host name's entry in /etc/hosts")

        served: tuple[str, bytes] | None = None
        with caught() as serving:
            if self.leads:
                assert found is not None  # found above, on the leaders
                self._server = PeerServer(self.memory, host=found[0])
                served = self._server.url, self._server.secret
        self.world.agree(serving.error, "starting the memory tier's peer server")
        servers = self.world.all_gather(served)
        count = self.nodes.count
        self._peer_nodes[:] = [(self.node + k) % count for k in range(1, count)]
        peers = [open_peer(*servers[self.nodes.leader(n)]) for n in self._peer_nodes]

        # Each leader reaches the next node's server and the previous one's.
        neighbours = {self._peer_nodes[0], self._peer_nodes[-1]} if self.leads else set()
        with caught() as reaching:
            for node in neighbours:
                url, secret = servers[self.nodes.leader(node)]
                try:
                    open_peer(url, secret, _PING_TIMEOUT_S).ping()
                except StorageError as exc:
                    raise StorageError(
                        f"memory tier: node {self.node} cannot reach node {node}'s peer server "
                        f"at {url} ({exc}). Set ${PEER_HOST_ENV} on node {node} to an address "
                        f"this node reaches (the address of the interface gloo uses, "
                        f"${GLOO_IFNAME_ENV}), and let its port range through any firewall "
                        "between the nodes") from exc
        try:
            self.world.agree(reaching.error, "reaching the neighbouring nodes' peer servers")
        except BaseException:
            if self._server is not None:
                self._server.close()
            raise
        reader = NodeMemoryBackend(folder, peers)
        self.reader = reader
        self._replicas = Replicas(self.world, self.nodes, self.memory, reader,
                                  self._peer_nodes, self.replicate)

    def leader_node_has(self, path: str) -> bool:
        """Whether rank 0's node's memory folder holds `path`: this node's folder, or that
        node's peer server (one request, however many nodes there are)."""
        node = self.nodes.of_rank[0]
        if node == self.node or not isinstance(self.reader, NodeMemoryBackend):
            return self.memory.exists(path)
        return self.reader.peers[self._peer_nodes.index(node)].exists(path)

    # -- saving -------------------------------------------------------------------------

    def due(self, step: int) -> tuple[bool, bool]:
        """Whether step is due for the memory tier and for the durable tier."""
        return step % self.tiers.memory.every == 0, step % self.tiers.durable.every == 0

    def save(self, plan: RankPlan, adapters: dict[str, Any], step: int,
             tokens_seen: int | None, extra: dict[str, Any] | None) -> SaveHandle | None:
        """Save `step` to memory if due, then start its drain if due; None if no tier is due.

        With `save.async`, the loop waits only for the copy into staging buffers: the write
        to memory, and after its commit the sharing, retention and drain, run on the save's
        background thread (every rank in the same order, so its collectives pair up)."""
        to_memory, to_durable = self.due(step) if isinstance(step, int) else (True, False)
        if not to_memory:
            return None
        self._saver.wait()  # the previous memory save and what followed its commit
        drainer = self._drainer
        due, skipped = to_durable, False
        if to_durable and self.world.rank == 0 and drainer.in_flight():
            if self.tiers.memory.drain == "skip":
                skipped, to_durable = True, False
            else:
                drainer.join()
        self.world.agree(self._failure(step, due), "the memory tier's last replica or drain")
        if skipped:
            logger.warning("the drain of %s is still running: step %d is not drained "
                           "(tiers.memory.drain: skip)", drainer.draining, step)
            drainer.missed(step)
        if self.leads:
            self._retention.join()
            self._retention.drop_stale(step, drainer.draining, self._failed)
        self._failed = step  # until its commit says otherwise

        def committed(name: str) -> None:
            self._failed = None
            held = (self._replicas.share(name, drainer.held) if self._replicas is not None
                    else drainer.held())
            if self.leads:
                replica = self._replicas.thread if self._replicas is not None else None
                self._retention.start(name, held, replica)
            if self.world.rank == 0 and to_durable:
                drainer.start(name)

        return self._saver.save(plan, adapters, step, tokens_seen, extra, committed)

    def _failure(self, step: int, to_durable: bool) -> StateregError | None:
        """What the next save raises on every rank (the memory checkpoints are intact): a
        replica or drain that failed since the last save, or, at a due drain, a durable
        tier that has not committed for tiers.durable.max_missed due drains."""
        failures = []
        if self._replicas is not None and (error := self._replicas.take_error()) is not None:
            failures.append(str(error))
        if self.world.rank == 0:
            drainer, declared = self._drainer, self.tiers.durable
            if (drain_error := drainer.take_error()) is not None:
                failures.append(f"a drain to {self.durable.url} failed: {drain_error}")
            if to_durable and len(drainer.uncommitted) >= declared.max_missed:
                steps = ", ".join(map(str, drainer.uncommitted))
                last = ("none in this run" if drainer.last_committed is None
                        else f"step {drainer.last_committed}")
                message = (f"{self.durable.url} has not committed a checkpoint for "
                           f"{len(drainer.uncommitted)} due drains (steps {steps}; the last "
                           f"committed drain: {last}): a lost node now loses every step since")
                if declared.on_missed == "carry_on":
                    logger.error("%s (tiers.durable.on_missed: carry_on)", message)
                else:
                    drainer.uncommitted.clear()  # a caller that catches this goes on
                    failures.append(
                        f"{message}. The run stops here (tiers.durable.max_missed "
                        f"{declared.max_missed}); fix the durable store, or declare "
                        "tiers.durable.on_missed: carry_on to train on with memory only")
        if not failures:
            return None
        return StateregError(
            f"save(step={step}): {'; '.join(failures)}. The memory tier holds its "
            "checkpoints; this step was not saved: save it again to go on")

    def wait(self) -> None:
        """Block until the drain in flight is committed (and memory retention is done);
        raise if a drain failed since the last wait (the memory checkpoints are intact: only
        the durable copy is missing)."""
        self._saver.wait()
        self._drainer.join()
        self._retention.join()
        self._drainer.raise_failure()

    def close(self) -> None:
        """Finish the drain in flight and stop its thread; on several nodes (collective),
        stop serving this node's folder once rank 0's drain no longer reads it."""
        try:
            self.wait()
        finally:
            self._saver.close()
            self._drainer.shutdown()
            if self._replicas is not None:
                self._replicas.join()
            self._retention.join()
            self.memory.release_mappings()  # each rank's own: they would hold deleted pages
            if self.leads:
                self.memory.drop_recycled()  # nothing saves here any more: free its pages
                self.lock.release()
            if self.nodes.count > 1:
                self.world.all_gather(None)  # every rank's drain and replica is done
                if self._server is not None:
                    self._server.close()
                    self._server = None

    # -- restoring ----------------------------------------------------------------------

    def nearest(self, unusable: frozenset[int] = frozenset(),
                ) -> tuple[StorageBackend, Committed] | None:
        """The memory copy to resume from, or None to resume from storage.url (collective):
        tiers/restore.py. Steps in `unusable` (a load of them failed) are passed over."""
        return self._restorer.nearest(unusable, before=self._retention.join)

    def copies(self) -> MemoryCopies:
        """The memory copies a resume tries first, nearest first (engine/resume.py)."""
        return MemoryCopies(self.nearest)

    # -- on a signal --------------------------------------------------------------------

    def flush(self) -> tuple[str | None, bool]:
        """On a declared signal (tiers/signals.py, rank 0): wait for the drain in flight,
        then drain the newest complete memory checkpoint now unless storage.url holds it.
        Returns its name (None when memory holds none) and whether this call copied it."""
        try:  # an async memory save in flight commits first (and starts its drain)
            self._saver.wait()
        except Exception as exc:
            logger.warning("the memory save in flight failed (%s); flushing the newest "
                           "complete memory checkpoint", exc)
        return self._drainer.flush()
