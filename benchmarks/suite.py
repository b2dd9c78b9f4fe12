"""statereg's performance suite: one command, one JSON result and one markdown table.

Run by hand (not a test; see docs/performance.md):

    .venv/bin/python benchmarks/suite.py --out /tmp/statereg-suite

Builds a ~250M-parameter transformer in fp32 after a real AdamW step (weights + two moments,
~3 GB) and a bf16 variant, then measures, as medians of --reps repetitions with min-max and
peak RSS: the physical floor, peers (torch.save, safetensors, plain DCP), statereg's sync,
async and compressed saves and loads, every storage backend against raw fsspec, and scale in
tensor count and world size. `--only` picks sections; `--quick` runs tiny sizes, 1 repetition.

Named scenarios beyond the default sections, run only when `--only` names them (each was a
standalone script; benchmarks/README.md lists every scenario with its last recorded figure):
  save_load  statereg save/load against plain DCP on a stack of Linear layers (`--gb`)
  ratios     compression ratio per tensor kind on synthetic stand-ins (`--numel`), no timings
"""

from __future__ import annotations

import os

# gcsfs picks its filesystem class at import; the experimental one waits on a gRPC lookup an
# emulator never answers. Set before anything can import gcsfs.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

import argparse
import gc
import json
import shlex
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from perfsuite import (
    backends,
    compression,
    floor,
    peers,
    ranks,
    ratios,
    report,
    save_load,
    scale,
    statereg_io,
    targets,
)
from perfsuite.measure import PEAK_RESETS, PageCache, Timing, machine_info
from perfsuite.workload import TrainingState, build_bf16, build_fp32, shape_for

SECTIONS = ("floor", "peers", "statereg", "compression", "backends", "scale", "ranks")
# Run only when --only names them: they measure on states of their own, not the suite's.
EXTRA_SCENARIOS = ("save_load", "ratios")
SCENARIOS = SECTIONS + EXTRA_SCENARIOS
# Scenarios that build their own states: the transformer states are released before them.
OWN_STATES = ("backends", "scale", "ranks", *EXTRA_SCENARIOS)
FULL = {"params": 250e6, "reps": 3, "object_mb": 256.0, "scale_tensors": "1000,10000,100000",
        "scale_reps": 1, "world_sizes": "1,2,4", "ranks_params": 50e6, "dcp_threads": "1,2,4",
        "zipnn_reps": 1, "gb": 1.0, "stack_width": 2048, "numel": 16 << 20}
QUICK = {"params": 2e6, "reps": 1, "object_mb": 8.0, "scale_tensors": "100,1000",
         "scale_reps": 1, "world_sizes": "1,2", "ranks_params": 2e6, "dcp_threads": "1,2",
         "zipnn_reps": 1, "gb": 0.002, "stack_width": 256, "numel": 1 << 12}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(SECTIONS),
                        help=f"comma-separated sections (default: {','.join(SECTIONS)}); the "
                             f"scenarios {','.join(EXTRA_SCENARIOS)} run only when named")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes and 1 repetition (a smoke run, under 2 minutes)")
    parser.add_argument("--out", default="suite-results",
                        help="folder for suite.json and suite.md (default ./suite-results)")
    parser.add_argument("--dir", default=None,
                        help="where checkpoints are written: the disk under test "
                             "(default: a temporary folder)")
    parser.add_argument("--keep-page-cache", action="store_true",
                        help="never drop the page cache (loads may then be warm)")
    sizes = parser.add_argument_group("sizes (defaults: full run; --quick: tiny)")
    sizes.add_argument("--params", type=float, help="parameters of the fp32 model (250e6)")
    sizes.add_argument("--reps", type=int, help="repetitions per measurement (3)")
    sizes.add_argument("--object-mb", type=float,
                       help="state size in MB for the storage backends (256)")
    sizes.add_argument("--scale-tensors", help="tensor counts (1000,10000,100000)")
    sizes.add_argument("--scale-numel", type=int, default=256,
                       help="fp32 elements per tensor in the scale states (256)")
    sizes.add_argument("--scale-reps", type=int,
                       help="repetitions of the scale saves and loads (1: a 100k-tensor save "
                            "takes about a minute)")
    sizes.add_argument("--scale-load-max", type=int, default=10000,
                       help="time loads of scale states up to this many tensors (10000)")
    sizes.add_argument("--world-sizes", help="gloo world sizes (1,2,4)")
    sizes.add_argument("--ranks-params", type=float,
                       help="parameters of the model sharded over the ranks (50e6)")
    sizes.add_argument("--dcp-threads", help="FileSystemWriter thread counts tried (1,2,4)")
    sizes.add_argument("--stores", default=",".join(backends.STORES),
                       help="storage backends (local,memory,s3,gcs)")
    sizes.add_argument("--zipnn-python",
                       default=os.environ.get("ZIPNN_PYTHON", "/tmp/zvenv/bin/python"),
                       help="python of a separate virtualenv with zipnn; 'none' skips zipnn "
                            "(default: $ZIPNN_PYTHON or /tmp/zvenv/bin/python)")
    sizes.add_argument("--zipnn-reps", type=int,
                       help="zipnn compressions per tensor kind (1: only its ratio is a target)")
    sizes.add_argument("--gb", type=float,
                       help="save_load: state size in GB (1.0)")
    sizes.add_argument("--stack-width", type=int,
                       help="save_load: width of the Linear layers (2048; --quick: 256)")
    sizes.add_argument("--numel", type=int,
                       help="ratios: elements per stand-in tensor (16777216)")
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(args.sections) - set(SCENARIOS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {','.join(SCENARIOS)}")
    return args


def _ints(text: str) -> list[int]:
    return [int(float(x)) for x in text.split(",") if x.strip()]


def describe(state: TrainingState, params: float) -> dict[str, Any]:
    vocab, width, layers = shape_for(params)
    return {"dtype": str(state.dtype).removeprefix("torch."), "params": state.params,
            "vocab": vocab, "width": width, "layers": layers, "bytes": state.nbytes,
            "tensors": len(state.flat), "bytes_by_kind": state.bytes_by_kind()}


class Suite:
    """Runs the chosen sections in order, holding the big states only while they are needed."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.work = work
        self.cache = PageCache(allowed=not args.keep_page_cache)
        self.results: dict[str, Any] = {
            "command": " ".join(["python benchmarks/suite.py",
                                 *map(shlex.quote, sys.argv[1:])]),
            "config": {k: v for k, v in vars(args).items() if k != "sections"},
            "machine": machine_info(work),
            "page_cache_dropped": self.cache.droppable,
            "peak_rss_per_operation": PEAK_RESETS,
            "states": {}, "sections": {},
        }
        self._fp32: TrainingState | None = None
        self._bf16: TrainingState | None = None

    def fp32(self) -> TrainingState:
        if self._fp32 is None:
            self._fp32 = self._build("fp32", lambda: build_fp32(self.args.params),
                                     self.args.params)
        return self._fp32

    def bf16(self) -> TrainingState:
        if self._bf16 is None:
            self._bf16 = self._build("bf16", lambda: build_bf16(self.fp32()), self.args.params)
        return self._bf16

    def _build(self, name: str, build: Callable[[], TrainingState],
               params: float) -> TrainingState:
        start = time.perf_counter()
        state = build()
        self.results["states"][name] = describe(state, params)
        log(f"built {name} state: {state.nbytes / 1e9:.2f} GB in {len(state.flat)} tensors "
            f"({time.perf_counter() - start:.0f} s)")
        return state

    def release_states(self) -> None:
        self._fp32 = self._bf16 = None
        gc.collect()

    def section(self, name: str) -> tuple[dict[str, Timing], dict[str, Any]]:
        a, work, cache = self.args, self.work / name, self.cache
        work.mkdir(parents=True, exist_ok=True)
        if name == "floor":
            state = self.fp32()
            return floor.run(list(state.flat.values()), state.nbytes, work, a.reps, cache), {}
        if name == "peers":
            state = self.fp32()
            return peers.run(state.flat, state.nbytes, work, a.reps, cache,
                             _ints(a.dcp_threads)), {}
        if name == "statereg":
            return statereg_io.run(self.fp32(), work, a.reps, cache), {}
        if name == "compression":
            return compression.run([self.fp32(), self.bf16()], work, a.reps, cache, 2,
                                   a.zipnn_python, a.zipnn_reps)
        if name == "backends":
            params = a.object_mb * 1e6 / 12  # fp32 weights + two moments: 12 bytes a parameter
            state = self._build("object-store", lambda: build_fp32(params), params)
            return backends.run(state, work, a.reps, cache,
                                [s.strip() for s in a.stores.split(",") if s.strip()])
        if name == "scale":
            return scale.run(_ints(a.scale_tensors), a.scale_numel, work, a.scale_reps, cache,
                             a.scale_load_max)
        if name == "save_load":
            return save_load.run(a.gb, work, a.reps, cache, a.stack_width)
        if name == "ratios":
            return ratios.run(a.numel, work, a.zipnn_python)
        return ranks.run(_ints(a.world_sizes), a.ranks_params, work, a.reps,
                         cache.droppable)

    def run(self) -> bool:
        ok = True
        for name in SCENARIOS:
            if name not in self.args.sections:
                continue
            if name in OWN_STATES:
                self.release_states()
            log(f"section {name} ...")
            start = time.perf_counter()
            entry: dict[str, Any] = {}
            try:
                rows, data = self.section(name)
                entry = {"rows": {k: r.to_json() for k, r in rows.items()}, "data": data}
            except Exception as exc:  # keep the other sections' results
                ok = False
                entry = {"rows": {}, "error": f"{type(exc).__name__}: {exc}"}
                traceback.print_exc()
            entry["elapsed_s"] = round(time.perf_counter() - start, 1)
            self.results["sections"][name] = entry
            shutil.rmtree(self.work / name, ignore_errors=True)
            log(f"section {name} done in {entry['elapsed_s']:.0f} s")
        self.release_states()
        self.results["targets"] = targets.evaluate(self.results)
        return ok


def log(message: str) -> None:
    print(f"[suite {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="statereg-suite-", dir=args.dir))
    started = time.perf_counter()
    try:
        suite = Suite(args, work)
        ok = suite.run()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    suite.results["elapsed_s"] = round(time.perf_counter() - started, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "suite.json").write_text(json.dumps(suite.results, indent=1, default=str))
    table = report.markdown(suite.results)
    (out / "suite.md").write_text(table)
    print(table)
    log(f"done in {suite.results['elapsed_s']:.0f} s; wrote {out / 'suite.json'} and "
        f"{out / 'suite.md'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
