"""Cold and warm loads, side by side in one run: statereg under each page-cache policy,
torch.load(mmap=True) + copy_, safetensors, raw reads.

Run by hand (see benchmarks/results/journal.md, "Cold load" and "The page cache"):

    cd benchmarks && ../.venv/bin/python -m perfsuite.cold_load --params 125e6 --reps 5
    cd benchmarks && ../.venv/bin/python -m perfsuite.cold_load --quick   # smoke test

One fp32 transformer after a real AdamW step (weights and two moments: 12 bytes a
parameter, 1.5 GB at 125M parameters) is saved once by statereg, once by `torch.save` and
once by safetensors. Then, for each repetition, in an order rotated from one repetition to
the next so that a drifting disk favours no one, the page cache is emptied and each of these
loads the state into the live model and optimizer tensors, cold, then at once again, warm
(what a notebook re-running a cell, an evaluation after a resume or a retry sees):

- statereg: `CheckpointManager.load` under the default `storage.read_cache: auto`
  (verify=fast: every item checked against its digest);
- statereg, bypass: the same load with `read_cache: bypass` (O_DIRECT, nothing cached);
- torch.load(mmap=True) + copy_: what `load_state_dict` does after an mmap load;
- safetensors: `safe_open` + `get_tensor` + copy_ (skipped where safetensors is missing);
- raw read, buffered: statereg's data files, one after another, `readinto` preallocated
  buffers on one thread (the suite's cold-read floor);
- raw read, O_DIRECT: the same files in 8 MiB aligned reads, 4 in flight (what the disk
  gives without the page cache).

The page cache is dropped through /proc/sys/vm/drop_caches where that is permitted, else every
file under the work folder is evicted with posix_fadvise(POSIX_FADV_DONTNEED) after a sync
(the report says which). Prints one JSON object: seconds per repetition, medians, the ratios
of the medians, and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from perfsuite.measure import GB, PageCache, machine_info
from perfsuite.statereg_io import Saves, spec_for
from perfsuite.workload import build_fp32, shape_for

_CHUNK = 8 << 20
_IN_FLIGHT = 4


def read_buffered(paths: list[Path], buffers: dict[Path, bytearray]) -> None:
    for path in paths:
        view = memoryview(buffers[path])
        with open(path, "rb", buffering=0) as f:
            while view:
                view = view[f.readinto(view):]


def read_direct(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            size = os.fstat(fd).st_size

            def chunk(offset: int, fd: int = fd) -> int:
                buffer = mmap.mmap(-1, _CHUNK)
                try:
                    return os.preadv(fd, [buffer], offset)
                finally:
                    buffer.close()

            with ThreadPoolExecutor(_IN_FLIGHT) as pool:
                if sum(pool.map(chunk, range(0, size, _CHUNK))) != size:
                    raise AssertionError(f"short O_DIRECT read of {path}")
        finally:
            os.close(fd)


def torch_mmap_load(path: Path, live: dict[str, torch.Tensor]) -> None:
    loaded = torch.load(path, mmap=True, weights_only=True)
    for key, tensor in live.items():
        tensor.copy_(loaded[key])


def safetensors_load(path: Path, live: dict[str, torch.Tensor]) -> None:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as loaded:
        for key, tensor in live.items():
            tensor.copy_(loaded.get_tensor(key))


def run(params: float, reps: int, work: Path, drop_all: bool = True) -> dict[str, Any]:
    state = build_fp32(params)
    live = state.flat
    expected = {key: tensor.clone() for key, tensor in live.items()}
    root = work / "statereg"
    saves = Saves(state, spec_for(str(root)))
    saves.save()
    bypass_spec = spec_for(str(root))
    bypass_spec["storage"]["read_cache"] = "bypass"
    bypass = Saves(state, bypass_spec)
    bypass.step = saves.step
    pt = work / "state.pt"
    torch.save(live, pt)
    st = work / "state.safetensors"
    try:
        from safetensors.torch import save_file
        save_file(live, str(st))
    except ImportError:
        st = None
    data_files = sorted(root.rglob("*.distcp"))
    buffers = {path: bytearray(path.stat().st_size) for path in data_files}
    cache = PageCache(roots=[work], evict_only=not drop_all)

    def check(what: str) -> None:
        for key, tensor in live.items():
            if not torch.equal(tensor, expected[key]):
                raise AssertionError(f"{what} did not load {key!r}")
            tensor.zero_()

    loads: dict[str, Callable[[], None]] = {
        "statereg": saves.load,
        "statereg_bypass": bypass.load,
        "torch_mmap": lambda: torch_mmap_load(pt, live),
        "raw_buffered": lambda: read_buffered(data_files, buffers),
        "raw_direct": lambda: read_direct(data_files),
    }
    if st is not None:
        loads["safetensors"] = lambda: safetensors_load(st, live)
    checked = {"statereg", "statereg_bypass", "torch_mmap", "safetensors"}
    warm_too = checked
    seconds: dict[str, list[float]] = {name: [] for name in loads}
    seconds.update({f"{name}_warm": [] for name in loads if name in warm_too})
    names = list(loads)
    load_average = [os.getloadavg()[0]]
    for rep in range(reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            cache.drop()
            for label in (name, f"{name}_warm") if name in warm_too else (name,):
                start = time.perf_counter()
                loads[name]()
                seconds[label].append(time.perf_counter() - start)
                if name in checked:
                    check(label)
        for key, tensor in live.items():
            tensor.copy_(expected[key])
    load_average.append(os.getloadavg()[0])
    medians = {name: statistics.median(times) for name, times in seconds.items()}
    nbytes = sum(t.nbytes for t in live.values())
    cold_peers = [n for n in ("torch_mmap", "safetensors") if n in medians]
    best_peer = min(cold_peers, key=lambda n: medians[n])
    return {
        "machine": machine_info(work),
        "command": " ".join([Path(sys.executable).name, "-m", "perfsuite.cold_load",
                             *sys.argv[1:]]),
        "page_cache": cache.how,
        "load_average": load_average,
        "state": {"params": state.params, "shape": shape_for(params), "gb": nbytes / GB,
                  "tensors": len(live), "data_files": len(data_files),
                  "data_gb": sum(p.stat().st_size for p in data_files) / GB},
        "seconds": {name: [round(s, 3) for s in times] for name, times in seconds.items()},
        "median_s": {name: round(m, 3) for name, m in medians.items()},
        "gb_per_s": {name: round(nbytes / m / GB, 2) for name, m in medians.items()},
        "ratios": {  # statereg's time over the other's: below 1.0, statereg is faster
            "warm_statereg_over_torch_mmap": round(
                medians["statereg_warm"] / medians["torch_mmap_warm"], 2),
            f"cold_statereg_over_best_peer_{best_peer}": round(
                medians["statereg"] / medians[best_peer], 2),
            f"cold_statereg_bypass_over_best_peer_{best_peer}": round(
                medians["statereg_bypass"] / medians[best_peer], 2),
            "cold_statereg_over_statereg_bypass": round(
                medians["statereg"] / medians["statereg_bypass"], 2),
            "warm_statereg_bypass_over_torch_mmap": round(
                medians["statereg_bypass_warm"] / medians["torch_mmap_warm"], 2),
            "cold_statereg_over_raw_direct": round(
                medians["statereg"] / medians["raw_direct"], 2),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=125e6,
                        help="parameters of the fp32 model (125e6: a 1.5 GB state)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions of each load (5)")
    parser.add_argument("--dir", default=None,
                        help="the disk under test (default: a temporary folder)")
    parser.add_argument("--evict-only", action="store_true",
                        help="evict only this run's files (posix_fadvise), never the whole "
                             "page cache: kinder to other jobs on a shared machine")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: a 0.2M-parameter model, one repetition, --evict-only")
    args = parser.parse_args(argv)
    if args.quick:
        args.params, args.reps, args.evict_only = 2e5, 1, True
    with tempfile.TemporaryDirectory(prefix="statereg-cold-", dir=args.dir) as folder:
        print(json.dumps(run(args.params, args.reps, Path(folder), not args.evict_only), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
