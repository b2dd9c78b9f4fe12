"""How long save() stalls the training loop: sync, async, async with early return.

Run by hand:  .venv/bin/python benchmarks/bench_async.py --gb 1 --saves 20
(`--quick`, a tiny state and two saves per mode, is the smoke test in tests/test_benchmarks.py.)
The floor is one copy of the same tensors into preallocated buffers. After each save() the
loop "works" for --work seconds (a sleep standing in for forward and backward, which read
the weights but change none), then waits for staging and mutates the weights in place, as
optimizer.step() would. The stall is the time the loop spends inside save() and
wait_staged(). Peak RSS is sampled after each save to show whether staging memory grows.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from perfsuite.workload import linear_stack

import statereg

MODES = {
    "off": {"async": "off"},
    "thread": {"async": "thread"},
    "thread+early_return": {"async": "thread", "early_return": True},
}


def rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--saves", type=int, default=20)
    parser.add_argument("--work", type=float, default=0.0,
                        help="seconds of simulated forward+backward between save() and step")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--dir", default=None)
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: a 2 MB state of narrow layers, two saves per mode")
    args = parser.parse_args()
    width = 2048
    if args.quick:
        args.gb, args.saves, width = 0.002, 2, 256

    model, opt = linear_stack(args.gb, width)
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
          f"median {statistics.median(floor):.3f} s; simulated work per step: {args.work} s")

    for mode in args.modes:
        root = Path(tempfile.mkdtemp(prefix="statereg-async-", dir=args.dir))
        spec = {"storage": {"url": str(root)},
                "components": {"model": {"kind": "model"}, "optimizer": {"kind": "optimizer"}},
                "save": {**MODES[mode], "keep_last": 1}}
        mgr = statereg.CheckpointManager(spec, model=model, optimizer=opt)
        in_save, stall, total, rss = [], [], [], []
        for step in range(args.saves):
            start = time.perf_counter()
            handle = mgr.save(step=step)
            returned = time.perf_counter()
            time.sleep(args.work)
            waiting = time.perf_counter()
            handle.wait_staged()
            in_save.append(returned - start)
            stall.append(returned - start + time.perf_counter() - waiting)
            with torch.no_grad():  # optimizer.step(): weights change in place
                for p in model.parameters():
                    p.mul_(1.0)
            mgr.wait()
            total.append(time.perf_counter() - start)
            rss.append(rss_gb())
        mgr.close()
        del mgr, handle  # free this mode's staging buffers before the next one
        shutil.rmtree(root)
        print(f"{mode:19s} stall: median {statistics.median(stall):.3f} s (first "
              f"{stall[0]:.3f} s, later min-max {min(stall[1:]):.3f}-{max(stall[1:]):.3f}; "
              f"in save() {statistics.median(in_save):.3f} s); until committed: median "
              f"{statistics.median(total):.2f} s; RSS after save 1 / 2 / {args.saves}: "
              f"{rss[0]:.2f} / {rss[1]:.2f} / {rss[-1]:.2f} GB")


if __name__ == "__main__":
    main()
