"""The cold load, side by side in one run: statereg, torch.load(mmap=True) + copy_, raw reads.

Run by hand (see docs/performance.md, "Cold load"):

    cd benchmarks && ../.venv/bin/python -m perfsuite.cold_load --params 125e6 --reps 5

One fp32 transformer after a real AdamW step (weights and two moments: 12 bytes a
parameter, 1.5 GB at 125M parameters) is saved once by statereg and once by `torch.save`.
Then, for each repetition, in an order rotated from one repetition to the next so that a
drifting disk favours no one, the page cache is emptied and each of these loads the state
into the live model and optimizer tensors:

- statereg: `CheckpointManager.load` (verify=fast: every item checked against its digest);
- statereg, buffered: the same load with O_DIRECT refused, as on a filesystem without it
  (the buffered fallback, which is how every load read before O_DIRECT);
- torch.load(mmap=True) + copy_: what `load_state_dict` does after an mmap load;
- raw read, buffered: statereg's data files, one after another, `readinto` preallocated
  buffers on one thread (the suite's cold-read floor);
- raw read, O_DIRECT: the same files in 8 MiB aligned reads, 4 in flight (what the disk
  gives without the page cache).

The page cache is dropped through /proc/sys/vm/drop_caches where that is permitted, else every
file under the work folder is evicted with posix_fadvise(POSIX_FADV_DONTNEED) after a sync
(the report says which). Prints one JSON object: seconds per repetition, medians, and the
ratios of the medians.
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
from statereg.backends import local

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


def buffered_load(load: Callable[[], None]) -> None:
    """`load` with O_DIRECT refused, as a filesystem without it refuses it."""
    refuse = local._set_direct
    local._set_direct = lambda fd, on: False
    try:
        load()
    finally:
        local._set_direct = refuse


def torch_mmap_load(path: Path, live: dict[str, torch.Tensor]) -> None:
    loaded = torch.load(path, mmap=True, weights_only=True)
    for key, tensor in live.items():
        tensor.copy_(loaded[key])


def run(params: float, reps: int, work: Path) -> dict[str, Any]:
    state = build_fp32(params)
    live = state.flat
    expected = {key: tensor.clone() for key, tensor in live.items()}
    root = work / "statereg"
    saves = Saves(state, spec_for(str(root)))
    saves.save()
    pt = work / "state.pt"
    torch.save(live, pt)
    data_files = sorted(root.rglob("*.distcp"))
    buffers = {path: bytearray(path.stat().st_size) for path in data_files}
    cache = PageCache(roots=[work])

    def check(what: str) -> None:
        for key, tensor in live.items():
            if not torch.equal(tensor, expected[key]):
                raise AssertionError(f"{what} did not load {key!r}")
            tensor.zero_()

    loads = {
        "statereg": saves.load,
        "statereg_buffered": lambda: buffered_load(saves.load),
        "torch_mmap": lambda: torch_mmap_load(pt, live),
        "raw_buffered": lambda: read_buffered(data_files, buffers),
        "raw_direct": lambda: read_direct(data_files),
    }
    seconds: dict[str, list[float]] = {name: [] for name in loads}
    names = list(loads)
    for rep in range(reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            cache.drop()
            start = time.perf_counter()
            loads[name]()
            seconds[name].append(time.perf_counter() - start)
            if name in ("statereg", "statereg_buffered", "torch_mmap"):
                check(name)
        for key, tensor in live.items():
            tensor.copy_(expected[key])
    medians = {name: statistics.median(times) for name, times in seconds.items()}
    nbytes = sum(t.nbytes for t in live.values())
    return {
        "machine": machine_info(work),
        "command": " ".join([Path(sys.executable).name, "-m", "perfsuite.cold_load",
                             *sys.argv[1:]]),
        "page_cache": cache.how,
        "state": {"params": state.params, "shape": shape_for(params), "gb": nbytes / GB,
                  "tensors": len(live), "data_files": len(data_files),
                  "data_gb": sum(p.stat().st_size for p in data_files) / GB},
        "seconds": {name: [round(s, 3) for s in times] for name, times in seconds.items()},
        "median_s": {name: round(m, 3) for name, m in medians.items()},
        "gb_per_s": {name: round(nbytes / m / GB, 2) for name, m in medians.items()},
        "ratios": {
            "statereg_vs_torch_mmap": round(medians["torch_mmap"] / medians["statereg"], 2),
            "statereg_vs_raw_buffered": round(medians["raw_buffered"] / medians["statereg"], 2),
            "statereg_vs_raw_direct": round(medians["raw_direct"] / medians["statereg"], 2),
            "statereg_vs_statereg_buffered": round(
                medians["statereg_buffered"] / medians["statereg"], 2),
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
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="statereg-cold-", dir=args.dir) as folder:
        print(json.dumps(run(args.params, args.reps, Path(folder)), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
