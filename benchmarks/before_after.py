"""Save and load times of two statereg trees, interleaved in one run: is a change neutral?

    .venv/bin/python benchmarks/before_after.py --before /tmp/before --after . --mb 192

Each round runs one child process per tree (before, then after, then the next round), each
with that tree first on its PYTHONPATH, so the two share the machine's state (load, page
cache, thermal) as closely as one run allows. A child saves one state (fp32 tensors, `mb`
in all) with a CheckpointManager to a fresh root on each store (a local disk folder
uncompressed and with `compression: zstd`, and `memory://`), `reps` times, and loads it
back `reps` times; it prints every timing. The table gives per tree and row the median of
all rounds' timings (and their range) and after/before. Loads are warm (the page cache is
not dropped).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r'''
import json
import shutil
import sys
import tempfile
import time
import uuid

import torch
import statereg

mb, reps, work = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
gen = torch.Generator().manual_seed(0)
n = mb * 2**20 // 4 // 8
state = {f"w{i}": torch.randn(n, generator=gen) for i in range(8)}

def module(tensors):
    holder = torch.nn.Module()
    for key, value in tensors.items():
        holder.register_buffer(key, value)
    return holder

stores = {
    "local": lambda: {"url": tempfile.mkdtemp(dir=work)},
    "local zstd": lambda: {"url": tempfile.mkdtemp(dir=work), "compression": "zstd"},
    "memory://": lambda: {"url": f"memory://before-after-{uuid.uuid4().hex}"},
}
out = {}
for name, storage in stores.items():
    spec = {"storage": storage(), "components": {"model": {"kind": "model"}},
            "save": {"keep_last": 1}}
    target = {k: torch.empty_like(v) for k, v in state.items()}
    mgr = statereg.CheckpointManager(spec, model=module(state))
    loader = statereg.CheckpointManager(spec, model=module(target))
    saves, loads = [], []
    for rep in range(reps + 1):  # the first of each is a warm-up
        start = time.perf_counter()
        mgr.save(step=rep + 1)
        saves.append(time.perf_counter() - start)
        start = time.perf_counter()
        loader.load()
        loads.append(time.perf_counter() - start)
    assert all(torch.equal(target[k], state[k]) for k in state)
    out[f"{name} save"] = saves[1:]
    out[f"{name} load"] = loads[1:]
    mgr.close()
    loader.close()
    if not spec["storage"]["url"].startswith("memory://"):
        shutil.rmtree(spec["storage"]["url"], ignore_errors=True)
print(json.dumps(out))
'''


def child(tree: Path, mb: int, reps: int, work: str) -> dict[str, list[float]]:
    env = {**os.environ, "PYTHONPATH": str(tree), "TQDM_DISABLE": "1"}
    done = subprocess.run([sys.executable, "-c", CHILD, str(mb), str(reps), work],
                          env=env, cwd=tree, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"the child of {tree} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--after", type=Path, required=True)
    parser.add_argument("--mb", type=int, default=192)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None,
                        help="where the local roots go (default: the system's temp folder)")
    args = parser.parse_args()
    times: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        for _ in range(args.rounds):
            for label in ("before", "after"):
                tree = (args.before if label == "before" else args.after).resolve()
                for row, values in child(tree, args.mb, args.reps, work).items():
                    times[label].setdefault(row, []).extend(values)
    print(f"| {args.mb} MB, median (min-max) of {args.rounds} x {args.reps} | before (s) "
          "| after (s) | after / before |")
    print("|---|---|---|---|")

    def shown(values: list[float]) -> str:
        return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"

    for row in times["before"]:
        before, after = times["before"][row], times["after"][row]
        ratio = statistics.median(after) / statistics.median(before)
        print(f"| {row} | {shown(before)} | {shown(after)} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
