"""statereg save/load against plain torch.distributed.checkpoint on the same state and disk.

Run by hand (not a test):  .venv/bin/python benchmarks/bench_save_load.py --gb 1 --reps 3
Prints a markdown table of medians (min-max) and ratios measured in this one run, and what
the zip records' CRC-32 (which torch.save computes for every tensor record) costs on this state.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from perfsuite.measure import drop_caches
from perfsuite.workload import linear_stack

import statereg


def timed(fn: Callable[[], None], reps: int, before: Callable[[], None]) -> list[float]:
    times = []
    for _ in range(reps):
        before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def crc_seconds(tensors: list[torch.Tensor], reps: int) -> float:
    """CPU seconds (min of `reps`) of zlib.crc32 over every tensor's bytes.

    torch.save computes the same CRC-32 for each zip record, at the speed of zlib.crc32
    (docs/performance.md), so this is what correct CRCs add to a save's CPU time.
    """
    best = float("inf")
    for _ in range(reps):
        start = time.process_time()
        for tensor in tensors:
            zlib.crc32(tensor.detach().reshape(-1).view(torch.uint8).numpy())
        best = min(best, time.process_time() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gb", type=float, default=1.0, help="state size in GB")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", default=None, help="also write results to this JSON file")
    args = parser.parse_args()

    torch.manual_seed(0)
    model, opt = linear_stack(args.gb)
    flat = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, entries in enumerate(opt.state.values()):
        flat |= {f"optim.{i}.{k}": v for k, v in entries.items() if isinstance(v, torch.Tensor)}
    nbytes = sum(t.nbytes for t in flat.values())
    base = Path(tempfile.mkdtemp(prefix="statereg-bench-", dir=args.dir))
    cold = drop_caches()
    results: dict[str, list[float]] = {}
    counter = iter(range(10**6))

    def fresh(name: str) -> Path:
        path = base / f"{name}-{next(counter)}"
        return path

    def clear() -> None:
        for child in base.iterdir():
            shutil.rmtree(child)

    for threads in (1, 2):
        def dcp_save(t: int = threads) -> None:
            dcp.save(flat, storage_writer=dcp.FileSystemWriter(fresh("dcp"), thread_count=t),
                     no_dist=True)
        results[f"plain dcp.save, thread_count={threads}"] = timed(dcp_save, args.reps, clear)

    spec = {"storage": {"url": str(base / "sr")},
            "components": {"model": {"kind": "model"}, "optimizer": {"kind": "optimizer"}}}
    step = iter(range(10**6))

    def sr_save() -> None:
        mgr = statereg.CheckpointManager(spec, model=model, optimizer=opt)
        mgr.save(step=next(step))

    results["statereg save (io_threads=2)"] = timed(sr_save, args.reps, clear)

    # Loads: one checkpoint of each, page cache dropped before each read where permitted.
    clear()
    dcp_dir = fresh("dcp")
    dcp.save(flat, storage_writer=dcp.FileSystemWriter(dcp_dir, thread_count=2), no_dist=True)
    sr_save()
    targets = {k: torch.empty_like(v) for k, v in flat.items()}

    def before_load() -> None:
        if cold:
            drop_caches()

    results["plain dcp.load"] = timed(
        lambda: dcp.load(targets, checkpoint_id=dcp_dir, no_dist=True), args.reps, before_load)
    mgr = statereg.CheckpointManager(spec, model=model, optimizer=opt)
    results["statereg load (verify=fast)"] = timed(lambda: mgr.load(), args.reps, before_load)
    shutil.rmtree(base)

    print(f"state: {nbytes / 1e9:.2f} GB ({len(flat)} tensors), page cache dropped: {cold}")
    print("| operation | median s | min-max s | GB/s |")
    print("|---|---|---|---|")
    for name, times in results.items():
        med = statistics.median(times)
        spread = f"{min(times):.2f}-{max(times):.2f}"
        print(f"| {name} | {med:.2f} | {spread} | {nbytes / med / 1e9:.2f} |")
    best_dcp_save = min(statistics.median(v) for k, v in results.items() if "dcp.save" in k)
    ratio_save = best_dcp_save / statistics.median(results["statereg save (io_threads=2)"])
    ratio_load = (statistics.median(results["plain dcp.load"])
                  / statistics.median(results["statereg load (verify=fast)"]))
    print(f"\nstatereg save speed / best plain DCP save: {ratio_save:.2f}x")
    print(f"statereg load speed / plain DCP load: {ratio_load:.2f}x")
    crc = crc_seconds(list(flat.values()), args.reps)
    crc_share = crc / statistics.median(results["statereg save (io_threads=2)"])
    print(f"zip CRC-32 of every tensor record: {crc:.2f} s of CPU "
          f"({nbytes / crc / 2**30:.1f} GiB/s), {100 * crc_share:.0f}% of the statereg save median "
          "(spread over its writer threads)")
    if args.json:
        Path(args.json).write_text(json.dumps({"bytes": nbytes, "cold": cold, "seconds": results,
                                               "save_ratio": ratio_save,
                                               "load_ratio": ratio_load, "crc_cpu_s": crc},
                                              indent=1))


if __name__ == "__main__":
    main()
