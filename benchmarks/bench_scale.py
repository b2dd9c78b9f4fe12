"""Coordination at scale without a cluster: what one save and one load of an N-rank job cost,
for N = 8, 16, ..., 4096, from statereg's real planning and commit code, with no process per rank.

What it measures (re-run it unchanged to compare a later tree; the model follows the code
path of the tree measured in docs/performance.md: where the engine's load or save path
changes what a rank reads or which collectives it calls, change SAVE_COLLECTIVES /
LOAD_COLLECTIVES, the `ledger` calls of simulate_saves / simulate_load and rank_load to
match; benchmarks/bench_coordination.py and tests/distributed/test_save_coordination.py
count the real collectives per save and per load to check against):

- The job: `model` and `optimizer` sharded over all ranks as FSDP does it (every tensor split
  along dim 0, one chunk per rank: `--tensors` model tensors, twice as many optimizer
  moments), a global `scheduler`, per-rank `dataloader` and `rng`, on a counting in-memory
  backend (statereg's memory backend; every storage operation is one request).
- First save, for every rank: its plan (engine/plan.py compile_plan), its DCP local save plan
  (the WriteItems DCP makes for a DTensor shard, built directly: no DTensor, no tensor data)
  and the storage writer's local step; then the coordinator's global plan
  (StateregSavePlanner.create_global_plan, BackendWriter.prepare_global_plan) and `.metadata`
  (BackendWriter.finish, from each rank's write results); every rank's files (a placeholder
  of 64 bytes per DCP data file: the request count is the real one, not the byte count);
  the claim, the manifest (engine/save_steps.py build_manifest), the commit (publish.commit) and
  retention, all real and counted.
- Later save (the next step, same shapes): what layouts/dcp.py SavePlans does when every
  rank's plan digest is unchanged: no DCP collective; each rank's write results packed
  (pack_results, ItemReports.to_send: digests only) travel to rank 0 with its file reports,
  and rank 0 writes `.metadata` from the kept global metadata (unpack_results,
  BackendWriter.finish); then the same files, claim, manifest, commit and retention.
- Load, per rank, what engine/load.py, the layouts and CheckpointManager._resolve make a
  rank do: rank 0 lists the root and reads the manifest, checks sizes from one listing, and
  reads what every rank needs alike (each DCP `.metadata` and sidecar, the global
  scheduler's file) through the verifying reader; every rank compiles its load plan
  (compile_load), parses the `.metadata` it received (GroupReader.read_metadata, the real
  class), reads its own per-rank files and plans its reads (DCP's resharding helper over
  its own chunk); data reads are counted from that read plan (one GET per file a rank
  reads items from). Rank 0 and up to `--sample` other ranks run it for real; the others'
  figures are the sample's mean (their work differs only in the names of their own files).
- Messages: collectives are not run; each one a real job calls is recorded where the code
  calls it (SAVE_COLLECTIVES, LOAD_COLLECTIVES name the file and function), with the real
  pickled payloads (summaries, plan digests, local plans, global plans, write results,
  item reports, `.metadata`, file reports, manifest), and costed as torch.distributed moves
  them over gloo (Ledger says how). "bytes into another rank" is what one rank other than 0
  receives: the figure that must not grow with the job for coordination to stay flat.
- Seconds are CPU seconds of this process (time.process_time): other jobs share the cores,
  and a wall clock would measure them.
- Growth exponent: the least-squares slope of log(figure) against log(ranks); "c" is the
  fitted constant of figure = c * ranks^exponent.
- Finally the manifest of a 4,096-rank, `--manifest-tensors`-tensor checkpoint, as
  build_manifest writes it and read_manifest_at reads it (manifest.sum check and schema
  included; the least of three reads), also with one incremental digest per tensor.

    python benchmarks/bench_scale.py                  # 8 .. 4096 ranks (~3 min on 2 cores)
    python benchmarks/bench_scale.py --quick          # smoke test: 8 .. 64 ranks, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import pickle
import re
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import (
    create_read_items_for_chunk_list,
)
from torch.distributed.checkpoint.storage import WriteResult

from statereg import load_spec
from statereg.backends.checksum import FileRecorder, WrittenFile
from statereg.backends.memory import MemoryBackend
from statereg.backends.verified import VerifiedReads
from statereg.dcp.planner import StateregSavePlanner, plan_digest
from statereg.dcp.reports import ItemReports, pack_results, unpack_results
from statereg.dcp.torch_private import storage_info
from statereg.dcp.writer import BackendWriter
from statereg.engine.checkpoints import (
    checkpoint_name,
    latest_committed,
    read_manifest_at,
)
from statereg.engine.claims import claim_checkpoint
from statereg.engine.io_policy import io_policy
from statereg.engine.layouts.base import Captured
from statereg.engine.layouts.dcp import GroupReader
from statereg.engine.load import read_records
from statereg.engine.plan import (
    LoadTask,
    RankPlan,
    Saved,
    WorldLayout,
    compile_load,
    compile_plan,
)
from statereg.engine.publish import commit
from statereg.engine.retention import apply_retention
from statereg.engine.save_steps import RankReport, build_manifest, summarize
from statereg.engine.verify import verify_files
from statereg.engine.world import World
from statereg.formats.names import DCP_METADATA_NAME, SIDECAR_NAME
from statereg.schemas.manifest import MANIFEST_NAME
from statereg.schemas.spec import RegistrySpec

STEP = 100
ROWS, COLS = 4, 256  # each rank's chunk of every tensor: 4 rows of 256 float32
PLACEHOLDER = b"\0" * 64  # a DCP data file's bytes: only its request is counted


class CountingMemoryBackend(MemoryBackend):
    """memory://, counting every storage request and every byte read, per rank.

    Every operation of a StorageBackend passes `_storage_op` once: that is one request to a
    store (a conditional create on memory:// is a check and a write: two). `rank` says whom
    to charge; listings also count the entries they return.
    """

    schemes = ()  # built directly, never registered

    def __init__(self, url: str) -> None:
        self.rank = 0
        self.requests: Counter[int] = Counter()
        self.bytes_read: Counter[int] = Counter()
        self.listed: Counter[int] = Counter()
        self.read_by: Counter[str] = Counter()  # rank 0's bytes read, by kind of file
        super().__init__(url)

    @contextmanager
    def _storage_op(self, operation: str, path: str) -> Iterator[None]:
        self.requests[self.rank] += 1
        with super()._storage_op(operation, path):
            yield

    def read_bytes(self, path: str, limit: int | None = None) -> bytes:
        data = super().read_bytes(path, limit)
        self.bytes_read[self.rank] += len(data)
        if self.rank == 0:
            self.read_by[re.sub(r"\d+", "N", path.rsplit("/", 1)[-1])] += len(data)
        return data

    def walk(self, path: str = "") -> list:
        found = super().walk(path)
        self.listed[self.rank] += len(found)
        return found

    def list_dir(self, path: str = "") -> list[str]:
        found = super().list_dir(path)
        self.listed[self.rank] += len(found)
        return found


@dataclass
class Ledger:
    """The collectives of one operation, costed as torch.distributed moves them over gloo.

    Object collectives (torch/distributed/distributed_c10d.py): all_gather_object and
    gather_object first all-gather every rank's 8-byte size, then move payloads padded to
    the largest; broadcast_object_list sends the size, then the bytes; scatter_object_list
    sends the largest size, the padded pieces and each piece's size. all_gather moves
    N(N-1) payloads, gather/scatter/broadcast N-1. all_reduce of one int64 (World.agree's
    failure flag) is gloo's ring (gloo/allreduce.cc ring(): 2N segments, only the one
    holding the element is sent): 2(N-1) messages of 8 bytes in the job, 2 per rank.
    """

    ranks: int
    calls: int = 0  # collectives each rank calls
    messages: int = 0  # point-to-point transfers, whole job
    moved: int = 0  # bytes received, whole job
    into_root: int = 0  # bytes received by rank 0
    into_other: int = 0  # bytes received by a rank other than 0 (the largest such)
    moved_by: Counter[str] = field(default_factory=Counter)  # bytes moved, per call site

    def _sizes(self, n: int) -> None:  # all_gather of one int64 size per rank
        self.messages += n * (n - 1)
        self.moved += 8 * n * (n - 1)
        self.into_root += 8 * (n - 1)
        self.into_other += 8 * (n - 1)

    def all_gather(self, sizes: list[int], where: str) -> None:
        n, top = self.ranks, max(sizes)
        before = self.moved
        self.calls += 1
        self._sizes(n)
        self.messages += n * (n - 1)
        self.moved += top * n * (n - 1)
        self.into_root += top * (n - 1)
        self.into_other += top * (n - 1)
        self.moved_by[f"all_gather {where}"] += self.moved - before

    def gather(self, sizes: list[int], where: str) -> None:
        n, top = self.ranks, max(sizes)
        before = self.moved
        self.calls += 1
        self._sizes(n)
        self.messages += n - 1
        self.moved += top * (n - 1)
        self.into_root += top * (n - 1)
        self.moved_by[f"gather {where}"] += self.moved - before

    def scatter(self, sizes: list[int], where: str) -> None:
        n, top = self.ranks, max(sizes)
        self.calls += 1
        self.messages += 3 * (n - 1)  # the largest size, the padded pieces, each piece's size
        self.moved += (n - 1) * (top + 16)
        self.into_other += top + 16
        self.moved_by[f"scatter {where}"] += (n - 1) * (top + 16)

    def broadcast(self, size: int, where: str) -> None:
        n = self.ranks
        self.calls += 1
        self.messages += 2 * (n - 1)  # the size, then the bytes
        self.moved += (n - 1) * (size + 8)
        self.into_other += size + 8
        self.moved_by[f"broadcast {where}"] += (n - 1) * (size + 8)

    def all_reduce(self, where: str) -> None:
        n = self.ranks
        self.calls += 1
        self.messages += 2 * (n - 1)
        self.moved += 16 * (n - 1)
        self.into_root += 16
        self.into_other += 16
        self.moved_by[f"all_reduce {where}"] += 16 * (n - 1)

    def agree(self, where: str) -> None:
        """engine/world.py World.agree when no rank failed: one all_reduce of a flag."""
        self.all_reduce(f"World.agree: {where}")

    def from_leader(self, size: int, where: str) -> None:
        """engine/world.py World.from_leader: a broadcast of (result, None) from the leader;
        `size`: the pickled result."""
        self.broadcast(size + pickled((None, None)), f"World.from_leader: {where}")

    def figures(self) -> dict[str, float]:
        return {
            "collectives per rank": self.calls,
            "messages (job)": self.messages,
            "messages per rank": self.messages / self.ranks,
            "coordination bytes (job)": self.moved,
            "coordination bytes into rank 0": self.into_root,
            "coordination bytes into another rank": self.into_other,
        }


def pickled(obj: Any) -> int:
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def pickled_each(objs: list[Any], sample: int = 16) -> list[int]:
    """Every rank's pickled size, from an even sample of ranks (the first and last included):
    ranks' plans differ only in their offsets and file names, so the others take the
    sample's mean. Pickling every rank's plan would take most of the run at 4,096 ranks."""
    picked = sorted({0, len(objs) - 1, *range(0, len(objs), max(1, len(objs) // sample))})
    sizes = {i: pickled(objs[i]) for i in picked}
    mean = round(statistics.fmean(sizes.values()))
    return [sizes.get(i, mean) for i in range(len(objs))]


def job_spec(url: str) -> RegistrySpec:
    return load_spec({"storage": {"url": url}, "save": {"keep_last": 2}, "components": {
        "model": {"kind": "model"}, "optimizer": {"kind": "optimizer"},
        "scheduler": {"kind": "scheduler"}, "dataloader": {"kind": "dataloader"},
        "rng": {"kind": "rng"}}})


def tensor_names(component: str, tensors: int) -> list[str]:
    if component == "model":
        return [f"layers.{i}.weight" for i in range(tensors)]
    return [f"state.layers.{i}.weight.{m}" for i in range(tensors) for m in ("exp_avg",
                                                                           "exp_avg_sq")]


def chunk_of(rank: int) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size([rank * ROWS, 0]),
                                sizes=torch.Size([ROWS, COLS]))


def local_save_plan(names: list[str], rank: int, ranks: int) -> SavePlan:
    """The plan DCP's create_local_plan makes for DTensor shards: one SHARD item per tensor."""
    chunk, size = chunk_of(rank), torch.Size([ranks * ROWS, COLS])
    props = TensorProperties(dtype=torch.float32)
    data = TensorWriteData(chunk=chunk, properties=props, size=size)
    items = [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                       tensor_data=data) for fqn in names]
    return SavePlan(items, planner_data={fqn: (fqn,) for fqn in names})


def write_results(plan: SavePlan, file_name: str) -> list[WriteResult]:
    """What BackendWriter.write_data returns for `plan` written into one file."""
    length = ROWS * COLS * 4 + 1024  # a tensor's bytes and torch.save's records
    return [WriteResult(index=item.index, size_in_bytes=length,
                        storage_data=(storage_info(file_name, i * length, length), i))
            for i, item in enumerate(plan.items)]


def rank_files(backend: CountingMemoryBackend, name: str, plan: RankPlan) -> list[WrittenFile]:
    """Write the files of `plan` except `.metadata` (the coordinator's, below)."""
    written = []
    for task in plan.tasks:
        for path in task.files:
            if path.endswith(DCP_METADATA_NAME):
                continue
            if "*" in path:  # DCP's data files of this rank: one file (one writer thread)
                path = path.replace("*", "0")
            data = PLACEHOLDER if path.endswith(".distcp") else json.dumps(
                {"file": path, "state": list(range(16))}).encode()
            written.append(backend.write_bytes(f"{name}/{path}", data))
    return written


def relative(files: list[WrittenFile], name: str) -> list[WrittenFile]:
    return [WrittenFile(f.path.removeprefix(f"{name}/"), f.size, f.checksum) for f in files]


# Where the engine calls each collective of one save (sync, not incremental) on this tree;
# simulate_saves records them in this order. tests/distributed/test_save_coordination.py and
# benchmarks/bench_coordination.py count the real calls (8 and 4 for two DCP components).
SAVE_COLLECTIVES = """\
engine/saver.py Saver.save: World.gather_checked (reading state): all_gather of each rank's
  (SaveSummary, failure); check_consistency / check_replicas call none while digests agree
engine/save_steps.py _save_checkpoint: World.gather_checked (claim): all_gather of each rank's
  (DCP plan digests, failure)
first save only, per dcp component, layouts/dcp.py DCPLayout.write -> dcp.save
  (state_dict_saver._save_state_dict): gather local plans, scatter global plans, gather
  write results, broadcast .metadata (a later save of unchanged plans: SavePlans.write_again,
  no collective)
engine/save_steps.py _save_checkpoint: World.gather_on_leader: gather of each rank's (failure,
  files, item reports) to rank 0; World.broadcast of rank 0's failure (None)"""
LOAD_COLLECTIVES = """\
manager.py CheckpointManager._resolve: World.from_leader (_find_here): broadcast of the
  Committed checkpoint (the manifest) read by rank 0
engine/load.py load_checkpoint: World.agree (checking); _verify_share fast: World.from_leader
  (rank 0's listing; broadcast None); World.agree (verifying)
per component, engine/load.py prepare: dcp (layouts/dcp.py DCPLayout.prepare): from_leader
  of the sidecar (if any) and of .metadata (ReadContext.read_once), gather_checked of the
  targets' fingerprints (all_gather); object_file with a collective (global): from_leader
  of its file; then World.agree
per component, apply: dcp not shared (sharded targets) -> dcp.load (_load_state_dict):
  gather local load plans, scatter global plans, all_gather read results; then World.agree"""


def summary_bytes(spec: RegistrySpec, tensors: int) -> int:
    """engine/saver.py's all_gather payload: (SaveSummary, None), from the real summarize()
    (no component declares validate, so no replica digests)."""
    captured = [Captured(t, tensors={n: torch.empty(0) for n in tensor_names(t.component,
                                                                             tensors)}
                         if t.layout == "dcp" else None)
                for t in compile_plan(spec, WorldLayout(0, 8), spec.storage.url).tasks
                if t.takes_part]
    return pickled((summarize(spec, captured, 8), None))


def simulate_saves(backend: CountingMemoryBackend, spec: RegistrySpec, ranks: int,
                   tensors: int) -> list[tuple[dict[str, float], Ledger]]:
    """A first save (DCP plans) and a later save of the same shapes (kept plans), each with
    its figures and ledger; storage requests are counted per save."""
    world = WorldLayout(0, ranks)
    started = time.process_time()
    plans = [compile_plan(spec, world.at(r), spec.storage.url) for r in range(ranks)]
    plan_s = time.process_time() - started
    summary = summary_bytes(spec, tensors)
    components = ("model", "optimizer")
    local = {c: [local_save_plan(tensor_names(c, tensors), r, ranks) for r in range(ranks)]
             for c in components}
    # SavePlans.digest: one plan_digest per DCP component (fixed length: rank 0's stands in).
    digests = pickled(({c: plan_digest(local[c][0]) for c in components}, None))
    kept: dict[str, Any] = {}  # what SavePlans keeps after the first save, per component
    results: list[tuple[dict[str, float], Ledger]] = []
    for save in ("first", "later"):
        step = STEP if save == "first" else STEP + 1
        name = checkpoint_name(step)
        ledger = Ledger(ranks)
        backend.requests.clear()
        ledger.all_gather([summary] * ranks, "saver.py gather_checked (reading state)")
        backend.rank = 0
        claim = claim_checkpoint(backend, name)
        ledger.all_gather([digests] * ranks, "save_steps.py gather_checked (claim, plan digests)")
        files: list[list[WrittenFile]] = [[] for _ in range(ranks)]
        outgoing: list[dict[str, ItemReports]] = [{} for _ in range(ranks)]
        coordinator_s = 0.0
        local_plan_bytes = metadata_bytes = 0
        for component in components:
            directory = plans[0].task(component).directory
            if save == "first":
                figures = first_dcp_save(backend, name, directory, local[component], ledger,
                                         component)
                kept[component], local_plan_bytes, seconds, written = (
                    figures[0], local_plan_bytes + figures[1], figures[2], figures[3])
            else:
                seconds, written = later_dcp_save(backend, name, directory, kept[component],
                                                  outgoing)
            coordinator_s += seconds
            metadata_bytes += sum(f.size for f in written)
            files[0] += relative(written, name)
        for rank in range(ranks):
            backend.rank = rank
            files[rank] += relative(rank_files(backend, name, plans[rank]), name)
        ledger.gather(pickled_each([(None, RankReport(f, item_reports=o))
                                    for f, o in zip(files, outgoing, strict=True)]),
                      "save_steps.py gather_on_leader (file and item reports)")
        backend.rank = 0
        every_file = sorted({f.path: f for rank in files for f in rank}.values(),
                            key=lambda f: f.path)
        captured = [Captured(t, tensors=dict.fromkeys(tensor_names(t.component, tensors))
                             if t.layout == "dcp" else None)
                    for t in plans[0].tasks if t.takes_part]
        started = time.process_time()
        manifest = build_manifest(spec, captured, every_file, step, None, {}, ranks)
        commit(backend, name, manifest, claim)
        commit_s = time.process_time() - started
        ledger.broadcast(pickled([None]), "save_steps.py broadcast (rank 0's failure: None)")
        apply_retention(backend, spec.save, name)
        results.append(({
            **ledger.figures(),
            "local plan bytes (pickled, job)": local_plan_bytes,
            ".metadata bytes": metadata_bytes,
            "manifest bytes": len(manifest.to_json()),
            "storage requests (job)": sum(backend.requests.values()),
            "storage requests on rank 0": backend.requests[0],
            "plan s (compile_plan, all ranks)": plan_s,
            "coordinator s (.metadata)": coordinator_s,
            "commit s (manifest, commit)": commit_s,
        }, ledger))
    return results


def first_dcp_save(backend: CountingMemoryBackend, name: str, directory: str,
                   local_plans: list[SavePlan], ledger: Ledger, component: str,
                   ) -> tuple[dict[str, Any], int, float, list[WrittenFile]]:
    """dcp.save of one component over every rank (DCP's four collectives); returns what
    SavePlans.learn keeps (the coordinator's global metadata and every member's item
    indices and packed reports), the pickled local plans' bytes, the coordinator's CPU
    seconds and the files it wrote (.metadata)."""
    ranks = len(local_plans)
    writers = []
    prepared = []
    for rank in range(ranks):
        backend.rank = rank
        writer = BackendWriter(backend, f"{name}/{directory}", FileRecorder())
        writer.set_up_storage_writer(rank == 0)
        prepared.append(writer.prepare_local_plan(local_plans[rank]))
        writers.append(writer)
    sizes = pickled_each(prepared)
    ledger.gather(sizes, f"dcp.save {component}: local plans")
    started = time.process_time()
    planner = StateregSavePlanner()
    global_plans, md = planner.create_global_plan(prepared)
    global_plans = writers[0].prepare_global_plan(global_plans)
    seconds = time.process_time() - started
    ledger.scatter(pickled_each(global_plans), f"dcp.save {component}: global plans")
    results = [write_results(plan, f"{plan.storage_data}0.distcp") for plan in global_plans]
    ledger.gather(pickled_each(results), f"dcp.save {component}: write results")
    backend.rank = 0
    started = time.process_time()
    writers[0].finish(md, results)
    seconds += time.process_time() - started
    ledger.broadcast(pickled(md), f"dcp.save {component}: .metadata")
    members = [[item.index for item in plan.items] for plan in global_plans]
    kept = {"metadata": dataclasses.replace(md, storage_data=None), "members": members,
            "reports": [pack_results(i, r) for i, r in zip(members, results, strict=True)],
            "results": results}
    return kept, sum(sizes), seconds, writers[0].fs.recorder.files()


def later_dcp_save(backend: CountingMemoryBackend, name: str, directory: str,
                   kept: dict[str, Any], outgoing: list[dict[str, ItemReports]],
                   ) -> tuple[float, list[WrittenFile]]:
    """A later save of one component by its kept plan (SavePlans.write_again: no
    collective): each rank's packed reports go out with its file reports
    (ItemReports.to_send: digests only, the locations did not move), and the coordinator
    writes .metadata from its kept metadata as SavePlans._write_metadata does."""
    component = directory.split("/")[0]
    sent = []
    for rank, (indices, results) in enumerate(zip(kept["members"], kept["results"],
                                                  strict=True)):
        reports = pack_results(indices, results).to_send(kept["reports"][rank])
        outgoing[rank][component] = reports
        sent.append(reports)
    backend.rank = 0
    writer = BackendWriter(backend, f"{name}/{directory}", FileRecorder())
    writer.set_up_storage_writer(True)
    started = time.process_time()
    unpacked = [unpack_results(indices, theirs, last)[0] for indices, theirs, last
                in zip(kept["members"], sent, kept["reports"], strict=True)]
    writer.finish(dataclasses.replace(kept["metadata"]), unpacked)
    return time.process_time() - started, writer.fs.recorder.files()


@dataclass
class RankLoad:
    """One rank's part of a load."""

    plan_s: float = 0.0  # planning its reads (DCP's resharding over its chunk)
    data_gets: int = 0  # data files it reads items from
    plan_bytes: int = 0  # its pickled local load plans
    # Rank 0's alone: its load tasks, and the pickled size of what it reads for every rank
    # (the manifest; files by their path in the checkpoint).
    tasks: dict[str, LoadTask] = field(default_factory=dict)
    shared: dict[str, int] = field(default_factory=dict)


def rank_load(backend: CountingMemoryBackend, spec: RegistrySpec, ranks: int, rank: int,
              tensors: int, received: dict[str, Any]) -> RankLoad:
    """One rank's storage work of a load, as engine/load.py, manager._resolve and the
    layouts do it: rank 0 (every collective's leader here) lists the root, reads the
    manifest, checks sizes from one listing and reads what every rank needs alike (DCP
    .metadata, the sidecar, the global scheduler's file); `received` keeps those for the
    other ranks, which read only their own files (per-rank state, their DCP data files)."""
    backend.rank = rank
    world = WorldLayout(rank, ranks)
    run = RankLoad()
    if rank == 0:  # _resolve -> World.from_leader(_find_here): rank 0 alone
        committed = latest_committed(backend)
        assert committed is not None
        received["committed"] = committed
        run.shared["manifest"] = pickled(committed)
    committed = received["committed"]
    name, manifest = committed.name, committed.manifest
    names = list(spec.components)
    saved = {n: Saved(r.kind, r.sharing, r.format, manifest.world_size, tuple(r.files))
             for n, r in manifest.components.items()}
    tasks = compile_load(spec, saved, names, world, name)
    if rank == 0:
        run.tasks = tasks
    selected = {p for n in names for p in manifest.components[n].files}
    files = [f for f in manifest.files if f.path in selected]
    if rank == 0:  # load.py _verify_share, fast: rank 0's listing
        verify_files(backend, name, files, "fast")
    records = read_records(manifest, name, names)
    reader = VerifiedReads(backend, records)
    policy = io_policy(backend.capabilities)

    def once(path: str, collective: str | None) -> bytes:
        """ReadContext.read_once: the collective's leader (rank 0 here) reads, others get."""
        if collective is None:
            return reader.read_bytes(path)
        if rank == 0:
            received[path] = reader.read_bytes(path)
            run.shared[path.removeprefix(f"{name}/")] = pickled(received[path])
        return received[path]  # type: ignore[no-any-return]

    for component, task in tasks.items():
        if task.layout != "dcp":
            for path in task.state_files:
                once(f"{name}/{path}", task.collective)
            continue
        directory = f"{name}/{task.directory}"
        if f"{task.directory}/{SIDECAR_NAME}" in manifest.components[component].files:
            once(f"{directory}/{SIDECAR_NAME}", task.collective)
        group_reader = GroupReader(reader, directory, records,
                                   once(f"{directory}/{DCP_METADATA_NAME}", task.collective),
                                   World(), None, policy.read_threads,
                                   policy.broadcast_reads)
        md = group_reader.read_metadata()
        group_reader.verify_unchecked(md)
        started = time.process_time()
        items = [read for fqn in tensor_names(component, tensors) for read in
                 create_read_items_for_chunk_list(fqn, md.state_dict_metadata[fqn],
                                                  [chunk_of(rank)])]
        run.plan_s += time.process_time() - started
        run.plan_bytes += pickled(LoadPlan(items))
        run.data_gets += len({md.storage_data[item.storage_index].relative_path
                              for item in items})
    return run


def simulate_load(backend: CountingMemoryBackend, spec: RegistrySpec, ranks: int,
                  tensors: int, sample: int) -> tuple[dict[str, float], Ledger]:
    for counter in (backend.requests, backend.bytes_read, backend.listed, backend.read_by):
        counter.clear()
    others = sorted(set(range(1, ranks, max(1, (ranks - 1) // sample))[:sample]))
    received: dict[str, Any] = {}
    runs = {r: rank_load(backend, spec, ranks, r, tensors, received) for r in [0, *others]}
    started = time.process_time()
    for rank in range(ranks):  # compile_load is cheap: every rank's, for real
        manifest_saved = {n: Saved(c.kind, c.resolved_sharing, c.resolved_format, ranks, ())
                          for n, c in spec.components.items()}
        compile_load(spec, manifest_saved, list(spec.components), WorldLayout(rank, ranks), "x")
    compile_s = time.process_time() - started

    def job(per_rank: dict[int, float]) -> float:
        """Rank 0's figure plus the sampled ranks' mean for every other rank."""
        rest = [per_rank[r] for r in others]
        return per_rank[0] + (statistics.fmean(rest) * (ranks - 1) if rest else 0.0)

    shared = runs[0].shared
    ledger = Ledger(ranks)
    ledger.from_leader(shared["manifest"], "manager.py _resolve (the manifest)")
    ledger.agree("load.py checking")
    ledger.from_leader(pickled(None), "load.py _verify_share (rank 0's listing)")
    ledger.agree("load.py verifying")
    plan_size = statistics.fmean(runs[r].plan_bytes for r in runs) / 2  # two dcp components
    tasks = runs[0].tasks  # the same collectives on every rank
    for component, task in tasks.items():  # prepare
        if task.layout == "dcp":
            sidecar = f"{task.directory}/{SIDECAR_NAME}"
            if sidecar in shared:
                ledger.from_leader(shared[sidecar], f"dcp.py prepare {component}: sidecar")
            ledger.from_leader(shared[f"{task.directory}/{DCP_METADATA_NAME}"],
                               f"dcp.py prepare {component}: .metadata")
            # Sharded targets (DTensor) have no fingerprint: every rank sends None.
            ledger.all_gather([pickled((None, None))] * ranks,
                              f"dcp.py prepare {component}: gather_checked (fingerprints)")
        elif task.collective is not None:
            for path in task.state_files:
                ledger.from_leader(shared[path], f"object_file.py prepare {component}")
        ledger.agree(f"load.py prepare {component}")
    for component, task in tasks.items():  # apply
        if task.layout == "dcp":
            sizes = [int(plan_size)] * ranks
            ledger.gather(sizes, f"dcp.load {component}: local plans")
            ledger.scatter(sizes, f"dcp.load {component}: global plans")
            ledger.all_gather([pickled(None)] * ranks, f"dcp.load {component}: read results")
        ledger.agree(f"load.py apply {component}")
    return {
        **ledger.figures(),
        "storage requests (job)": job({r: backend.requests[r] for r in runs}),
        "storage requests on rank 0": backend.requests[0],
        "metadata bytes read (job)": job({r: backend.bytes_read[r] for r in runs}),
        "listed entries (job)": job({r: backend.listed[r] for r in runs}),
        "data file GETs (job)": job({r: runs[r].data_gets for r in runs}),
        "read plan s per rank (DCP resharding)": max(runs[r].plan_s for r in runs),
        "compile_load s (all ranks)": compile_s,
    }, ledger


def manifest_at_scale(ranks: int, tensors: int) -> dict[str, float]:
    """The manifest of a `ranks`-rank, `tensors`-tensor checkpoint: its size and the time
    read_manifest_at takes (read, manifest.sum check, parse), plain and with one incremental
    digest per tensor."""
    backend = CountingMemoryBackend(f"memory://statereg-bench-scale/manifest-{ranks}")
    spec = job_spec(backend.url)
    name = checkpoint_name(STEP)
    world = WorldLayout(0, ranks)
    files = []
    for rank in range(ranks):
        plan = compile_plan(spec, world.at(rank), backend.url)
        for task in plan.tasks:
            files += [WrittenFile(p.replace("*", "0"), 1 << 30, "xxh3_64:" + "0" * 16)
                      for p in task.files]
    files.sort(key=lambda f: f.path)
    share = {"model": tensors // 3, "optimizer": tensors - tensors // 3}
    plan = compile_plan(spec, world, backend.url)
    captured = [Captured(t, tensors=dict.fromkeys(map(str, range(share[t.component])))
                         if t.component in share else None) for t in plan.tasks if t.takes_part]
    manifest = build_manifest(spec, captured, files, STEP, None, {}, ranks)
    digests = {f"model/layers.{i}.weight": f"float32[4096, 4096]:{i:032x}"
               for i in range(tensors)}
    result: dict[str, float] = {}
    for label, m in (("plain", manifest),
                     ("incremental", manifest.model_copy(update={"digests": digests}))):
        step = STEP + len(result)
        m = m.model_copy(update={"step": step})
        commit(backend, checkpoint_name(step), m, None, move_latest=False)
        seconds = []
        for _ in range(3):  # the least of three: other jobs share the cores
            gc.collect()
            started = time.process_time()
            parsed = read_manifest_at(backend, checkpoint_name(step))
            seconds.append(time.process_time() - started)
        result[f"{label} parse s"] = min(seconds)
        result[f"{label} bytes"] = backend.size(f"{checkpoint_name(step)}/{MANIFEST_NAME}")
        assert len(parsed.files) == len(files) and len(parsed.digests) == (
            tensors if label == "incremental" else 0)
    result["files"] = len(files)
    backend.remove_tree("")
    del name
    return result


def exponent(ranks: list[int], values: list[float]) -> tuple[float, float] | None:
    """Least-squares slope and constant of log(value) = log(c) + k log(ranks)."""
    points = [(math.log(r), math.log(v)) for r, v in zip(ranks, values, strict=True) if v > 0]
    if len(points) < 2 or len(points) < len(values):
        return None
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    k = sum((x - mx) * (y - my) for x, y in points) / sxx
    return k, math.exp(my - k * mx)


def number(value: float) -> str:
    if value == int(value) and abs(value) < 1e6:
        return str(int(value))
    if abs(value) >= 1e6:
        return f"{value:.3g}"
    return f"{value:.3f}" if value < 10 else f"{value:.1f}"


def table(title: str, ranks: list[int], rows: dict[str, list[float]]) -> list[str]:
    header = ["figure", *(str(r) for r in ranks), "exponent", "c"]
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |",
             "|" + "---|" * len(header)]
    for label, values in rows.items():
        fit = exponent(ranks, values)
        shown = ("0 (none)", "-") if fit is None and not any(values) else (
            ("-", "-") if fit is None else (f"{fit[0]:.2f}", f"{fit[1]:.3g}"))
        lines.append("| " + " | ".join([label, *map(number, values), *shown]) + " |")
    return [*lines, ""]


def where(amounts: dict[str, int], what: str, top: int = 5) -> list[str]:
    total = sum(amounts.values()) or 1
    return [f"  {what}: {label}: {number(value)} B ({value / total:.0%})"
            for label, value in sorted(amounts.items(), key=lambda kv: -kv[1])[:top]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-ranks", type=int, default=4096)
    parser.add_argument("--tensors", type=int, default=16,
                        help="sharded model tensors (the optimizer has twice as many moments)")
    parser.add_argument("--sample", type=int, default=2,
                        help="ranks besides rank 0 whose load runs for real")
    parser.add_argument("--manifest-ranks", type=int, default=4096)
    parser.add_argument("--manifest-tensors", type=int, default=100_000)
    parser.add_argument("--quick", action="store_true", help="8 .. 64 ranks, 8 tensors")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.quick:
        args.max_ranks, args.tensors = 64, 8
    if args.max_ranks < 16:
        parser.error("--max-ranks must be at least 16: an exponent needs two job sizes (8, 16)")
    ranks = [2 ** e for e in range(3, int(math.log2(args.max_ranks)) + 1)]
    wall = time.perf_counter()
    first_rows: dict[str, list[float]] = {}
    later_rows: dict[str, list[float]] = {}
    load_rows: dict[str, list[float]] = {}
    # Millions of small plan objects live at once: a cyclic GC pass would walk them all, again
    # and again, and charge its time to whatever runs (statereg pauses it around .metadata).
    gc.disable()
    for n in ranks:
        gc.collect()
        backend = CountingMemoryBackend(f"memory://statereg-bench-scale/job-{n}")
        spec = job_spec(backend.url)
        (first, first_ledger), (later, later_ledger) = simulate_saves(backend, spec, n,
                                                                      args.tensors)
        load, load_ledger = simulate_load(backend, spec, n, args.tensors, args.sample)
        read_by = dict(backend.read_by)
        backend.remove_tree("")
        for rows, figures in ((first_rows, first), (later_rows, later), (load_rows, load)):
            for label, value in figures.items():
                rows.setdefault(label, []).append(float(value))
        print(f"# {n} ranks done at {time.perf_counter() - wall:.1f} s", file=sys.stderr)
    manifest = manifest_at_scale(args.manifest_ranks, args.manifest_tensors)
    tensors = 3 * args.tensors
    lines = [f"# statereg coordination at scale: {tensors} sharded tensors, one chunk per rank; "
             f"{time.process_time():.0f} s of CPU, {time.perf_counter() - wall:.0f} s of wall "
             "clock", ""]
    lines += table("first save (DCP plans)", ranks, first_rows)
    lines += table("later save (kept plans, unchanged shapes)", ranks, later_rows)
    lines += table("load (the newest checkpoint, same world size)", ranks, load_rows)
    lines += [
        f"manifest of a {args.manifest_ranks}-rank, {args.manifest_tensors}-tensor checkpoint "
        f"({manifest['files']:.0f} files): {manifest['plain bytes']:.0f} bytes, parsed in "
        f"{manifest['plain parse s']:.3f} s; with {args.manifest_tensors} incremental digests: "
        f"{manifest['incremental bytes']:.0f} bytes, parsed in "
        f"{manifest['incremental parse s']:.3f} s (read_manifest_at: read, manifest.sum, "
        "parse)", "",
        f"where the coordination bytes go at {ranks[-1]} ranks (largest first):",
        *where(first_ledger.moved_by, "first save"), *where(later_ledger.moved_by, "later save"),
        *where(load_ledger.moved_by, "load"),
        f"what rank 0 reads in a load at {ranks[-1]} ranks (for every rank: the others "
        "read only their own files):", *where(read_by, "load"), "",
        "collectives of one save, where the engine calls them:", SAVE_COLLECTIVES, "",
        "collectives of one load:", LOAD_COLLECTIVES,
    ]
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"ranks": ranks, "first save": first_rows,
                                         "later save": later_rows, "load": load_rows,
                                         "manifest": manifest}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
