"""statereg against its peers, each library as its users install it, on one training state.

Run by hand (see benchmarks/README.md; the figures go to docs/performance.md):

    cd benchmarks && ../.venv/bin/python -m perfsuite.field --install --reps 3 --dir /var/tmp
    cd benchmarks && ../.venv/bin/python -m perfsuite.field --quick     # smoke test, no peers

--install first creates the peer venv (/tmp/statereg-peers) and pip installs the peers into
it; later runs find them there without it.

Why: issue 29's acceptance is judged on one run of this scenario: warm load <= 1.0x
torch.load(mmap) + copy_, cold load <= 0.8x the best peer, sync save and async stall still the
fastest, compressed save >= 2x DCP's ZStandard at a ratio >= zipnn's. Ratios only hold within
one run on the shared machines, so every contender is measured here, interleaved.

The state is the suite's fp32 transformer after a real AdamW step (weights and two moments, 12
bytes a parameter) and, for compression only, its bf16 variant. Contenders:

- in this process (the main .venv): statereg (default policy; async: thread), torch.save /
  torch.load(mmap=True) + copy_, safetensors (save_file / safe_open + copy_), plain DCP
  (FileSystemWriter thread_count from --dcp-threads, each a row; dcp.async_save; dcp.load);
- in a separate virtualenv (--peer-venv, default /tmp/statereg-peers), run per repetition by
  perfsuite/field_worker.py on the state dumped as one safetensors file: Meta's
  torch-checkpointing, torchsnapshot, megatron-core's dist_checkpointing. The venv holds the
  same torch as this one plus the peers and zipnn, installed from the package registry only
  with --install (nothing is downloaded without it); a peer missing from it is reported as
  "not installed: run with --install", one that cannot run here as skipped, with the reason.

Each repetition runs the contenders in an order rotated from one repetition to the next (a
drifting disk favours no one); each contender does, on its own folder: its sync save(s), every
one ending durable (fsync added where the library has none); a cold load of the last one (its
files evicted first: drop_caches where permitted, else a sync and posix_fadvise(DONTNEED) on
each file; --evict-only always evicts) into the live, preallocated tensors, checked bit for bit;
the same load again at once (warm); and, where the library has one, an async save: the stall
(until the loop may mutate the tensors) and the time until durable, while the loop rewrites
every byte of the state (the first async save of a manager or process, which allocates its
buffers or starts its process, is reported apart: the measured one is a later save). In the
first repetition the async checkpoint is loaded back and compared with the state before the
rewrite: a library whose async save lets the loop's writes reach the checkpoint is marked not
consistent, and its stall does not count as a peer's.
Reported: medians of --reps with min-max, GB/s and peak RSS. Then the compression comparison
of the suite's compression section (statereg zstd -3 float-aware against DCP's ZStandard
extension, fp32 and bf16; zipnn's ratio in the peer venv), and the targets above, evaluated on
this one run. Writes field.json and field.md to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import safetensors
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from safetensors.torch import save_file

import statereg
from perfsuite import compression, report
from perfsuite.cold_load import read_direct, safetensors_load, torch_mmap_load
from perfsuite.field_worker import PEERS, Contender, Flat, Rep, run_rep
from perfsuite.measure import GB, PageCache, PeakRSS, Timing, machine_info
from perfsuite.peers import fsync_path, torch_save
from perfsuite.statereg_io import manager, spec_for
from perfsuite.workload import TrainingState, build_bf16, build_fp32, shape_for

WORKER = Path(__file__).with_name("field_worker.py")
DEFAULT_VENV = "/tmp/statereg-peers"
# What --install puts in the peer venv, besides torch (pinned to this process's version),
# numpy and safetensors (the worker reads the state with them).
PEER_PACKAGES = ("torch-checkpointing", "torchsnapshot", "megatron-core", "zipnn")
IN_PROCESS = ("statereg", "torch_save", "safetensors", "dcp")
NOT_INSTALLED = "not installed: run with --install"
OP_LABELS = {
    "save": "sync save (durable)",
    "cold_load": "cold load into live tensors",
    "warm_load": "warm load (again at once)",
    "async_stall": "async save: training stall",
    "async_durable": "async save: until durable",
    "async_first_stall": "async save: stall of the first save (buffers, workers)",
}


def log(message: str) -> None:
    print(f"[field {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- the contenders in this process --------------------------------------------------------


class Statereg(Contender):
    """statereg's default policy (no storage options but the root): a sync manager, and an
    `async: thread` one whose save() returns once the tensors are copied to host buffers."""

    name = "statereg"
    has_async = True
    warm_up_async = True

    def __init__(self, state: TrainingState, live: Flat, root: Path) -> None:
        super().__init__(live)
        self.roots = {"sync": root / "sync", "async": root / "async"}
        self.sync = manager(state, spec_for(str(self.roots["sync"]), io_threads=None))
        self.asynchronous = manager(state, spec_for(str(self.roots["async"]), io_threads=None,
                                                    save={"async": "thread"}))
        self.steps = {"sync": 0, "async": 0}

    def _which(self, path: Path) -> str:
        found = [k for k, root in self.roots.items() if root == path]
        if not found:
            raise ValueError(f"statereg's managers write to {self.roots}, not {path}")
        return found[0]

    def saves(self) -> dict[str, Callable[[Path], None]]:
        def save(path: Path) -> None:
            self._which(path)
            self.steps["sync"] += 1
            self.sync.save(step=self.steps["sync"])

        return {"save": save}

    def load(self, path: Path) -> None:
        which = self._which(path)
        (self.sync if which == "sync" else self.asynchronous).load(step=self.steps[which])

    def async_start(self, path: Path) -> Any:
        self._which(path)
        self.steps["async"] += 1
        return self.asynchronous.save(step=self.steps["async"])

    def async_finish(self, handle: Any) -> None:
        self.asynchronous.wait()

    def close(self) -> None:
        self.asynchronous.close()
        self.sync.close()


class TorchSave(Contender):
    """torch.save + fsync; torch.load(mmap=True) + copy_ into the live tensors."""

    name = "torch_save"

    def saves(self) -> dict[str, Callable[[Path], None]]:
        return {"save": lambda path: torch_save(self.live, path / "state.pt")}

    def load(self, path: Path) -> None:
        torch_mmap_load(path / "state.pt", self.live)


class Safetensors(Contender):
    """safetensors save_file + fsync; safe_open + get_tensor + copy_ into the live tensors."""

    name = "safetensors"

    def saves(self) -> dict[str, Callable[[Path], None]]:
        def save(path: Path) -> None:
            save_file(self.live, str(path / "state.safetensors"))
            fsync_path(path / "state.safetensors")

        return {"save": save}

    def load(self, path: Path) -> None:
        safetensors_load(path / "state.safetensors", self.live)


class PlainDcp(Contender):
    """Plain DCP: dcp.save with FileSystemWriter(thread_count=N) per N (fsync on by default),
    dcp.load in place; dcp.async_save with the writer's own blocking stager (its
    cache_staged_state_dict needs pinned memory, so it is off on a CPU-only host)."""

    name = "dcp"
    has_async = True
    warm_up_async = True

    def __init__(self, live: Flat, threads: list[int]) -> None:
        super().__init__(live)
        self.threads = threads

    def saves(self) -> dict[str, Callable[[Path], None]]:
        def save(path: Path, count: int) -> None:
            dcp.save(self.live, storage_writer=dcp.FileSystemWriter(path, thread_count=count),
                     no_dist=True)

        return {f"save_t{n}": lambda path, n=n: save(path, n) for n in self.threads}

    def load(self, path: Path) -> None:
        dcp.load(self.live, storage_reader=dcp.FileSystemReader(path), no_dist=True)

    def async_start(self, path: Path) -> Any:
        writer = dcp.FileSystemWriter(path, thread_count=max(self.threads))
        return dcp.async_save(self.live, storage_writer=writer, no_dist=True)

    def async_finish(self, handle: Any) -> None:
        handle.result()


# --- the peer virtualenv -------------------------------------------------------------------


def _worker_env() -> dict[str, str]:
    """This environment without PYTHON* variables: the other venv finds its own packages."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}


def _pip(python: Path, packages: list[str], install_log: Path) -> str:
    """`pip install` into the peer venv; "ok", or the reason it failed (its last line)."""
    command = [str(python), "-m", "pip", "install", "--disable-pip-version-check", *packages]
    log(f"pip install {' '.join(packages)} (into {python.parent.parent})")
    done = subprocess.run(command, capture_output=True, text=True, env=_worker_env(),
                          check=False, timeout=3600)
    with install_log.open("a") as f:
        f.write(f"$ {shlex.join(command)}\n{done.stdout}{done.stderr}\n")
    if done.returncode == 0:
        return "ok"
    errors = [line for line in done.stderr.splitlines()
              if line.strip() and not line.startswith("WARNING")]
    return f"install failed: {(errors or ['pip exit ' + str(done.returncode)])[-1].strip()}"


def install_peers(venv: Path, install_log: Path) -> dict[str, str]:
    """Create the peer venv (python -m venv) and install, each apart so that one that fails
    leaves the others: torch at this process's version, numpy and safetensors, then each peer
    package. Returns {package: "ok" | why it failed}."""
    python = venv / "bin" / "python"
    if not python.exists():
        log(f"creating the peer venv {venv}")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pin = f"torch=={torch.__version__}"
    outcome = {"torch, numpy, safetensors": _pip(python, [pin, "numpy", "safetensors"],
                                                 install_log)}
    if outcome["torch, numpy, safetensors"] != "ok":
        return outcome | dict.fromkeys(PEER_PACKAGES, "not tried: the base install failed")
    for package in PEER_PACKAGES:  # the torch pin keeps a peer from replacing torch
        outcome[package] = _pip(python, [pin, package], install_log)
    return outcome


def _run_worker(python: Path, job: dict[str, Any], folder: Path) -> dict[str, Any]:
    """Run field_worker.py on `job` with the peer venv's python; its JSON result."""
    folder.mkdir(parents=True, exist_ok=True)
    job_path, out_path = folder / "job.json", folder / "out.json"
    out_path.unlink(missing_ok=True)
    job_path.write_text(json.dumps(job))
    done = subprocess.run([str(python), str(WORKER), str(job_path), str(out_path)],
                          capture_output=True, text=True, env=_worker_env(), check=False,
                          timeout=7200)
    if done.returncode != 0 or not out_path.exists():
        lines = [x for x in done.stderr.strip().splitlines() if x.strip()]
        raise RuntimeError(f"worker exit {done.returncode}: {(lines or ['no output'])[-1]}")
    return json.loads(out_path.read_text())


def probe_peers(python: Path, folder: Path) -> dict[str, dict[str, str]]:
    """Which peers (and zipnn) import in the peer venv, with their versions."""
    names = [*PEERS, "zipnn"]
    if not python.exists():
        return {name: {"status": NOT_INSTALLED} for name in names}
    try:
        found = _run_worker(python, {"probe": True}, folder)
    except RuntimeError as exc:
        return {name: {"status": f"skipped: the peer venv does not run: {exc}"}
                for name in names}
    return found["peers"]


class WorkerPeer:
    """A peer run by field_worker.py in the peer venv, one process per repetition."""

    def __init__(self, name: str, python: Path, state_file: Path, root: Path,
                 drop_all: bool) -> None:
        self.name, self.python, self.state_file, self.root = name, python, state_file, root
        self.drop_all = drop_all
        self.notes: list[str] = []
        self.status = "ok"

    def run(self, first: bool) -> Rep | None:
        job = {"peer": self.name, "state": str(self.state_file), "root": str(self.root),
               "drop_all": self.drop_all, "check_async": first}
        try:
            result = _run_worker(self.python, job, self.root.parent / f"{self.name}-job")
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            self.status = f"skipped: {exc}"
            return None
        self.notes += [n for n in result["notes"] if n not in self.notes]
        if result["status"] != "ok":
            self.status = result["status"]
            return None
        rep = result["rep"]
        return Rep(seconds=rep["seconds"], async_consistent=rep["async_consistent"],
                   peaks={op: PeakRSS(start_gb=p["start_gb"], peak_gb=p["peak_gb"])
                          for op, p in rep["peaks"].items()})


# --- the run -------------------------------------------------------------------------------


def _label(op: str) -> str:
    if op.startswith("save_t"):
        return f"sync save, FileSystemWriter(thread_count={op[len('save_t'):]})"
    return OP_LABELS[op]


def _rows(reps: list[Rep], nbytes: int) -> dict[str, dict[str, Any]]:
    """One Timing row per operation over the repetitions (the worst repetition's peak RSS)."""
    rows: dict[str, dict[str, Any]] = {}
    for op in dict.fromkeys(op for rep in reps for op in rep.seconds):
        measured = [rep for rep in reps if op in rep.seconds]
        peak = max((rep.peaks[op] for rep in measured), key=lambda p: p.peak_gb)
        rows[op] = Timing(_label(op), [rep.seconds[op] for rep in measured], nbytes,
                          peak).to_json()
    return rows


def describe(state: TrainingState, params: float) -> dict[str, Any]:
    vocab, width, layers = shape_for(params)
    return {"dtype": str(state.dtype).removeprefix("torch."), "params": state.params,
            "vocab": vocab, "width": width, "layers": layers, "bytes": state.nbytes,
            "tensors": len(state.flat)}


# --- floors: the same bytes with nothing else ----------------------------------------------

_SLICE = 1 << 20
FLOOR_LABELS = {
    "cold_direct": "cold: raw O_DIRECT read of statereg's data files (8 MiB x 4 in flight)",
    "cold_buffered": "cold: buffered readinto of the same files, 2 threads (kernel readahead)",
    "warm_copy": "warm: readinto of the same files, 2 threads (the copy alone)",
    "warm_copy_hash": "warm: readinto + xxh3 per 1 MiB slice, 2 threads (copy and verify)",
}


def read_cached(paths: list[Path], buffers: dict[Path, bytearray], hashed: bool) -> None:
    """Read every file into its buffer, two files at a time as statereg's two reader threads
    do, hashing each slice while it is in the CPU's cache when `hashed` (what verifying as it
    reads costs at least)."""
    def one(path: Path) -> None:
        view, digest = memoryview(buffers[path]), xxhash.xxh3_64()
        with open(path, "rb", buffering=0) as f:
            at = 0
            while at < len(view):
                got = f.readinto(view[at:at + _SLICE])
                if not got:
                    raise AssertionError(f"{path} ended at {at} of {len(view)} bytes")
                if hashed:
                    digest.update(view[at:at + got])
                at += got

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(one, paths))


class Floors:
    """The disk's and the memory's limits on statereg's own files, measured in every
    repetition beside the contenders: a cold load cannot beat the faster raw read of the same
    bytes (O_DIRECT, or buffered with the kernel's readahead: which is faster depends on the
    disk), nor a verified warm load the copy plus its hash. The files are those of one
    statereg checkpoint of the state, written once (untimed) with the default settings."""

    def __init__(self, state: TrainingState, root: Path, evict: Callable[[Path], None]) -> None:
        mgr = manager(state, spec_for(str(root), io_threads=None))
        mgr.save(step=1)
        mgr.close()
        self.root, self.evict = root, evict
        self.seconds: dict[str, list[float]] = {op: [] for op in FLOOR_LABELS}
        self.paths = sorted(root.rglob("*.distcp"))
        self.buffers = {p: bytearray(p.stat().st_size) for p in self.paths}

    def run(self) -> None:
        paths = self.paths
        for op, read in (("cold_direct", lambda: read_direct(paths)),
                         ("cold_buffered", lambda: read_cached(paths, self.buffers, False)),
                         ("warm_copy", lambda: read_cached(paths, self.buffers, False)),
                         ("warm_copy_hash", lambda: read_cached(paths, self.buffers, True))):
            if op.startswith("cold"):
                self.evict(self.root)
            start = time.perf_counter()
            read()
            self.seconds[op].append(time.perf_counter() - start)

    def rows(self, nbytes: int) -> dict[str, dict[str, Any]]:
        return {op: Timing(FLOOR_LABELS[op], seconds, nbytes).to_json()
                for op, seconds in self.seconds.items() if seconds}


class Field:
    """The whole scenario: peers found (or installed), contenders measured, targets."""

    def __init__(self, args: argparse.Namespace, work: Path, out: Path) -> None:
        self.args, self.work, self.out = args, work, out
        self.venv = Path(args.peer_venv)
        self.python = self.venv / "bin" / "python"
        self.cache = PageCache(evict_only=args.evict_only)
        self.results: dict[str, Any] = {
            "scenario": "field",
            "command": " ".join(["python -m perfsuite.field", *map(shlex.quote,
                                                                     sys.argv[1:])]),
            "config": dict(vars(args)),
            "machine": machine_info(work),
            "page_cache": ("page cache dropped (/proc/sys/vm/drop_caches)"
                           if self.cache.droppable else
                           "files evicted with posix_fadvise(DONTNEED) (not drop_caches)"),
            "load_average": [round(os.getloadavg()[0], 2)],
            "contenders": {},
        }

    def evict(self, path: Path) -> None:
        """Make the next read of `path` cold (drop_caches, or evict its files)."""
        self.cache.roots = [path]
        self.cache.drop()

    def peer_venv(self) -> dict[str, dict[str, str]]:
        entry: dict[str, Any] = {"path": str(self.venv), "installed_now": self.args.install}
        if self.args.install:
            entry["install"] = install_peers(self.venv, self.out / "peer-install.log")
        found = probe_peers(self.python, self.work / "probe")
        entry["found"] = found
        self.results["peer_venv"] = entry
        for name, what in found.items():
            log(f"peer {name}: {what.get('version') or what['status']}")
        return found

    def contenders(self, state: TrainingState, live: Flat,
                   found: dict[str, dict[str, str]]) -> dict[str, Contender | WorkerPeer]:
        threads = [int(x) for x in self.args.dcp_threads.split(",") if x.strip()]
        made: dict[str, Contender | WorkerPeer] = {
            "statereg": Statereg(state, live, self.work / "statereg"),
            "torch_save": TorchSave(live), "safetensors": Safetensors(live),
            "dcp": PlainDcp(live, threads)}
        versions = {"statereg": f"statereg {statereg.__version__}",
                    "torch_save": f"torch {torch.__version__}",
                    "safetensors": f"safetensors {safetensors.__version__}",
                    "dcp": f"torch {torch.__version__}"}
        for name in IN_PROCESS:
            self.results["contenders"][name] = {
                "library": versions[name], "where": "main venv, in this process",
                "status": "ok", "has_async": made[name].has_async}
        state_file = self.work / "state.safetensors"
        for name in PEERS:
            what = found[name]
            entry = {"library": f"{PEERS[name][1]} {what.get('version', '')}".strip(),
                     "where": f"peer venv {self.venv}, field_worker.py",
                     "status": what.get("status", "ok"), "has_async": True}
            self.results["contenders"][name] = entry
            if entry["status"] == "ok":
                made[name] = WorkerPeer(name, self.python, state_file, self.work / name,
                                        not self.args.evict_only)
        if any(isinstance(c, WorkerPeer) for c in made.values()):
            save_file(live, str(state_file))  # what every worker loads (untimed)
        return made

    def measure(self, state: TrainingState) -> None:
        live = state.flat
        expected = {key: tensor.clone() for key, tensor in live.items()}
        made = self.contenders(state, live, self.peer_venv())
        reps: dict[str, list[Rep]] = {name: [] for name in made}
        consistent: dict[str, bool | None] = dict.fromkeys(made)
        names = list(made)
        floors = Floors(state, self.work / "floors", self.evict)
        for rep in range(self.args.reps):
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                contender = made[name]
                if isinstance(contender, WorkerPeer):
                    if contender.status != "ok":
                        continue
                    log(f"rep {rep + 1}/{self.args.reps}: {name} (peer venv)")
                    measured = contender.run(first=rep == 0)
                else:
                    log(f"rep {rep + 1}/{self.args.reps}: {name}")
                    measured = run_rep(contender, self.work / name, self.evict, expected,
                                       check_async=rep == 0,
                                       warm_up=contender.warm_up_async and rep == 0)
                if measured is not None:
                    reps[name].append(measured)
                    if measured.async_consistent is not None:
                        consistent[name] = measured.async_consistent
            log(f"rep {rep + 1}/{self.args.reps}: floors")
            floors.run()
        self.results["floors"] = floors.rows(state.nbytes)
        for name, contender in made.items():
            entry = self.results["contenders"][name]
            if isinstance(contender, WorkerPeer):
                entry["status"] = contender.status
            else:
                contender.close()
            entry["notes"] = contender.notes
            entry["async_consistent"] = consistent[name]
            entry["rows"] = _rows(reps[name], state.nbytes)
        for name, entry in self.results["contenders"].items():
            for key, empty in (("notes", []), ("async_consistent", None), ("rows", {})):
                entry.setdefault(key, empty)  # the same fields for a peer not run
            log(f"{name}: {entry['status']}")

    def compress(self, fp32: TrainingState) -> None:
        """The suite's compression section on the fp32 and bf16 states, zipnn in the venv."""
        folder = self.work / "compression"
        self.cache.roots = [folder]
        zipnn_python = self.args.zipnn_python
        found = self.results["peer_venv"]["found"]["zipnn"]
        if zipnn_python is None:
            zipnn_python = str(self.python) if "version" in found else "none"
        bf16 = build_bf16(fp32)
        self.results["states"]["bf16"] = describe(bf16, self.args.params)
        rows, data = compression.run([fp32, bf16], folder, self.args.reps, self.cache, 2,
                                     zipnn_python, 1)
        if zipnn_python == "none":
            data["zipnn"] = f"zipnn: {found['status']}"
        self.results["compression"] = {"rows": {k: r.to_json() for k, r in rows.items()},
                                       **data}

    def run(self) -> None:
        start = time.perf_counter()
        fp32 = build_fp32(self.args.params)
        self.results["states"] = {"fp32": describe(fp32, self.args.params)}
        log(f"built the fp32 state: {fp32.nbytes / GB:.2f} GB in {len(fp32.flat)} tensors")
        self.measure(fp32)
        self.compress(fp32)
        self.results["load_average"].append(round(os.getloadavg()[0], 2))
        self.results["targets"] = evaluate(self.results)
        self.results["bounds"] = bounds(self.results)
        self.results["elapsed_s"] = round(time.perf_counter() - start, 1)


# --- targets and report --------------------------------------------------------------------


def _median(results: dict[str, Any], contender: str, op: str) -> float | None:
    row = results["contenders"].get(contender, {}).get("rows", {}).get(op)
    return None if row is None else row["median_s"]


def _best(results: dict[str, Any], ops: Callable[[str], bool],
          keep: Callable[[dict[str, Any]], bool] = lambda entry: True,
          ) -> tuple[str, float] | None:
    """The fastest (contender/op, median) of every contender but statereg."""
    found = [(f"{name} {op}", row["median_s"])
             for name, entry in results["contenders"].items()
             if name != "statereg" and keep(entry)
             for op, row in entry.get("rows", {}).items() if ops(op)]
    return min(found, key=lambda x: x[1]) if found else None


def _target(text: str, ours: float | None, theirs: float | None, bar: float, op: str,
            missing: str) -> dict[str, Any]:
    """ours / theirs against `bar` (`op` is <= or >=); None where either was not measured."""
    if ours is None or not theirs:
        return {"target": text, "value": None, "bar": bar, "op": op, "met": None,
                "note": f"not measured ({missing})"}
    value = ours / theirs
    met = value <= bar if op == "<=" else value >= bar
    return {"target": text, "value": round(value, 3), "bar": bar, "op": op, "met": met}


def _combined(entry: dict[str, dict[str, Any]], who: str) -> float | None:
    """raw / stored over the weights and both moments of one dtype."""
    raw = stored = 0.0
    for kind in compression.RATIO_KINDS:
        value = entry.get(kind, {}).get(who)
        if not value:
            return None
        raw += entry[kind]["raw_bytes"]
        stored += entry[kind]["raw_bytes"] / value
    return raw / stored


def evaluate(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 29's targets on this run's medians (ratios: statereg's time over the other's)."""
    out = [_target("warm load: statereg / torch.load(mmap) + copy_",
                   _median(results, "statereg", "warm_load"),
                   _median(results, "torch_save", "warm_load"), 1.0, "<=", "torch_save")]
    best = _best(results, lambda op: op == "cold_load")
    out.append(_target(f"cold load: statereg / best peer ({best[0] if best else '—'})",
                       _median(results, "statereg", "cold_load"), best[1] if best else None, 0.8,
                       "<=", "no peer loaded"))
    best = _best(results, lambda op: op == "save" or op.startswith("save_t"))
    out.append(_target(f"sync save fastest of all: statereg / fastest peer "
                       f"({best[0] if best else '—'})", _median(results, "statereg", "save"),
                       best[1] if best else None, 1.0, "<=", "no peer saved"))
    best = _best(results, lambda op: op == "async_stall",
                 keep=lambda entry: entry.get("async_consistent") is not False)
    inconsistent = [n for n, e in results["contenders"].items()
                    if e.get("async_consistent") is False]
    text = (f"async stall fastest of those with async: statereg / fastest peer "
            f"({best[0] if best else '—'})")
    if inconsistent:
        text += f"; left out, not consistent: {', '.join(inconsistent)}"
    out.append(_target(text, _median(results, "statereg", "async_stall"), best[1] if best else None,
                       1.0, "<=", "no peer with an async save"))
    comp = results.get("compression", {})
    rows, ratios = comp.get("rows", {}), comp.get("ratios", {})
    for dtype in ("fp32", "bf16"):
        dcp_row, ours_row = rows.get(f"dcp_zstd_save_{dtype}"), rows.get(
            f"statereg_save_{dtype}")
        out.append(_target(f"compressed save, {dtype}: DCP ZStandard time / statereg zstd time",
                           dcp_row and dcp_row["median_s"], ours_row and ours_row["median_s"],
                           2.0, ">=", "compression"))
    for dtype in ("fp32", "bf16"):
        entry = ratios.get(dtype, {})
        out.append(_target(f"compression ratio, {dtype} weights + moments: statereg / zipnn",
                           _combined(entry, "statereg"), _combined(entry, "zipnn"), 1.0,
                           ">=", comp.get("zipnn") or "zipnn"))
    return out


def bounds(results: dict[str, Any]) -> list[dict[str, Any]]:
    """How close each load is to the floor under it, from the same run: when the best peer's
    cold load already runs at the disk's rate, no reader can take 0.8x its time; a verified
    warm load cannot go under the copy plus its hash."""
    floors = results.get("floors", {})

    def floor(op: str) -> float | None:
        return floors[op]["median_s"] if op in floors else None

    best = _best(results, lambda op: op == "cold_load")
    raw = min(((floor(op), how) for op, how in (("cold_direct", "O_DIRECT"),
                                                ("cold_buffered", "buffered"))
               if floor(op) is not None), default=(None, "—"))
    return [
        _target(f"cold: best peer ({best[0] if best else '—'}) / faster raw read ({raw[1]})",
                best[1] if best else None, raw[0], 1.0, ">=", "floors"),
        _target(f"cold: statereg / faster raw read ({raw[1]})",
                _median(results, "statereg", "cold_load"), raw[0], 1.0, ">=", "floors"),
        _target("warm: torch.load(mmap) + copy_ / readinto (copy alone)",
                _median(results, "torch_save", "warm_load"), floor("warm_copy"), 1.0, ">=",
                "floors"),
        _target("warm: statereg / readinto + xxh3 (copy and verify)",
                _median(results, "statereg", "warm_load"), floor("warm_copy_hash"), 1.0, ">=",
                "floors"),
    ]


def _seconds(value: float) -> str:
    return f"{value:.3f}" if value < 10 else f"{value:.1f}"


def markdown(results: dict[str, Any]) -> str:
    m, config = results["machine"], results["config"]
    disk = m["disk"]
    state = results["states"]["fp32"]
    lines = [
        "## Field: statereg against its peers on one training state", "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gb']} GB; disk under test "
        f"{disk['device']} ({disk['fstype']}) at {disk['path']}; kernel {m['kernel']}; "
        f"torch {m['torch']}, statereg {m['statereg']}, Python {m['python']}; {m['date']}; "
        f"load average {' -> '.join(map(str, results['load_average']))}.", "",
        f"Command: `{results['command']}`; {results['page_cache']} before each cold load; "
        f"{config['reps']} repetition(s), contenders in rotated order.", "",
        f"State: {state['params'] / 1e6:.1f}M parameters (vocab {state['vocab']}, width "
        f"{state['width']}, {state['layers']} layers) after one AdamW step, fp32 weights and "
        f"moments: {state['bytes'] / GB:.3f} GB in {state['tensors']} tensors.", "",
        "| contender | library | where | status | async consistent |", "|---|---|---|---|---|"]
    for name, entry in results["contenders"].items():
        consistent = {True: "yes", False: "**no**", None: "—"}[entry.get("async_consistent")]
        lines.append(f"| {name} | {entry['library']} | {entry['where']} | {entry['status']} "
                     f"| {consistent} |")
    lines += ["", "| contender | operation | median s | min-max s | GB/s | peak RSS GB |",
              "|---|---|---|---|---|---|"]
    for name, entry in results["contenders"].items():
        for row in entry.get("rows", {}).values():
            rate = "—" if row["gb_per_s"] is None else f"{row['gb_per_s']:.2f}"
            lines.append(f"| {name} | {row['label']} | {_seconds(row['median_s'])} | "
                         f"{_seconds(row['min_s'])}-{_seconds(row['max_s'])} | {rate} | "
                         f"{row['peak_rss_gb']:.2f} |")
    floors = results.get("floors", {})
    if floors:
        lines += ["", "Floors, on statereg's data files in the same repetitions:", "",
                  "| floor | median s | min-max s | GB/s |", "|---|---|---|---|"]
        for row in floors.values():
            lines.append(f"| {row['label']} | {_seconds(row['median_s'])} | "
                         f"{_seconds(row['min_s'])}-{_seconds(row['max_s'])} | "
                         f"{row['gb_per_s']:.2f} |")
    notes = [f"- {name}: {note}" for name, entry in results["contenders"].items()
             for note in entry.get("notes", [])]
    if notes:
        lines += ["", "Notes:", *notes]
    comp = results.get("compression", {})
    if comp.get("rows"):
        lines += ["", "### Compression (statereg zstd -3 float-aware, DCP ZStandard)", "",
                  "| operation | median s | min-max s | GB/s |", "|---|---|---|---|"]
        for row in comp["rows"].values():
            rate = "—" if row["gb_per_s"] is None else f"{row['gb_per_s']:.2f}"
            lines.append(f"| {row['label']} | {_seconds(row['median_s'])} | "
                         f"{_seconds(row['min_s'])}-{_seconds(row['max_s'])} | {rate} |")
        lines += ["", f"Compression ratio (raw / stored); {comp.get('zipnn')}.", "",
                  *report._ratio_table(comp["ratios"])]
    lines += ["", "### Targets (issue 29, from this one run)", "",
              *report._targets_table(results["targets"])]
    if results.get("bounds"):
        lines += ["", "### Against the floors (a ratio near 1.0: at the limit of the machine)",
                  "", *report._targets_table(results["bounds"])]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=125e6,
                        help="parameters of the fp32 model (125e6: a 1.5 GB state)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions (3)")
    parser.add_argument("--dir", default=None,
                        help="the disk under test (default: a temporary folder)")
    parser.add_argument("--out", default="field-results",
                        help="folder for field.json and field.md (default ./field-results)")
    parser.add_argument("--peer-venv", default=DEFAULT_VENV,
                        help=f"the peers' virtualenv (default {DEFAULT_VENV})")
    parser.add_argument("--install", action="store_true",
                        help="create the peer venv if needed and pip install torch "
                             f"{torch.__version__} and the peers into it (the only option "
                             "that downloads anything)")
    parser.add_argument("--zipnn-python", default=None,
                        help="python of a venv with zipnn (default: the peer venv's)")
    parser.add_argument("--dcp-threads", default="1,2",
                        help="FileSystemWriter thread counts, one row each (1,2)")
    parser.add_argument("--evict-only", action="store_true",
                        help="evict only the checkpoint's files (posix_fadvise), never the "
                             "whole page cache: kinder to other jobs on a shared machine")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: a 0.2M-parameter model, one repetition, --evict-only")
    args = parser.parse_args(argv)
    if args.quick:
        args.params, args.reps, args.evict_only = 2e5, 1, True
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="statereg-field-", dir=args.dir))
    try:
        field = Field(args, work, out)
        field.run()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    (out / "field.json").write_text(json.dumps(field.results, indent=1, default=str))
    table = markdown(field.results)
    (out / "field.md").write_text(table)
    print(table)
    log(f"done in {field.results['elapsed_s']:.0f} s; wrote {out / 'field.json'} and "
        f"{out / 'field.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
