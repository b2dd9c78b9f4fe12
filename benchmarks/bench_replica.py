"""Restore after losing a node, from the peer replica, against a restore from the S3 server
(issue 16, docs/tiers.md). Run by hand (not a test):

    .venv/bin/python benchmarks/bench_replica.py --gb 0.25 --reps 3
    .venv/bin/python benchmarks/bench_replica.py --quick   # smoke test: a 2 MB state, 1 rep

Four real ranks on gloo play 2 nodes x 2 ranks ($STATEREG_NODE), each node's memory folder
under a fresh folder in /dev/shm, peers on 127.0.0.1. Every rank holds the same model and
AdamW state (sharing: replicated, as under DDP). Each rank:

1. saves step 1 to a plain root on moto's S3 server on 127.0.0.1 (the test suite's), and to
   the memory tier with `replicate: {to: next_node}` (storage.url of the tiered manager is an
   empty local folder that is never drained to, so nothing can be read from it);
2. restores from memory with both nodes' folders intact (`own node`);
3. after rank 0 deletes node 0's folder (a lost node), restores from memory again: ranks 0
   and 1 read everything from node 1's replica over HTTP (`peer replica`);
4. restores the S3 checkpoint (`load(step=1)` of the plain manager).

Each figure is the median over --reps of the slowest rank's `load()` time (a restore is done
when every rank is done). Before the ranks start, `transport GB/s` times the pieces alone, in
this process: one file of a rank's state size on tmpfs read into a buffer from tmpfs, and
from a PeerServer through a PeerBackend (median of 5). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from perfsuite.workload import linear_stack

import statereg
from statereg.tiers.node_memory import NodeMemoryBackend
from statereg.tiers.transport import PeerServer, open_peer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from storage_servers import new_bucket, s3_options, start_server

WORLD = 4
NEVER = 10**9


def _spec(url: str, options: dict[str, Any] | None = None,
          tiers: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "storage": {"url": url, "options": options or {}},
        "components": {"model": {"kind": "model", "sharing": "replicated"},
                       "optimizer": {"kind": "optimizer", "sharing": "replicated"}}}
    if tiers:
        spec["tiers"] = {"memory": {"every": 1, "keep_last": 2,
                                    "replicate": {"to": "next_node"}},
                         "durable": {"every": NEVER}}
    return spec


def _timed_load(mgr: statereg.CheckpointManager, **kwargs: Any) -> tuple[float, str]:
    dist.barrier()
    started = time.perf_counter()
    result = mgr.load(**kwargs)
    elapsed = time.perf_counter() - started
    assert result is not None
    slowest = [0.0] * WORLD
    dist.all_gather_object(slowest, elapsed)
    return max(slowest), result.path


def _rank(rank: int, args: argparse.Namespace, init: str, shm: str, durable: str,
          s3: tuple[str, dict[str, Any]], out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(STATEREG_SHM_DIR=shm, STATEREG_NODE=f"node{rank // 2}",
                      STATEREG_RUN_ID="bench-replica", STATEREG_PEER_HOST="127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD,
                            timeout=timedelta(minutes=10))
    torch.manual_seed(0)
    model, optimizer = linear_stack(args.gb, args.width)
    nbytes = sum(t.nbytes for t in model.state_dict().values())
    nbytes += sum(v.nbytes for s in optimizer.state.values() for v in s.values())
    plain = statereg.CheckpointManager(_spec(*s3), model=model, optimizer=optimizer)
    plain.save(1)
    with statereg.CheckpointManager(_spec(durable, tiers=True), model=model,
                                    optimizer=optimizer) as tiered:
        tiered.save(1)
    figures: dict[str, list[float]] = {"own node": [], "peer replica": [], "S3 server": []}
    for label in ("own node", "peer replica"):
        if label == "peer replica":
            dist.barrier()
            if rank == 0:
                shutil.rmtree(Path(shm) / f"statereg-{os.geteuid()}" / "node0")
            dist.barrier()
        for _ in range(args.reps):
            with statereg.CheckpointManager(_spec(durable, tiers=True), model=model,
                                            optimizer=optimizer) as mgr:
                seconds, path = _timed_load(mgr)
            assert path.startswith("shm://"), path
            figures[label].append(seconds)
    for _ in range(args.reps):
        seconds, _ = _timed_load(plain, step=1)
        figures["S3 server"].append(seconds)
    assert not any(Path(durable).glob("step_*")), "storage.url of the tiered job was written"
    if rank == 0:
        medians = {k: statistics.median(v) for k, v in figures.items()}
        Path(out).write_text(json.dumps({
            "state_bytes_per_rank": nbytes, "ranks": WORLD, "nodes": 2, "reps": args.reps,
            "seconds": medians, "all": figures,
            "peer replica vs S3": medians["S3 server"] / medians["peer replica"],
            "own node vs S3": medians["S3 server"] / medians["own node"],
            "bytes read from storage.url during memory restores": 0,
        }, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def _transport(nbytes: int, shm: str) -> dict[str, float]:
    """GB/s of one `nbytes` file read into a buffer: from tmpfs, and from a peer's server."""
    os.environ.update(STATEREG_SHM_DIR=shm, STATEREG_NODE="transport",
                      STATEREG_PEER_HOST="127.0.0.1")
    folder = NodeMemoryBackend("shm://transport")
    folder.write_bytes("data.bin", bytes(nbytes))
    server = PeerServer(folder)
    peer = open_peer(server.url, server.secret)
    buffer = memoryview(bytearray(nbytes))

    def from_tmpfs() -> int:
        with folder.open_read("data.bin") as stream:
            return stream.readinto(buffer)

    def from_peer() -> int:
        with peer.open_ranges("data.bin", [(0, nbytes)], nbytes) as stream:
            return stream.readinto(buffer)

    rates = {}
    try:
        for label, read in (("tmpfs", from_tmpfs), ("peer over HTTP", from_peer)):
            seconds = []
            for _ in range(5):
                started = time.perf_counter()
                assert read() == nbytes
                seconds.append(time.perf_counter() - started)
            rates[label] = nbytes / statistics.median(seconds) / 1e9
    finally:
        server.close()
        shutil.rmtree(Path(shm) / "statereg", ignore_errors=True)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=0.25, help="model+AdamW state per rank")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: a 2 MB state of narrow layers, one repetition")
    args = parser.parse_args()
    # Ranks fork from one server that imported torch once (outside every measured window).
    mp.set_forkserver_preload(["torch", "torch.distributed"])
    args.width = 2048
    if args.quick:
        args.gb, args.reps, args.width = 0.002, 1, 256
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    shm = tempfile.mkdtemp(prefix="statereg-bench-replica-", dir=base)
    work = Path(tempfile.mkdtemp(prefix="statereg-bench-replica-"))
    import fsspec

    transport = _transport(int(args.gb * 1e9), shm)

    server = start_server("moto_server", ["-m", "moto.server", "-H", "127.0.0.1", "-p",
                                          "{port}"], work, "/moto-api/")
    try:
        options = s3_options(server.endpoint)
        bucket = new_bucket(fsspec.filesystem("s3", skip_instance_cache=True, **options))
        out = work / "result.json"
        mp.start_processes(_rank, args=(args, str(work / "pg-init"), shm, str(work / "durable"),
                                        (f"s3://{bucket}", options), str(out)),
                           nprocs=WORLD, join=True, start_method="forkserver")
        result = json.loads(out.read_text())
        print(json.dumps({**result, "transport GB/s": transport}, indent=1))
    finally:
        server.stop()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
