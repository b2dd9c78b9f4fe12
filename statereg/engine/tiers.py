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
                  reads a file its node lacks from the peer node that holds it (peers.py)

The memory root is `shm://<run_id>/<identity>` on each node: the identity folder names the
job (world size, which ranks share a node, its groups, storage.url), so a job never adopts
another job's files. A node replaced by a new host keeps its place in the topology, so its
ranks restore from the peer's replica.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from statereg.backends.base import StorageBackend
from statereg.backends.peers import NodeMemoryBackend, PeerServer, open_peer
from statereg.backends.registry import open_backend
from statereg.backends.shm import SharedMemoryBackend, node_name
from statereg.engine.checkpoints import (
    MANIFEST_SUM_NAME,
    Committed,
    checkpoint_name,
    list_committed,
    read_manifest_at,
    scan_root,
    step_of,
)
from statereg.engine.copy import copy_checkpoint
from statereg.engine.plan import RankPlan, compile_plan
from statereg.engine.retention import apply_retention
from statereg.engine.saver import SaveHandle, Saver
from statereg.engine.tier_report import IDENTITY_NAME, SMALL_FILES_BYTES, run_id
from statereg.engine.world import World, attempt
from statereg.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ManifestError,
    StateregError,
)
from statereg.schemas.manifest import MANIFEST_NAME, FileRecord, parse_manifest
from statereg.schemas.spec import RegistrySpec, SaveSpec
from statereg.state.protocols import TensorState

logger = logging.getLogger("statereg")


def _committed(backend: StorageBackend, name: str) -> bool:
    """Whether `name` under `backend` is a committed checkpoint that would load."""
    try:
        read_manifest_at(backend, name)
    except (CheckpointNotFoundError, ManifestError, CorruptCheckpointError):
        return False
    return True


@dataclass(frozen=True)
class Nodes:
    """Which node each rank runs on: nodes are numbered in the order of their first rank,
    so a replaced host (another name, the same ranks) keeps its number."""

    of_rank: tuple[int, ...]

    @classmethod
    def from_names(cls, names: list[str]) -> Nodes:
        numbers: dict[str, int] = {}
        return cls(tuple(numbers.setdefault(n, len(numbers)) for n in names))

    @property
    def count(self) -> int:
        return len(set(self.of_rank))

    def ranks(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.of_rank) if n == node]

    def leader(self, node: int) -> int:
        """The node's first rank: it serves, replicates and applies retention there."""
        return self.of_rank.index(node)

    def previous(self, node: int) -> int:
        return (node - 1) % self.count


def job_identity(spec: RegistrySpec, world: World, nodes: Nodes) -> dict[str, Any]:
    """What binds a memory folder to one job: its run, world size, which ranks share a node,
    its named groups, and its durable root. Any difference is another job."""
    return {"run_id": run_id(spec), "world_size": world.size, "nodes": list(nodes.of_rank),
            "groups": {k: [list(c) for c in v] for k, v in sorted(world.layout.groups.items())},
            "storage": spec.storage.url}


def identity_folder(identity: dict[str, Any]) -> str:
    """`ws<N>-<digest>`: the folder of one job identity under shm://<run_id>."""
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return f"ws{identity['world_size']}-{digest}"


def rank_bytes(spec: RegistrySpec, world: World, adapters: dict[str, Any]) -> list[int]:
    """Bytes of one checkpoint of the live state that each rank writes (collective)."""
    sizes = {}
    for name, adapter in adapters.items():
        if isinstance(adapter, TensorState):
            tensors = adapter.capture().tensors
            sizes[name] = [(key, t.numel() * t.element_size()) for key, t in tensors.items()]
    plan = compile_plan(spec, world.layout, None, sizes)
    return world.all_gather(sum(t.nbytes or 0 for t in plan.tasks if t.takes_part))


def node_bytes(nodes: Nodes, per_rank: list[int], node: int, replicate: bool) -> int:
    """Bytes one memory checkpoint takes in `node`'s memory: its own ranks' files (and its
    previous node's, which it holds as a replica) plus room for small files."""
    held = {node, nodes.previous(node)} if replicate else {node}
    return sum(b for r, b in enumerate(per_rank) if nodes.of_rank[r] in held) + SMALL_FILES_BYTES


class TierEngine:
    """The tiers of one run: a Saver on the memory root, the drain thread, and restore."""

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
        # This node's folder: saves, retention and inventories see it alone. Loads and
        # drains read through `reader`, which also reads the files other nodes hold.
        self.memory = open_backend(folder)
        if isinstance(self.memory, SharedMemoryBackend):
            # Retention's retired checkpoint lends its tmpfs pages to the next save.
            self.memory.recycle = True
        self.reader: StorageBackend = self.memory
        needed = (self.tiers.memory.keep_last + 1) * node_bytes(
            self.nodes, rank_bytes(spec, world, adapters), self.node, self.replicate)
        _, error = attempt(self._prepare_memory, needed)
        try:
            world.agree(error, f"opening the memory tier {self.memory.url}")
        except BaseException:
            if isinstance(self.memory, SharedMemoryBackend):
                self.memory.release()
            raise
        self._server: PeerServer | None = None
        self._replica: threading.Thread | None = None
        self._retention: threading.Thread | None = None
        if self.nodes.count > 1:
            self._connect_peers(folder)
        self._saver = Saver(spec, self.memory, world)
        self._drainer: ThreadPoolExecutor | None = None
        self._drain: Future[None] | None = None
        self._draining: str | None = None  # the memory checkpoint the drain reads
        self._failed: int | None = None  # the step of the last memory save, if not committed
        self._drain_error: BaseException | None = None
        self.drained: list[str] = []  # checkpoints this process drained, in order

    def _prepare_memory(self, needed: int) -> None:
        """Hold this node's folder for this job (one live job per folder); refuse a tmpfs too
        small for keep_last + 1 checkpoints; record the identity."""
        memory = self.memory
        if not self.leads:
            return
        if isinstance(memory, SharedMemoryBackend):
            memory.hold()
            held = "this node's state" + (" and its peer's replica" if self.replicate else "")
            memory.check_room(needed, f"tiers.memory.keep_last {self.tiers.memory.keep_last} "
                                      f"checkpoints of {held} plus the one being written")
        if not memory.exists(IDENTITY_NAME):
            memory.write_bytes(IDENTITY_NAME, json.dumps(self.identity, indent=1).encode())

    def _connect_peers(self, folder: str) -> None:
        """Each node's leader serves its folder; every rank reads other nodes through them,
        its next node first (the one holding its replica). Collective."""
        def serve() -> str | None:
            if not self.leads:
                return None
            self._server = PeerServer(self.memory)  # type: ignore[arg-type]
            return self._server.url
        url, error = attempt(serve)
        self.world.agree(error, "starting the memory tier's peer server")
        urls = self.world.all_gather(url)
        count = self.nodes.count
        self._peer_nodes = [(self.node + k) % count for k in range(1, count)]
        peers = [open_peer(urls[self.nodes.leader(n)]) for n in self._peer_nodes]
        self.reader = NodeMemoryBackend(folder, peers)

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
        if to_durable and self.world.rank == 0 and self._in_flight():
            if self.tiers.memory.drain == "skip":
                logger.warning("the drain of %s is still running: step %d is not drained "
                               "(tiers.memory.drain: skip)", self._draining, step)
                to_durable = False
            else:
                self._join_drain()
        if self.leads:
            self._join_retention()
            self._drop_stale(step)
        self._failed = step  # until its commit says otherwise

        def committed(name: str) -> None:
            self._failed = None
            held = self._share(name) if self.nodes.count > 1 else self._held()
            if self.leads:
                self._retain_memory(name, held)
            if self.world.rank == 0 and to_durable:
                self._start_drain(name)

        return self._saver.save(plan, adapters, step, tokens_seen, extra, committed)

    def _drop_stale(self, step: int) -> None:
        """Delete what no one will load from this node's memory folder:

        - checkpoints of `step` and later: the job is at `step`, so they belong to a run it
          abandoned (it resumed from an older copy, e.g. after a damaged memory file, or
          was killed in a memory save), and would refuse this save as already committed;
        - the folder of this process's previous memory save if that save failed before its
          commit (a full tmpfs): its files hold tmpfs pages (RAM) that retention, which
          sees committed checkpoints only, would never free. Only a save known to have
          failed: on several nodes a committed step's files may lie in a node's folder
          that did not receive the manifest, and those are still needed.

        Nothing else writes here now: the previous save, its sharing and retention are done
        (save() waited), and the folder's lock keeps other jobs out. The durable tier is
        never touched. The save's first collective follows, so no rank of this node writes
        before this is done."""
        for entry in self.memory.list_dir(""):
            found = step_of(entry)
            if found is None or entry == self._draining:
                continue
            if found >= step:
                logger.warning("memory tier: removing %s, left by a run that went past step "
                               "%d before resuming from an earlier copy",
                               self.memory.display(entry), step)
            elif found == self._failed and not self.memory.exists(f"{entry}/{MANIFEST_NAME}"):
                logger.warning("memory tier: removing %s, left by its memory save, which "
                               "failed", self.memory.display(entry))
            else:
                continue
            self.memory.remove_tree(entry)

    def _held(self) -> str | None:
        """The memory checkpoint the drain in flight reads (rank 0 knows), if any."""
        return self._draining if self._in_flight() else None

    def _share(self, name: str) -> str | None:
        """After a memory save on several nodes (collective): every node's folder gets the
        manifest, and with `replicate` each node leader starts copying its previous node's
        files of `name` into its own folder. Returns what rank 0's drain reads, which no
        node's retention may delete. A failure here costs the replica, never the save."""
        self._join_replica()

        def rank_zero() -> tuple[bytes, bytes, str | None]:
            return (self.memory.read_bytes(f"{name}/{MANIFEST_NAME}"),
                    self.memory.read_bytes(f"{name}/{MANIFEST_SUM_NAME}"), self._held())

        mine: Any = None
        if self.world.rank == 0:
            mine, error = attempt(rank_zero)
            if error is not None:
                logger.warning("memory tier: cannot share the manifest of %s with the other "
                               "nodes (%s)", self.memory.display(name), error)
        listing, _ = attempt(self.memory.walk, name) if self.leads else (None, None)
        everyone = self.world.all_gather((mine, [(f.path, f.size) for f in listing or []]))
        shared = everyone[0][0]
        if shared is None or not self.leads:
            return None if shared is None else shared[2]
        manifest, digest, held = shared
        if self.node != 0:
            _, error = attempt(self._write_manifest, name, manifest, digest)
            if error is not None:
                logger.warning("memory tier: writing the manifest of %s on node %d failed "
                               "(%s)", self.memory.display(name), self.node, error)
        if self.replicate:
            source = self.nodes.previous(self.node)
            files = parse_manifest(manifest, self.memory.display(name)).files
            wanted = {f"{name}/{r.path}": r for r in files}
            theirs = [(p, wanted[p]) for p, _ in everyone[self.nodes.leader(source)][1]
                      if p in wanted]
            self._replica = threading.Thread(target=self._replicate, args=(source, theirs),
                                             name="statereg-replica", daemon=True)
            self._replica.start()
        return held

    def _write_manifest(self, name: str, manifest: bytes, digest: bytes) -> None:
        """The manifest last, as a commit writes it: its sum first."""
        self.memory.write_bytes(f"{name}/{MANIFEST_SUM_NAME}", digest)
        self.memory.write_bytes(f"{name}/{MANIFEST_NAME}", manifest)

    def _replicate(self, source: int, files: list[tuple[str, FileRecord]]) -> None:
        """Copy node `source`'s files into this node's folder, each checked against its
        manifest record (runs on a thread)."""
        assert isinstance(self.reader, NodeMemoryBackend)
        peer = self.reader.peers[self._peer_nodes.index(source)]
        started = time.perf_counter()
        try:
            for path, record in files:
                self.reader.fetch(peer, path, record)
        except Exception as exc:
            logger.warning("memory tier: replicating node %d's files into node %d failed "
                           "(%s); a loss of node %d now restores from storage.url", source,
                           self.node, exc, source)
            return
        logger.debug("memory tier: replicated %d file(s) of node %d in %.2f s", len(files),
                     source, time.perf_counter() - started)

    def _join_replica(self) -> None:
        if self._replica is not None:
            self._replica.join()
            self._replica = None

    def _in_flight(self) -> bool:
        return self._drain is not None and not self._drain.done()

    def _retain_memory(self, saved: str, held: str | None) -> None:
        """Keep the newest keep_last memory checkpoints and the one a drain reads, on a
        thread: freeing tmpfs pages costs about as much as writing them (measured: unlinking
        a 0.5 GB checkpoint took longer than a third of its save), and the loop need not
        wait for it. The next save, a restore and close() wait for it."""
        keep = SaveSpec(keep_last=self.tiers.memory.keep_last)
        replica = self._replica  # it writes into the checkpoints retention may delete

        def retain() -> None:
            if replica is not None:
                replica.join()
            try:
                apply_retention(self.memory, keep, held or saved)
            except Exception as exc:  # the save is committed: retry at the next save
                logger.warning("memory retention in %s failed (%s); the next save retries",
                               self.memory.url, exc)

        self._retention = threading.Thread(target=retain, name="statereg-retention",
                                           daemon=True)
        self._retention.start()

    def _join_retention(self) -> None:
        if self._retention is not None:
            self._retention.join()
            self._retention = None

    def _start_drain(self, name: str) -> None:
        if self._drainer is None:
            self._drainer = ThreadPoolExecutor(1, thread_name_prefix="statereg-drain")
        self._draining = name
        self._drain = self._drainer.submit(self._drain_one, name)

    def _drain_one(self, name: str) -> None:
        """Copy memory checkpoint `name` to storage.url (manifest last), then retention."""
        started = time.perf_counter()
        try:
            copy_checkpoint(self.reader, name, self.durable)
        except BaseException as exc:
            self._drain_error = exc
            logger.error("draining %s to %s failed: %s; the next due step drains again",
                         self.memory.display(name), self.durable.url, exc)
            raise
        self.drained.append(name)
        logger.info("drained %s to %s in %.2f s", name, self.durable.display(name),
                    time.perf_counter() - started)
        durable = self.tiers.durable
        if durable.keep_last is not None:
            try:
                apply_retention(self.durable, SaveSpec(keep_last=durable.keep_last,
                                                       keep_every=durable.keep_every), name)
            except Exception as exc:
                logger.warning("durable retention in %s failed (%s); the next drain retries",
                               self.durable.url, exc)

    def _join_drain(self) -> None:
        drain, self._drain = self._drain, None
        if drain is not None:
            drain.exception()  # logged by the drain itself; wait() reports it

    def wait(self) -> None:
        """Block until the drain in flight is committed (and memory retention is done);
        raise if a drain failed since the last wait (the memory checkpoints are intact: only
        the durable copy is missing)."""
        self._saver.wait()
        self._join_drain()
        self._join_retention()
        error, self._drain_error = self._drain_error, None
        if error is not None:
            raise StateregError(f"a drain to {self.durable.url} failed: {error}; the memory "
                                "tier holds the checkpoint, the next due step drains again"
                                ) from error

    def close(self) -> None:
        """Finish the drain in flight and stop its thread; on several nodes (collective),
        stop serving this node's folder once rank 0's drain no longer reads it."""
        try:
            self.wait()
        finally:
            self._saver.close()
            if self._drainer is not None:
                self._drainer.shutdown()
                self._drainer = None
            self._join_replica()
            self._join_retention()
            if self.leads and isinstance(self.memory, SharedMemoryBackend):
                self.memory.drop_recycled()  # nothing saves here any more: free its pages
                self.memory.release()
            if self.nodes.count > 1:
                self.world.all_gather(None)  # every rank's drain and replica is done
                if self._server is not None:
                    self._server.close()
                    self._server = None

    # -- restoring ----------------------------------------------------------------------

    def inventory(self) -> dict[int, tuple[dict[str, int] | None, dict[str, int]]]:
        """This node's folder, step by step: the files its manifest lists, with their sizes
        (None when this node holds no manifest of that step that reads), and the files
        present, with their sizes. Paths are from the root (`step_N/...`)."""
        # Every readable manifest, also one whose files are missing here (a peer may hold
        # them): list_committed would skip it.
        committed = {c.step: c for c in scan_root(self.memory).committed}
        found: dict[int, tuple[dict[str, int] | None, dict[str, int]]] = {}
        for entry in self.memory.list_dir(""):
            step = step_of(entry)
            if step is None:
                continue
            present = {f.path: f.size for f in self.memory.walk(entry)}
            known = committed.get(step)
            need = (None if known is None
                    else {f"{entry}/{r.path}": r.size for r in known.manifest.files})
            found[step] = (need, present)
        return found

    def _other_identities(self) -> list[str]:
        """Identity folders of other jobs under shm://<run_id> on this node."""
        mine = identity_folder(self.identity)
        base = open_backend(self.run_url)
        return sorted(n for n in base.list_dir("") if n != mine and n.startswith("ws"))

    def nearest(self, unusable: frozenset[int] = frozenset(),
                ) -> tuple[StorageBackend, Committed] | None:
        """The memory copy to resume from, or None to resume from storage.url (collective).

        Each node's leader reports its folder's inventory; the newest step whose files the
        nodes hold between them (each at its recorded size) wins, unless storage.url lists a
        higher step that is committed (only then is a durable manifest read: zero bytes come
        from the durable tier otherwise). A rank reads what its node lacks from a peer.
        Steps in `unusable` (a load of them failed) are passed over.
        """
        mine: Any = None
        if self.leads:
            self._join_retention()
            mine, error = attempt(lambda: {step: found for step, found in self.inventory().items()
                                           if step not in unusable})
            if error is not None:
                logger.warning("memory tier %s unreadable on node %d (%s)", self.memory.url,
                               self.node, error)
                mine = {}
        everyone = self.world.all_gather(mine)
        decided: Any = None
        if self.world.rank == 0:
            folders = {self.nodes.of_rank[r]: inv for r, inv in enumerate(everyone)
                       if inv is not None}
            choice, holders = self._complete(folders)
            decided = (self._check_against_durable(choice, folders), holders)
        choice, holders = self.world.broadcast(decided)
        if choice is None:
            return None
        if isinstance(self.reader, NodeMemoryBackend):
            self.reader.holders = {
                path: (size, [self._peer_nodes.index(n) for n in nodes if n != self.node])
                for path, (size, nodes) in holders.items()}
            # Where some node lacks a file, ranks that need the same bytes have one of them
            # read (over HTTP if need be) and broadcast, as from remote storage; where every
            # node holds every file, each rank reads its own node's memory. The same on
            # every rank: holders are.
            every = set(range(self.nodes.count))
            self.reader.broadcast_reads = any(set(n) != every for _, n in holders.values())
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

    def _check_against_durable(self, choice: int | None,
                               folders: dict[int, Any]) -> int | None:
        """Rank 0: keep the memory step unless the durable tier has a newer committed one;
        say in one line why memory is not used."""
        if choice is None:
            held = {step for inv in folders.values() for step in inv}
            others = [] if held else self._other_identities()
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
            if _committed(self.durable, checkpoint_name(step)):
                logger.info("memory tier: step %d is older than step %d in %s; restoring "
                            "from the durable tier", choice, step, self.durable.url)
                return None
        return choice

    # -- on a signal --------------------------------------------------------------------

    def flush(self) -> tuple[str | None, bool]:
        """On a declared signal (engine/signals.py, rank 0): wait for the drain in flight,
        then drain the newest complete memory checkpoint now unless storage.url holds it.
        Returns its name (None when memory holds none) and whether this call copied it."""
        try:  # an async memory save in flight commits first (and starts its drain)
            self._saver.wait()
        except Exception as exc:
            logger.warning("the memory save in flight failed (%s); flushing the newest "
                           "complete memory checkpoint", exc)
        if self._drainer is not None:
            # Waits for the drain in flight, even when the signal came inside wait() or
            # close(), which took its future already.
            self._drainer.shutdown()
            self._drainer = None
        newest = list_committed(self.memory)
        if not newest:
            return None, False
        name = newest[-1].name
        if _committed(self.durable, name):
            return name, False
        self._drain_one(name)
        return name, True
