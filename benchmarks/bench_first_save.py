"""The first async save of a fresh process: it allocates the staging buffers (first touch).

Run by hand (not a test), once without and once with PyTorch's transparent huge pages:
  .venv/bin/python benchmarks/bench_first_save.py --gb 1
  THP_MEM_ALLOC_ENABLE=1 .venv/bin/python benchmarks/bench_first_save.py --gb 1
(`--quick`, a tiny state and two saves, is the smoke test in tests/test_benchmarks.py.)
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from perfsuite.workload import linear_stack

import statereg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gb", type=float, default=1.0, help="state size in GB")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: a 2 MB state of narrow layers, two saves")
    args = parser.parse_args()
    width = 2048
    if args.quick:
        args.gb, args.saves, width = 0.002, 2, 256
    model, opt = linear_stack(args.gb, width)
    nbytes = sum(t.nbytes for t in model.state_dict().values()) + sum(
        v.nbytes for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    root = Path(tempfile.mkdtemp(prefix="statereg-first-save-"))
    spec = {"storage": {"url": str(root)}, "save": {"async": "thread", "keep_last": 1},
            "components": {"model": {"kind": "model"}, "optimizer": {"kind": "optimizer"}}}
    mgr = statereg.CheckpointManager(spec, model=model, optimizer=opt)
    stalls = []
    for step in range(args.saves):
        start = time.perf_counter()
        mgr.save(step=step)
        stalls.append(time.perf_counter() - start)
        mgr.wait()
    mgr.close()
    shutil.rmtree(root)
    later = ", ".join(f"{s:.3f}" for s in stalls[1:])
    print(f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}; "
          f"state {nbytes / 1e9:.2f} GB; stall of the first save {stalls[0]:.3f} s "
          f"(allocates the buffers), later saves {later} s")


if __name__ == "__main__":
    main()
