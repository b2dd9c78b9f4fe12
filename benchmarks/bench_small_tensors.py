"""CPU seconds per save and per load of many small tensors (per-tensor Python work).

The small shape of the S3 scenario (benchmarks/perfsuite/s3.py `--shapes small`) without the
server: --count tensors of --min-kb to --max-kb (log-uniform, fp32) saved by a
CheckpointManager and loaded back into the same tensors, into each --url (default a
`memory://` root and a local temporary directory). It reports process CPU time, which a
loaded machine leaves meaningful where wall time is not, and with --profile the top of a
cProfile of one save and one load. Every load is checked bit for bit.

  .venv/bin/python benchmarks/bench_small_tensors.py                # 20,000 tensors, 4-64 KB
  .venv/bin/python benchmarks/bench_small_tensors.py --profile --reps 1 --url memory
  (`--quick`: 200 tensors, one repetition; the smoke test in tests/test_benchmarks.py.)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import math
import os
import pstats
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import statereg


class Flat(nn.Module):
    """One parameter per tensor, as the S3 scenario's `Flat`."""

    def __init__(self, sizes: list[int]) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(1)
        for i, numel in enumerate(sizes):
            self.register_parameter(f"t{i:05d}", nn.Parameter(
                torch.randn(numel, generator=generator), requires_grad=False))


def sizes(count: int, min_kb: float, max_kb: float) -> list[int]:
    """Element counts of `count` fp32 tensors, log-uniform between the two sizes."""
    generator = torch.Generator().manual_seed(7)
    low, high = math.log(min_kb * 1024), math.log(max_kb * 1024)
    logs = torch.rand(count, generator=generator, dtype=torch.float64)
    return [max(1, int(math.exp(low + (high - low) * x)) // 4) for x in logs.tolist()]


def cpu_of(operation: Callable[[], Any], profile: cProfile.Profile | None) -> float:
    start = time.process_time()
    if profile is not None:
        profile.runcall(operation)
    else:
        operation()
    return time.process_time() - start


def run(url: str, module: Flat, reps: int, top: int | None,
        io_threads: int | None) -> tuple[list[float], list[float]]:
    storage: dict[str, Any] = {"url": url}
    if io_threads:
        storage["io_threads"] = io_threads
    mgr = statereg.CheckpointManager(
        {"storage": storage, "save": {"keep_last": 2},
         "components": {"model": {"kind": "model"}}}, model=module)
    expected = {name: p.detach().clone() for name, p in module.named_parameters()}
    saves, loads = [], []
    try:
        for step in range(reps + 1):  # the first save and load warm the process up, untimed
            timed = step > 0
            profile = cProfile.Profile() if timed and top and step == 1 else None
            cost = cpu_of(lambda step=step: mgr.save(step=step), profile)
            if timed:
                saves.append(cost)
            with torch.no_grad():
                for p in module.parameters():
                    p.zero_()
            load_profile = cProfile.Profile() if profile is not None else None
            cost = cpu_of(lambda step=step: mgr.load(step=step), load_profile)
            if timed:
                loads.append(cost)
            for name, p in module.named_parameters():
                if not torch.equal(p, expected[name]):
                    raise SystemExit(f"{url}: {name} loaded other bytes than it saved")
            for what, prof in (("save", profile), ("load", load_profile)):
                if prof is not None:
                    out = io.StringIO()
                    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
                    print(f"--- {url}: profile of one {what}, by own time ---")
                    print("\n".join(out.getvalue().splitlines()[:top + 12]))
    finally:
        mgr.close()
    return saves, loads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=20000, help="tensors (20000)")
    parser.add_argument("--min-kb", type=float, default=4.0, help="smallest tensor, KB (4)")
    parser.add_argument("--max-kb", type=float, default=64.0, help="largest tensor, KB (64)")
    parser.add_argument("--url", action="append",
                        help="storage root, repeatable; 'memory' and 'local' name a fresh "
                             "memory:// root and a temporary directory (default both)")
    parser.add_argument("--reps", type=int, default=3, help="timed saves and loads each (3)")
    parser.add_argument("--profile", type=int, nargs="?", const=30, default=None,
                        help="print the top N functions of one save and one load (30)")
    parser.add_argument("--io-threads", type=int, default=None,
                        help="storage.io_threads (default: the configuration's); 1 puts all "
                             "the work in the thread --profile sees")
    parser.add_argument("--quick", action="store_true", help="smoke test: 200 tensors, 1 rep")
    args = parser.parse_args()
    if args.quick:
        args.count, args.reps = 200, 1
    module = Flat(sizes(args.count, args.min_kb, args.max_kb))
    nbytes = sum(p.nbytes for p in module.parameters())
    temporary = tempfile.mkdtemp(prefix="statereg-small-")
    print(f"{args.count} tensors, {args.min_kb:g}-{args.max_kb:g} KB, {nbytes / 1e9:.3f} GB; "
          f"torch {torch.__version__}; load average {os.getloadavg()[0]:.1f}")
    try:
        for url in args.url or ["memory", "local"]:
            if url == "memory":
                url = f"memory://statereg-small-{os.getpid()}"
            elif url == "local":
                url = os.path.join(temporary, "ckpt")
            saves, loads = run(url, module, args.reps, args.profile,
                                args.io_threads)
            print(f"{url}: save CPU-s median {statistics.median(saves):.2f} "
                  f"({', '.join(f'{s:.2f}' for s in saves)}); load CPU-s median "
                  f"{statistics.median(loads):.2f} ({', '.join(f'{s:.2f}' for s in loads)})")
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


if __name__ == "__main__":
    main()
