"""Memory-first tiers: save often into shared memory, drain some saves to storage.url, and
resume from the nearest complete copy (docs/tiers.md).

    save(step) -> memory due?  Saver on the memory root (same protocol: manifest last)
               -> memory retention (keep_last, never the checkpoint a drain is reading)
               -> durable due? rank 0 drains it on a thread: copy_checkpoint(memory -> storage.url),
                               which commits manifest last, then durable retention
    load()     -> nearest(): the newest step complete in memory on every rank, unless
                  storage.url names a newer committed step (read only then)

The memory root is `shm://<run_id>/<identity>`: the identity folder names the job (world
size, each rank's node, its groups, storage.url), so a job never adopts another job's files.
Every rank of a job must share one memory folder (one node); a job spread over several nodes
is refused at construction (the peer replica of issue 16 is not built yet).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from statereg.backends.base import StorageBackend
from statereg.backends.registry import open_backend
from statereg.backends.shm import SharedMemoryBackend, node_name
from statereg.engine.checkpoints import (
    Committed,
    checkpoint_name,
    list_committed,
    read_manifest_at,
    step_of,
)
from statereg.engine.copy import copy_checkpoint
from statereg.engine.plan import RankPlan, compile_plan
from statereg.engine.retention import apply_retention
from statereg.engine.saver import SaveHandle, Saver
from statereg.engine.world import World, attempt
from statereg.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ManifestError,
    SpecError,
    StateregError,
)
from statereg.schemas.spec import RegistrySpec, SaveSpec
from statereg.state.protocols import TensorState

logger = logging.getLogger("statereg")

RUN_ID_ENV = "STATEREG_RUN_ID"
IDENTITY_NAME = "identity.json"
# Room for what is not a tensor (manifests, JSON state, DCP metadata) in the memory math.
_SMALL_FILES = 16 * 1024 * 1024
_SAFE = re.compile(r"[^A-Za-z0-9_.\-]")


def _committed(backend: StorageBackend, name: str) -> bool:
    """Whether `name` under `backend` is a committed checkpoint that would load."""
    try:
        read_manifest_at(backend, name)
    except (CheckpointNotFoundError, ManifestError, CorruptCheckpointError):
        return False
    return True


def run_id(spec: RegistrySpec) -> str:
    """$STATEREG_RUN_ID, else `run-` and a digest of storage.url (a run is its durable root:
    a restarted job with the same storage.url finds its memory checkpoints again)."""
    given = os.environ.get(RUN_ID_ENV)
    if given:
        return _SAFE.sub("_", given)
    return "run-" + hashlib.sha256(spec.storage.url.encode()).hexdigest()[:12]


def job_identity(spec: RegistrySpec, world: World, nodes: list[str]) -> dict[str, Any]:
    """What binds a memory folder to one job: its run, world size, each rank's node, its
    named groups, and its durable root. Any difference is another job."""
    return {"run_id": run_id(spec), "world_size": world.size, "nodes": nodes,
            "groups": {k: [list(c) for c in v] for k, v in sorted(world.layout.groups.items())},
            "storage": spec.storage.url}


def identity_folder(identity: dict[str, Any]) -> str:
    """`ws<N>-<digest>`: the folder of one job identity under shm://<run_id>."""
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return f"ws{identity['world_size']}-{digest}"


def state_bytes(spec: RegistrySpec, world: World, adapters: dict[str, Any]) -> int:
    """Bytes one checkpoint of the live state takes, summed over every rank (collective)."""
    sizes = {}
    for name, adapter in adapters.items():
        if isinstance(adapter, TensorState):
            tensors = adapter.capture().tensors
            sizes[name] = [(key, t.numel() * t.element_size()) for key, t in tensors.items()]
    plan = compile_plan(spec, world.layout, None, sizes)
    mine = sum(t.nbytes or 0 for t in plan.tasks if t.takes_part)
    return sum(world.all_gather(mine)) + _SMALL_FILES


class TierEngine:
    """The tiers of one run: a Saver on the memory root, the drain thread, and restore."""

    def __init__(self, spec: RegistrySpec, durable: StorageBackend, world: World,
                 adapters: dict[str, Any]) -> None:
        assert spec.tiers is not None
        self.spec = spec
        self.tiers = spec.tiers
        self.durable = durable
        self.world = world
        nodes = world.all_gather(node_name())
        if len(set(nodes)) > 1:
            named = ", ".join(sorted(set(nodes)))
            raise SpecError(
                f"tiers.memory: the ranks run on {len(set(nodes))} nodes ({named}); "
                "a memory tier over several nodes needs the peer replica of issue 16, which is "
                "not built yet: run on one node, or remove 'tiers' (docs/tiers.md)"
            )
        self.identity = job_identity(spec, world, nodes)
        self.run_url = self.tiers.memory.url.replace("{run_id}", self.identity["run_id"])
        self.memory = open_backend(f"{self.run_url}/{identity_folder(self.identity)}")
        needed = (self.tiers.memory.keep_last + 1) * state_bytes(spec, world, adapters)
        _, error = attempt(self._prepare_memory, needed)
        world.agree(error, f"opening the memory tier {self.memory.url}")
        self._saver = Saver(spec, self.memory, world)
        self._drainer: ThreadPoolExecutor | None = None
        self._drain: Future[None] | None = None
        self._draining: str | None = None  # the memory checkpoint the drain reads
        self._drain_error: BaseException | None = None
        self.drained: list[str] = []  # checkpoints this process drained, in order

    def _prepare_memory(self, needed: int) -> None:
        """Refuse a tmpfs too small for keep_last + 1 checkpoints; record the identity."""
        memory = self.memory
        if isinstance(memory, SharedMemoryBackend):
            memory.check_room(needed, f"tiers.memory.keep_last {self.tiers.memory.keep_last} "
                                      "checkpoints of this state plus the one being written")
        if self.world.rank == 0 and not memory.exists(IDENTITY_NAME):
            memory.write_bytes(IDENTITY_NAME, json.dumps(self.identity, indent=1).encode())

    # -- saving -------------------------------------------------------------------------

    def due(self, step: int) -> tuple[bool, bool]:
        """Whether step is due for the memory tier and for the durable tier."""
        return step % self.tiers.memory.every == 0, step % self.tiers.durable.every == 0

    def save(self, plan: RankPlan, adapters: dict[str, Any], step: int,
             tokens_seen: int | None, extra: dict[str, Any] | None) -> SaveHandle | None:
        """Save `step` to memory if due, then start its drain if due; None if no tier is due."""
        to_memory, to_durable = self.due(step) if isinstance(step, int) else (True, False)
        if not to_memory:
            return None
        name = checkpoint_name(step)
        if to_durable and self.world.rank == 0 and self._in_flight():
            if self.tiers.memory.drain == "skip":
                logger.warning("the drain of %s is still running: step %d is not drained "
                               "(tiers.memory.drain: skip)", self._draining, step)
                to_durable = False
            else:
                self._join_drain()
        handle = self._saver.save(plan, adapters, step, tokens_seen, extra)
        if self.world.rank == 0:
            self._retain_memory(name)
            if to_durable:
                self._start_drain(name)
        return handle

    def _in_flight(self) -> bool:
        return self._drain is not None and not self._drain.done()

    def _retain_memory(self, saved: str) -> None:
        """Keep the newest keep_last memory checkpoints and the one a drain reads."""
        keep = SaveSpec(keep_last=self.tiers.memory.keep_last)
        held = self._draining if self._in_flight() else saved
        try:
            apply_retention(self.memory, keep, held)
        except Exception as exc:  # the save is committed: retry at the next save
            logger.warning("memory retention in %s failed (%s); the next save retries",
                           self.memory.url, exc)

    def _start_drain(self, name: str) -> None:
        if self._drainer is None:
            self._drainer = ThreadPoolExecutor(1, thread_name_prefix="statereg-drain")
        self._draining = name
        self._drain = self._drainer.submit(self._drain_one, name)

    def _drain_one(self, name: str) -> None:
        """Copy memory checkpoint `name` to storage.url (manifest last), then retention."""
        started = time.perf_counter()
        try:
            copy_checkpoint(self.memory, name, self.durable)
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
        """Block until the drain in flight is committed; raise if a drain failed since the
        last wait (the memory checkpoints are intact: only the durable copy is missing)."""
        self._join_drain()
        error, self._drain_error = self._drain_error, None
        if error is not None:
            raise StateregError(f"a drain to {self.durable.url} failed: {error}; the memory "
                                "tier holds the checkpoint, the next due step drains again"
                                ) from error

    def close(self) -> None:
        """Finish the drain in flight and stop its thread."""
        try:
            self.wait()
        finally:
            self._saver.close()
            if self._drainer is not None:
                self._drainer.shutdown()
                self._drainer = None

    # -- restoring ----------------------------------------------------------------------

    def memory_steps(self) -> dict[int, str]:
        """Steps this rank finds complete in memory: manifest matching manifest.sum, every
        file present at its recorded size (bytes are checked as they load). Step -> name."""
        found: dict[int, str] = {}
        for committed in list_committed(self.memory):
            sizes = {f.path: f.size for f in self.memory.walk(committed.name)}
            damaged = [r.path for r in committed.manifest.files
                       if sizes.get(f"{committed.name}/{r.path}") != r.size]
            if damaged:
                logger.warning("memory tier: %s skipped: %d file(s) missing or of the wrong "
                               "size (first: %s)", self.memory.display(committed.name),
                               len(damaged), damaged[0])
                continue
            found[committed.step] = committed.name
        return found

    def _other_identities(self) -> list[str]:
        """Identity folders of other jobs under shm://<run_id> on this node."""
        mine = identity_folder(self.identity)
        base = open_backend(self.run_url)
        return sorted(n for n in base.list_dir("") if n != mine and n.startswith("ws"))

    def nearest(self) -> tuple[StorageBackend, Committed] | None:
        """The memory copy to resume from, or None to resume from storage.url (collective).

        Every rank reports the steps complete in its memory; the newest step all ranks hold
        wins, unless storage.url lists a higher step that is committed (only then is a
        durable manifest read: zero bytes come from the durable tier otherwise).
        """
        mine, error = attempt(self.memory_steps)
        if error is not None:
            logger.warning("memory tier %s unreadable (%s): restoring from %s",
                           self.memory.url, error, self.durable.url)
            mine = {}
        everyone = self.world.all_gather(sorted(mine))
        common = set(everyone[0]).intersection(*everyone[1:])
        choice = max(common) if common else None
        if self.world.rank == 0:
            choice = self._check_against_durable(choice, everyone)
        choice = self.world.broadcast(choice)
        if choice is None:
            return None
        name = checkpoint_name(choice)
        return self.memory, Committed(name, read_manifest_at(self.memory, name))

    def _check_against_durable(self, choice: int | None,
                               everyone: list[list[int]]) -> int | None:
        """Rank 0: keep the memory step unless the durable tier has a newer committed one;
        say in one line why memory is not used."""
        if choice is None:
            held = set().union(*map(set, everyone))
            others = [] if held else self._other_identities()
            if held:
                missing = {r for r, steps in enumerate(everyone) if max(held) not in steps}
                why = f"step {max(held)} is not complete on rank(s) {sorted(missing)}"
            elif others:
                why = (f"it holds only checkpoints of other job identities "
                       f"({', '.join(others)}; this job is "
                       f"{identity_folder(self.identity)}: world size {self.world.size}, "
                       f"nodes {sorted(set(self.identity['nodes']))}), which are never loaded")
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

