"""Memory tiers over several nodes (docs/tiers.md): 2 simulated nodes x 2 ranks on real gloo
groups, one shared-memory folder per node ($STATEREG_NODE), peers reached over 127.0.0.1.

- With `replicate`, each node's folder holds its peer's files too: losing one node's folder
  restores from the replica, bit-identically, and storage.url holds no checkpoint at all (so
  not one byte could come from it).
- Without it, ranks read what their node lacks from the other node (rank 0's files live on
  node 0 only), and a lost node restores from storage.url.
- While a live process holds one node's folder, a second job of the same identity is
  refused on every rank at construction, and neither node's folder changes.
- A job killed while a replica is being written (SIGKILL at a random replica copy, at its
  start or its end) resumes bit-identically from the newest copy the folders hold whole.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import tier_trainee
import torch
import torch.distributed as dist

import statereg
from statereg.engine.verify import verify_files
from tests.distributed.harness import run_ranks

STEPS = 4
# This user's folder of memory roots under the shared-memory folder (backends/shm.py).
PRIVATE = f"statereg-{os.geteuid()}"


class Cursor:
    """A per-rank object: each rank's own position, which must come back to that rank."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


def _spec(durable: str, replicate: bool, drain_every: int) -> dict[str, Any]:
    memory: dict[str, Any] = {"every": 1, "keep_last": 2}
    if replicate:
        memory["replicate"] = {"to": "next_node"}
    return {"storage": {"url": durable},
            "components": {"model": {"kind": "model", "sharing": "replicated"},
                           "optimizer": {"kind": "optimizer", "sharing": "replicated"},
                           "cursor": {"kind": "custom", "sharing": "per_rank"}},
            "tiers": {"memory": memory, "durable": {"every": drain_every}}}


class Trainee(tier_trainee.Trainee):
    """The shared trainee, larger, with a per-rank data cursor."""

    def __init__(self, rank: int, seed: int = 0) -> None:
        super().__init__(width=16, hidden=32, rows=8, seed=seed)
        self.cursor = Cursor(1000 * rank)

    def step(self, step: int) -> None:
        super().step(step)
        self.cursor.value += 1

    def manager(self, spec: dict[str, Any]) -> statereg.CheckpointManager:  # type: ignore[override]
        return super().manager(spec, cursor=self.cursor)


def _on_node(rank: int, shm: Path, per_node: int = 2) -> None:
    os.environ.update(STATEREG_SHM_DIR=str(shm), STATEREG_NODE=f"node{rank // per_node}",
                      STATEREG_RUN_ID="replica-drill", STATEREG_PEER_HOST="127.0.0.1")


def _train_and_save(rank: int, spec: dict[str, Any]) -> Trainee:
    trainee = Trainee(rank)
    with trainee.manager(spec) as mgr:
        for step in range(1, STEPS + 1):
            trainee.step(step)
            mgr.save(step)
    return trainee


def _restore(rank: int, spec: dict[str, Any], expected: Trainee) -> statereg.LoadResult | None:
    fresh = Trainee(rank, seed=99)
    with fresh.manager(spec) as mgr:
        result = mgr.load()
    if result is not None:
        got = fresh.tensors()
        for key, value in expected.tensors().items():
            assert torch.equal(got[key], value), key
        assert fresh.cursor.value == expected.cursor.value
    return result


def _lose_node(rank: int, shm: Path, node: str) -> None:
    """Node `node`'s memory is gone (a reboot, a new host), seen by every rank at once."""
    dist.barrier()
    if rank == 0:
        shutil.rmtree(shm / PRIVATE / node)
    dist.barrier()


def reference(rank: int, steps: int = STEPS) -> Trainee:
    """The state after `steps` steps, trained again without a manager (the same bits)."""
    trainee = Trainee(rank)
    for step in range(1, steps + 1):
        trainee.step(step)
    return trainee


def replica_save(rank: int, world: int, shm: Path, durable: str, out: Path) -> None:
    _on_node(rank, shm)
    spec = _spec(durable, replicate=True, drain_every=100)  # never drained
    # Async: the manifest sharing and the replica start on every rank's save thread (the
    # other drills save synchronously).
    spec["save"] = {"async": "thread"}
    _train_and_save(rank, spec)


def replica_restore(rank: int, world: int, shm: Path, durable: str, out: Path) -> None:
    _on_node(rank, shm)
    result = _restore(rank, _spec(durable, replicate=True, drain_every=100), reference(rank))
    assert result is not None and result.step == STEPS
    assert result.path.startswith("shm://replica-drill/"), result.path


def test_a_lost_node_restores_from_its_peer_replica_bit_identically(tmp_path: Path) -> None:
    shm, durable = tmp_path / "shm", tmp_path / "durable"
    shm.mkdir()
    run_ranks(4, replica_save, tmp_path, shm, str(durable), tmp_path)
    # Both folders hold every file of the newest step: their own and their peer's.
    listing = {node: sorted(str(p.relative_to(shm / PRIVATE / node))
                            for p in (shm / PRIVATE / node).rglob("step_00000004/*/*"))
               for node in ("node0", "node1")}
    assert listing["node0"] == listing["node1"]
    assert any(p.endswith("/cursor/rank_00003.json") for p in listing["node0"])
    assert any(p.endswith("/cursor/rank_00000.json") for p in listing["node1"])
    assert not any(".tmp-" in p for p in listing["node1"])
    # Node 0 is lost (a new host in its place), and the job restarts: new processes.
    shutil.rmtree(shm / PRIVATE / "node0")
    run_ranks(4, replica_restore, tmp_path, shm, str(durable), tmp_path)
    # storage.url never received a checkpoint: the restore read nothing from it.
    assert not durable.exists() or not any(durable.glob("step_*"))
    assert not list((shm / PRIVATE / "node0").rglob("step_*"))


def peers_drill(rank: int, world: int, shm: Path, durable: str, out: Path) -> None:
    _on_node(rank, shm)
    spec = _spec(durable, replicate=False, drain_every=2)
    trained = _train_and_save(rank, spec)
    node1 = shm / PRIVATE / "node1"
    dist.barrier()
    # Node 1 holds only what its ranks wrote (and the manifest), not rank 0's cursor or
    # rank 0's share of the model...
    mine = {p.name for p in node1.rglob("step_00000004/*/*")}
    assert "rank_00002.json" in mine and "rank_00000.json" not in mine, mine
    # ...yet every rank restores step 4 from memory, reading what it lacks from node 0.
    result = _restore(rank, spec, trained)
    assert result is not None and result.step == STEPS
    assert result.path.startswith("shm://replica-drill/"), result.path
    # Without a replica, a lost node leaves step 4 incomplete: storage.url's step 4 loads.
    _lose_node(rank, shm, "node0")
    handler = logging.FileHandler(out / f"log-{rank}.txt")
    logging.getLogger("statereg").addHandler(handler)
    try:
        result = _restore(rank, spec, trained)
    finally:
        logging.getLogger("statereg").removeHandler(handler)
    assert result is not None and result.step == STEPS
    assert result.path == f"{durable}/step_00000004", result.path


def test_without_replica_ranks_read_other_nodes_and_a_lost_node_uses_storage(
        tmp_path: Path) -> None:
    shm, durable = tmp_path / "shm", tmp_path / "durable"
    shm.mkdir()
    run_ranks(4, peers_drill, tmp_path, shm, str(durable), tmp_path)
    log = (tmp_path / "log-0.txt").read_text()
    assert "step_00000004 skipped: " in log and "missing or of the wrong size on every node" in log


def save_steps(rank: int, world: int, shm: Path, durable: str) -> None:
    _on_node(rank, shm, per_node=1)
    _train_and_save(rank, _spec(durable, replicate=False, drain_every=100))


def refused_while_node1_is_held(rank: int, world: int, shm: Path, durable: str,
                                holder: int) -> None:
    """Another live process holds node 1's folder: both ranks are refused at construction
    (node 1's leader by the lock, rank 0 by the agreement), and rank 0 lets go of node 0's."""
    from statereg.errors import StateregError
    from statereg.tiers.lock import JobLock

    _on_node(rank, shm, per_node=1)
    with pytest.raises(StateregError) as refused:
        Trainee(rank).manager(_spec(durable, replicate=False, drain_every=100))
    if rank == 1:
        assert "is in use by another live job on this node" in str(refused.value)
        assert f'"pid": {holder}' in str(refused.value)
    if rank == 0:  # it let go of node 0's folder: the lock is free again in this process
        folder = next((shm / PRIVATE / "node0" / "replica-drill").glob("ws2-*"))
        probe = JobLock(str(folder), "node 0's folder")
        probe.acquire()
        assert probe.held
        probe.release()


HOLD = """
import fcntl, json, os, sys, time

fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
os.ftruncate(fd, 0)
os.pwrite(fd, json.dumps({"pid": os.getpid()}).encode(), 0)  # as a live job's manager does
print("held", flush=True)
time.sleep(600)
"""


def test_a_second_job_on_several_nodes_is_refused_on_every_rank_and_writes_nothing(
        tmp_path: Path) -> None:
    """Two 2-node jobs of one identity: while a live process holds node 1's memory folder,
    the second job's construction fails on every rank, and neither node's folder changes."""
    shm, durable = tmp_path / "shm", tmp_path / "durable"
    shm.mkdir()
    run_ranks(2, save_steps, tmp_path, shm, str(durable))
    folders = {node: next((shm / PRIVATE / node / "replica-drill").glob("ws2-*"))
               for node in ("node0", "node1")}
    before = {node: sorted(str(p) for p in folder.rglob("*")) for node, folder in folders.items()}
    with subprocess.Popen([sys.executable, "-c", HOLD, str(folders["node1"] / "job.lock")],
                          stdout=subprocess.PIPE, text=True) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline() == "held\n"
            run_ranks(2, refused_while_node1_is_held, tmp_path, shm, str(durable),
                      holder.pid)
        finally:
            holder.kill()
    after = {node: sorted(str(p) for p in folder.rglob("*")) for node, folder in folders.items()}
    assert after == before


@pytest.mark.parametrize("replicate", [True, False])
def test_the_memory_math_counts_the_peer_replica(replicate: bool) -> None:
    from statereg.tiers.identity import SMALL_FILES_BYTES, Nodes, node_bytes

    nodes = Nodes.from_names(["a", "a", "b", "b", "c", "c"])
    per_rank = [10, 20, 30, 40, 50, 60]
    own = 50 + 60
    held = own + (30 + 40 if replicate else 0)  # node c holds node b's files
    assert node_bytes(nodes, per_rank, 2, replicate) == held + SMALL_FILES_BYTES
    assert nodes.previous(0) == 2 and nodes.leader(1) == 2 and nodes.count == 3


# -- SIGKILL during a replica copy ----------------------------------------------------------

KILL_STEPS = 6


def _arm(kill_at: int, at_end: bool) -> None:
    """Die by SIGKILL in the `kill_at`-th replica copy of this process: as it starts, or
    with the whole file copied (and verified) under its temporary name (before the rename)."""
    from statereg.tiers import node_memory as peers

    real = peers.verify_stream
    calls = [0]

    def verify_stream(where: str, record: Any, source: Any, sink: Any) -> None:
        calls[0] += 1
        if calls[0] == kill_at:
            if at_end:
                real(where, record, source, sink)
            else:
                sink(source.read(1 + record.size // 2))
            sink.__self__.flush()  # sink is the temporary file's write
            os.kill(os.getpid(), signal.SIGKILL)
        real(where, record, source, sink)

    peers.verify_stream = verify_stream  # type: ignore[assignment]


def replica_job(rank: int, init: str, shm: str, durable: str, out: str,
                kill_at: int | None, at_end: bool) -> None:
    """One rank of a 2-node job (one rank per node) that resumes, then saves to KILL_STEPS."""
    torch.set_num_threads(1)
    _on_node(rank, Path(shm), per_node=1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    if kill_at is not None and rank == 1:
        _arm(kill_at, at_end)
    spec = _spec(durable, replicate=True, drain_every=3)
    trainee = Trainee(rank)  # a resume overwrites it: untrained, it differs from any step
    mgr = trainee.manager(spec)
    result = mgr.load()
    start = 0 if result is None else result.step
    expected = reference(rank, start)
    got = trainee.tensors()
    if start:
        for key, value in expected.tensors().items():
            assert torch.equal(got[key], value), key
        assert trainee.cursor.value == expected.cursor.value
    Path(out, f"resumed-{rank}").write_text(str(start))
    for step in range(start + 1, KILL_STEPS + 1):
        trainee.step(step)
        mgr.save(step)
    mgr.close()
    final = reference(rank, KILL_STEPS)
    for key, value in final.tensors().items():
        assert torch.equal(trainee.tensors()[key], value), key
    dist.barrier()
    dist.destroy_process_group()


def _run_job(base: Path, run: str, kill_at: int | None, at_end: bool) -> list[int | None]:
    """Start both ranks; when rank 1 dies, kill rank 0 too (as torchrun would)."""
    from tests.reliability.reliability_kit import forkserver

    context = forkserver()
    ranks = [context.Process(target=replica_job,
                             args=(r, str(base / f"pg-{run}"), str(base / "shm"),
                                   str(base / "durable"), str(base), kill_at, at_end))
             for r in (0, 1)]
    for process in ranks:
        process.start()
    ranks[1].join(120)
    if ranks[1].exitcode == -signal.SIGKILL:
        ranks[0].kill()
    ranks[0].join(120)
    for process in ranks:
        if process.exitcode is None:
            process.kill()
            process.join()
    return [p.exitcode for p in ranks]


def _newest_whole(base: Path) -> int:
    """The newest step the two node folders hold whole between them, or storage.url holds."""
    from statereg.backends.registry import open_backend
    from statereg.engine.checkpoints import list_committed, scan_root

    folders = [open_backend(str(f)) for f in (base / "shm" / PRIVATE).glob("node*/*/ws*")]
    best = 0
    for folder in folders:
        # By manifests: a folder lacks the files the other node holds, which list() skips.
        for committed in scan_root(folder).committed:
            held = {f.path: f.size for other in folders for f in other.walk(committed.name)}
            if all(held.get(f"{committed.name}/{r.path}") == r.size
                   for r in committed.manifest.files):
                best = max(best, committed.step)
    durable = open_backend(str(base / "durable"))
    for committed in list_committed(durable):
        verify_files(durable, committed.name, committed.manifest.files, "full")
        best = max(best, committed.step)
    return best


def test_sigkill_during_a_replica_copy_resumes_from_the_newest_whole_copy(
        tmp_path: Path) -> None:
    seed = int(os.environ.get("STATEREG_DRILL_SEED", random.randrange(10**6)))
    rng = random.Random(seed)
    # About 5 replica copies per memory save (rank 0's DCP files, .metadata, its cursor).
    points = [(rng.randint(1, 5 * (KILL_STEPS - 1)), rng.random() < 0.5) for _ in range(3)]
    print(f"replica kill drill: seed {seed} (STATEREG_DRILL_SEED replays), points {points}")
    for number, (kill_at, at_end) in enumerate(points):
        where = f"seed {seed}, point {number}: copy {kill_at}, {'end' if at_end else 'start'}"
        base = tmp_path / f"point{number}"
        (base / "shm").mkdir(parents=True)
        codes = _run_job(base, "killed", kill_at, at_end)
        assert codes[1] == -signal.SIGKILL, (where, codes)
        newest = _newest_whole(base)
        assert _run_job(base, "resumed", None, False) == [0, 0], where
        for rank in (0, 1):
            assert int((base / f"resumed-{rank}").read_text()) == newest, where
