"""How long save() blocks the training loop: sync vs async, against a plain memory copy.

Run by hand (not a test):  .venv/bin/python benchmarks/bench_async.py --gb 1 --saves 20
The floor is one copy of the same tensors into preallocated buffers. Peak RSS is sampled
after each save to show whether staging memory grows across saves.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_save_load import build_state

import statereg


def rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--saves", type=int, default=20)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()

    model, opt = build_state(args.gb)
    tensors = [t for t in model.state_dict().values()]
    tensors += [v for s in opt.state.values() for v in s.values() if v.dim()]
    nbytes = sum(t.nbytes for t in tensors)
    copies = [torch.empty_like(t) for t in tensors]
    floor = []
    for _ in range(5):
        start = time.perf_counter()
        for dst, src in zip(copies, tensors, strict=True):
            dst.copy_(src)
        floor.append(time.perf_counter() - start)
    del copies
    print(f"state: {nbytes / 1e9:.2f} GB; memory copy into preallocated buffers: "
          f"median {statistics.median(floor):.3f} s")

    for mode in ("off", "thread"):
        root = Path(tempfile.mkdtemp(prefix=f"statereg-async-{mode}-", dir=args.dir))
        spec = {"storage": {"url": str(root)},
                "components": {"model": {"kind": "model"}, "optimizer": {"kind": "optimizer"}},
                "save": {"async": mode, "keep_last": 1}}
        mgr = statereg.CheckpointManager(spec, model=model, optimizer=opt)
        blocked, total, rss = [], [], []
        for step in range(args.saves):
            start = time.perf_counter()
            mgr.save(step=step)
            blocked.append(time.perf_counter() - start)
            with torch.no_grad():  # the loop mutates weights while the save is in flight
                for p in model.parameters():
                    p.mul_(1.0)
            mgr.wait()
            total.append(time.perf_counter() - start)
            rss.append(rss_gb())
        mgr.close()
        print(f"async={mode:6s} save() blocked: median {statistics.median(blocked):.3f} s "
              f"(first {blocked[0]:.3f} s, later min-max {min(blocked[1:]):.3f}-"
              f"{max(blocked[1:]):.3f}); until committed: median {statistics.median(total):.2f}"
              f" s; RSS after save 1 / 2 / {args.saves}: {rss[0]:.2f} / {rss[1]:.2f} / "
              f"{rss[-1]:.2f} GB")


if __name__ == "__main__":
    main()
