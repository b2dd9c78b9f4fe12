"""Coordination at scale without a cluster: what one save and one load of an N-rank job cost,
for N = 8, 16, ..., 4096, from statereg's real planning and commit code, with no process per rank.

What it measures (re-run it unchanged after the read-once and plan-reuse work of issue 17;
`rank_load` and SAVE_COLLECTIVES/LOAD_COLLECTIVES follow the code path of the tree measured in
docs/performance.md, commit 0c629b9: where the engine's load or save path changes what a rank
reads or which collectives it calls, change those two places to match, nothing else;
benchmarks/bench_coordination.py counts the real collectives per save to check against):

- The job: `model` and `optimizer` sharded over all ranks as FSDP does it (every tensor split
  along dim 0, one chunk per rank: `--tensors` model tensors, twice as many optimizer
  moments), a global `scheduler`, per-rank `dataloader` and `rng`, on a counting in-memory
  backend (statereg's memory backend; every storage operation is one request).
- Save, for every rank: its plan (engine/plan.py compile_plan), its DCP local save plan (the
  WriteItems DCP makes for a DTensor shard, built directly: no DTensor, no tensor data) and
  the storage writer's local step; then the coordinator's global plan
  (StateregSavePlanner.create_global_plan, BackendWriter.prepare_global_plan) and `.metadata`
  (BackendWriter.finish, from each rank's write results); every rank's files (a placeholder
  of 64 bytes per DCP data file: the request count is the real one, not the byte count);
  the claim, the manifest (engine/save.py build_manifest), the commit (publish.commit) and
  retention, all real and counted.
- Load, per rank, what engine/load.py and CheckpointManager._resolve make a rank do: read the
  manifest (the real parser), verify (fast), compile the load plan (compile_load), read each
  DCP `.metadata` and sidecar through the verifying reader, its object files, and plan its
  reads (DCP's resharding helper over its own chunk); data reads are counted from that read
  plan (one GET per file a rank reads items from). Rank 0 and up to `--sample` other ranks
  run it for real; the others' figures are the sample's mean (their work differs only in
  the names of their own files).
- Messages: collectives are not run; each one a real job calls is recorded where the code
  calls it (SAVE_COLLECTIVES, LOAD_COLLECTIVES name the file and function), with the real
  pickled payloads (local plans, global plans, write results, `.metadata`, file reports,
  manifest), and costed as torch.distributed's object collectives move them: every
  *_object call first exchanges 8-byte sizes, then payloads padded to the largest;
  all_gather N(N-1) transfers, gather/scatter/broadcast N-1.
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
from statereg.backends.checksum import FileRecorder, VerifiedReads, WrittenFile
from statereg.backends.dcp_io import BackendReader, BackendWriter
from statereg.backends.memory import MemoryBackend
from statereg.backends.torch_private import storage_info
from statereg.engine.checkpoints import (
    checkpoint_name,
    latest_committed,
    read_manifest_at,
)
from statereg.engine.claims import claim_checkpoint
from statereg.engine.layouts.base import Captured
from statereg.engine.layouts.dcp import StateregSavePlanner
from statereg.engine.load import read_records
from statereg.engine.plan import RankPlan, Saved, WorldLayout, compile_load, compile_plan
from statereg.engine.publish import commit
from statereg.engine.retention import apply_retention
from statereg.engine.save import build_manifest
from statereg.engine.verify import verify_files
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
    """The collectives of one operation, costed as torch.distributed's object collectives."""

    ranks: int
    calls: int = 0  # object collectives each rank calls
    messages: int = 0  # point-to-point transfers, whole job
    moved: int = 0  # bytes received, whole job
    into_root: int = 0  # bytes received by rank 0
    moved_by: Counter[str] = field(default_factory=Counter)  # bytes moved, per call site

    def _sizes(self, n: int) -> None:  # all_gather of one int64 size per rank
        self.messages += n * (n - 1)
        self.moved += 8 * n * (n - 1)
        self.into_root += 8 * (n - 1)

    def all_gather(self, sizes: list[int], where: str) -> None:
        n, top = self.ranks, max(sizes)
        before = self.moved
        self.calls += 1
        self._sizes(n)
        self.messages += n * (n - 1)
        self.moved += top * n * (n - 1)
        self.into_root += top * (n - 1)
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
        self.moved_by[f"scatter {where}"] += (n - 1) * (top + 16)

    def broadcast(self, size: int, where: str) -> None:
        n = self.ranks
        self.calls += 1
        self.messages += 2 * (n - 1)  # the size, then the bytes
        self.moved += (n - 1) * (size + 8)
        self.moved_by[f"broadcast {where}"] += (n - 1) * (size + 8)

    def agree(self, where: str) -> None:
        """engine/world.py World.agree: an all_gather of None (no rank failed)."""
        self.all_gather([len(pickle.dumps(None))] * self.ranks, f"World.agree: {where}")


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


# Where the engine calls each collective of one save (sync, not incremental) on this tree.
SAVE_COLLECTIVES = """\
engine/saver.py Saver.save: World.agree (reading state), check_consistency all_gather,
  check_replicas all_gather, World.agree (validating replicas)
engine/save.py _save_checkpoint: World.agree (claim)
per dcp component, layouts/dcp.py DCPLayout.write -> dcp.save (state_dict_saver
  _save_state_dict): gather local plans, scatter global plans, gather write results,
  broadcast .metadata
engine/save.py _save_checkpoint: World.agree (writing), all_gather file reports,
  World.agree (commit), broadcast Committed (the manifest)"""
LOAD_COLLECTIVES = """\
manager.py CheckpointManager._resolve: broadcast the checkpoint name
engine/load.py load_checkpoint: World.agree (compile_load), agree (verify), agree (prepare)
per dcp component, layouts/dcp.py DCPLayout.prepare -> dcp.load (_load_state_dict):
  gather local load plans, scatter global plans, all_gather read results
engine/load.py load_checkpoint: World.agree (apply)"""


def simulate_save(backend: CountingMemoryBackend, spec: RegistrySpec, ranks: int,
                  tensors: int) -> tuple[dict[str, float], Ledger]:
    world = WorldLayout(0, ranks)
    name = checkpoint_name(STEP)
    ledger = Ledger(ranks)
    started = time.process_time()
    plans = [compile_plan(spec, world.at(r), spec.storage.url) for r in range(ranks)]
    plan_s = time.process_time() - started
    digest = len(pickle.dumps("0" * 16))
    ledger.agree("saver.py reading state")
    ledger.all_gather([digest] * ranks, "save.py check_consistency (state digest)")
    ledger.all_gather([pickled({})] * ranks, "save.py check_replicas (summaries)")
    ledger.agree("saver.py validating replicas")
    backend.rank = 0
    claim = claim_checkpoint(backend, name)
    ledger.agree("save.py claim")
    files: list[list[WrittenFile]] = [[] for _ in range(ranks)]
    coordinator_s = 0.0
    local_plan_bytes = 0
    metadata_bytes = 0
    for component in ("model", "optimizer"):
        names = tensor_names(component, tensors)
        directory = plans[0].task(component).directory
        writers = []
        local_plans = []
        for rank in range(ranks):
            backend.rank = rank
            writer = BackendWriter(backend, f"{name}/{directory}", FileRecorder())
            writer.set_up_storage_writer(rank == 0)
            local_plans.append(writer.prepare_local_plan(local_save_plan(names, rank, ranks)))
            writers.append(writer)
        sizes = pickled_each(local_plans)
        local_plan_bytes += sum(sizes)
        ledger.gather(sizes, f"dcp.save {component}: local plans")
        started = time.process_time()
        planner = StateregSavePlanner()
        global_plans, md = planner.create_global_plan(local_plans)
        global_plans = writers[0].prepare_global_plan(global_plans)
        coordinator_s += time.process_time() - started
        ledger.scatter(pickled_each(global_plans), f"dcp.save {component}: global plans")
        results = [write_results(plan, f"{plan.storage_data}0.distcp") for plan in global_plans]
        ledger.gather(pickled_each(results), f"dcp.save {component}: write results")
        backend.rank = 0
        started = time.process_time()
        writers[0].finish(md, results)
        coordinator_s += time.process_time() - started
        written = writers[0].fs.recorder.files()
        metadata_bytes += sum(f.size for f in written)
        files[0] += relative(written, name)
        ledger.broadcast(pickled(md), f"dcp.save {component}: .metadata")
    for rank in range(ranks):
        backend.rank = rank
        files[rank] += relative(rank_files(backend, name, plans[rank]), name)
    ledger.agree("save.py writing")
    ledger.all_gather(pickled_each([(f, None) for f in files]), "save.py file reports")
    backend.rank = 0
    every_file = sorted({f.path: f for rank in files for f in rank}.values(),
                        key=lambda f: f.path)
    captured = [Captured(t, tensors=dict.fromkeys(tensor_names(t.component, tensors))
                         if t.layout == "dcp" else None)
                for t in plans[0].tasks if t.takes_part]
    started = time.process_time()
    manifest = build_manifest(spec, captured, every_file, STEP, None, {}, ranks)
    commit(backend, name, manifest, claim)
    commit_s = time.process_time() - started
    ledger.agree("save.py commit")
    ledger.broadcast(pickled(manifest), "save.py Committed (manifest)")
    apply_retention(backend, spec.save, name)
    figures = {
        "collectives per rank": ledger.calls,
        "messages (job)": ledger.messages,
        "messages per rank": ledger.messages / ranks,
        "coordination bytes (job)": ledger.moved,
        "coordination bytes into rank 0": ledger.into_root,
        "local plan bytes (pickled, job)": local_plan_bytes,
        ".metadata bytes": metadata_bytes,
        "manifest bytes": len(manifest.to_json()),
        "storage requests (job)": sum(backend.requests.values()),
        "storage requests on rank 0": backend.requests[0],
        "plan s (compile_plan, all ranks)": plan_s,
        "coordinator s (global plan, .metadata)": coordinator_s,
        "commit s (manifest, commit)": commit_s,
    }
    return figures, ledger


def rank_load(backend: CountingMemoryBackend, spec: RegistrySpec, ranks: int, rank: int,
              tensors: int) -> tuple[float, int, int]:
    """One rank's storage work of a load, as engine/load.py and manager._resolve do it now.

    Returns (seconds planning its reads, its data file GETs, its pickled local load plans).
    """
    backend.rank = rank
    world = WorldLayout(rank, ranks)
    if rank == 0:  # _resolve: rank 0 finds the newest committed checkpoint
        latest = latest_committed(backend)
        assert latest is not None
    name = checkpoint_name(STEP)
    manifest = read_manifest_at(backend, name)  # _resolve: every rank reads the manifest
    names = list(spec.components)
    saved = {n: Saved(r.kind, r.sharing, r.format, manifest.world_size, tuple(r.files))
             for n, r in manifest.components.items()}
    tasks = compile_load(spec, saved, names, world, name)
    selected = {p for n in names for p in manifest.components[n].files}
    files = [f for f in manifest.files if f.path in selected]
    verify_files(backend, name, files[rank::ranks], "fast")
    records = read_records(manifest, name, names)
    reader = VerifiedReads(backend, records)
    plan_s, data_gets, plan_bytes = 0.0, 0, 0
    for component, task in tasks.items():
        if task.layout != "dcp":
            for path in task.state_files:
                reader.read_bytes(f"{name}/{path}")
            continue
        dcp_reader = BackendReader(reader, f"{name}/{task.directory}", records=records)
        if f"{task.directory}/{SIDECAR_NAME}" in manifest.components[component].files:
            reader.read_bytes(f"{name}/{task.directory}/{SIDECAR_NAME}")
        md = dcp_reader.read_metadata()
        dcp_reader.verify_unchecked(md)
        started = time.process_time()
        items = [read for fqn in tensor_names(component, tensors) for read in
                 create_read_items_for_chunk_list(fqn, md.state_dict_metadata[fqn],
                                                  [chunk_of(rank)])]
        plan_s += time.process_time() - started
        plan_bytes += pickled(LoadPlan(items))
        data_gets += len({md.storage_data[item.storage_index].relative_path for item in items})
    return plan_s, data_gets, plan_bytes


def simulate_load(backend: CountingMemoryBackend, spec: RegistrySpec, ranks: int,
                  tensors: int, sample: int) -> tuple[dict[str, float], Ledger]:
    for counter in (backend.requests, backend.bytes_read, backend.listed, backend.read_by):
        counter.clear()
    others = sorted(set(range(1, ranks, max(1, (ranks - 1) // sample))[:sample]))
    runs = {r: rank_load(backend, spec, ranks, r, tensors) for r in [0, *others]}
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

    ledger = Ledger(ranks)
    ledger.broadcast(pickled(checkpoint_name(STEP)), "manager.py _resolve: checkpoint name")
    for what in ("compile_load", "verify", "prepare"):
        ledger.agree(f"load.py {what}")
    plan_size = statistics.fmean(runs[r][2] for r in runs) / 2  # two dcp components
    for component in ("model", "optimizer"):
        sizes = [int(plan_size)] * ranks
        ledger.gather(sizes, f"dcp.load {component}: local plans")
        ledger.scatter(sizes, f"dcp.load {component}: global plans")
        ledger.all_gather([pickled(None)] * ranks, f"dcp.load {component}: read results")
    ledger.agree("load.py apply")
    return {
        "collectives per rank": ledger.calls,
        "messages (job)": ledger.messages,
        "messages per rank": ledger.messages / ranks,
        "coordination bytes (job)": ledger.moved,
        "storage requests (job)": job({r: backend.requests[r] for r in runs}),
        "storage requests on rank 0": backend.requests[0],
        "metadata bytes read (job)": job({r: backend.bytes_read[r] for r in runs}),
        "listed entries (job)": job({r: backend.listed[r] for r in runs}),
        "data file GETs (job)": job({r: runs[r][1] for r in runs}),
        "read plan s per rank (DCP resharding)": max(runs[r][0] for r in runs),
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
    save_rows: dict[str, list[float]] = {}
    load_rows: dict[str, list[float]] = {}
    # Millions of small plan objects live at once: a cyclic GC pass would walk them all, again
    # and again, and charge its time to whatever runs (statereg pauses it around .metadata).
    gc.disable()
    for n in ranks:
        gc.collect()
        backend = CountingMemoryBackend(f"memory://statereg-bench-scale/job-{n}")
        spec = job_spec(backend.url)
        save, save_ledger = simulate_save(backend, spec, n, args.tensors)
        load, load_ledger = simulate_load(backend, spec, n, args.tensors, args.sample)
        read_by = dict(backend.read_by)
        backend.remove_tree("")
        for rows, figures in ((save_rows, save), (load_rows, load)):
            for label, value in figures.items():
                rows.setdefault(label, []).append(float(value))
        print(f"# {n} ranks done at {time.perf_counter() - wall:.1f} s", file=sys.stderr)
    manifest = manifest_at_scale(args.manifest_ranks, args.manifest_tensors)
    tensors = 3 * args.tensors
    lines = [f"# statereg coordination at scale: {tensors} sharded tensors, one chunk per rank; "
             f"{time.process_time():.0f} s of CPU, {time.perf_counter() - wall:.0f} s of wall "
             "clock", ""]
    lines += table("save (one checkpoint)", ranks, save_rows)
    lines += table("load (the newest checkpoint, same world size)", ranks, load_rows)
    lines += [
        f"manifest of a {args.manifest_ranks}-rank, {args.manifest_tensors}-tensor checkpoint "
        f"({manifest['files']:.0f} files): {manifest['plain bytes']:.0f} bytes, parsed in "
        f"{manifest['plain parse s']:.3f} s; with {args.manifest_tensors} incremental digests: "
        f"{manifest['incremental bytes']:.0f} bytes, parsed in "
        f"{manifest['incremental parse s']:.3f} s (read_manifest_at: read, manifest.sum, "
        "parse)", "",
        f"where the coordination bytes go at {ranks[-1]} ranks (largest first):",
        *where(save_ledger.moved_by, "save"), *where(load_ledger.moved_by, "load"),
        f"what rank 0 reads in a load at {ranks[-1]} ranks (every other rank reads the same "
        "shared files):", *where(read_by, "load"), "",
        "collectives of one save, where the engine calls them:", SAVE_COLLECTIVES, "",
        "collectives of one load:", LOAD_COLLECTIVES,
    ]
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"ranks": ranks, "save": save_rows, "load": load_rows,
                                         "manifest": manifest}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
