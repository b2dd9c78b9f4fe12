"""Coordination time per save (the first of a job, and later ones) on real gloo ranks.

Each rank saves a model of many small tensors (so writing the bytes costs little and the
save is mostly coordination: planning, collectives, `.metadata`, the manifest), sharded
(DCP spreads the identical tensors over the ranks), synchronously, `--saves` times. Each
rank wraps torch.distributed's collective functions to count calls, bytes sent (pickled
objects) and seconds spent inside them. Printed per rank count and save: the save's wall
time (slowest rank), time in collectives (slowest rank), calls and bytes (per rank, max).

Run by hand (not a test); to compare with the code before a change, point PYTHONPATH at an
export of that commit:
  .venv/bin/python benchmarks/bench_save_coordination.py --ranks 2 4 --tensors 1000
  git archive HEAD statereg | tar -x -C /tmp/before
  PYTHONPATH=/tmp/before .venv/bin/python benchmarks/bench_save_coordination.py --ranks 2 4
  .venv/bin/python benchmarks/bench_save_coordination.py --quick   # smoke test: 2 ranks
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import pickle
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object",
               "scatter_object_list", "all_gather", "broadcast", "gather", "scatter",
               "all_reduce", "barrier")


class Counted:
    """This process's collective calls, bytes sent and seconds inside them."""

    def __init__(self) -> None:
        self.calls = 0
        self.sent = 0
        self.seconds = 0.0
        for name in COLLECTIVES:
            setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name: str, original: Any) -> Any:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            arguments = signature.bind(*args, **kwargs).arguments
            self.calls += 1
            if name in ("all_gather_object", "gather_object"):
                self.sent += len(pickle.dumps(arguments["obj"]))
            elif name == "broadcast_object_list" and arguments.get("src", 0) == dist.get_rank():
                self.sent += len(pickle.dumps(arguments["object_list"]))
            elif name == "scatter_object_list" and arguments.get("src", 0) == dist.get_rank():
                self.sent += len(pickle.dumps(arguments["scatter_object_input_list"]))
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return counted

    def snapshot(self) -> tuple[int, int, float]:
        return self.calls, self.sent, self.seconds


class ManyTensors(nn.Module):
    def __init__(self, count: int, numel: int) -> None:
        super().__init__()
        self.params = nn.ParameterList(nn.Parameter(torch.randn(numel)) for _ in range(count))


def _rank(rank: int, world: int, init: str, root: str, tensors: int, numel: int, saves: int,
          out: str) -> None:
    import statereg  # after fork, as a training script would

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    torch.manual_seed(0)
    model = ManyTensors(tensors, numel)
    mgr = statereg.CheckpointManager(
        {"storage": {"url": root}, "save": {"keep_last": 2},
         "components": {"model": {"kind": "model"}}}, model=model)
    counted = Counted()
    rows = []
    for step in range(1, saves + 1):
        dist.barrier()  # every rank starts the save together (outside the measured window)
        calls, sent, seconds = counted.snapshot()
        start = time.perf_counter()
        mgr.save(step=step)
        wall = time.perf_counter() - start
        after = counted.snapshot()
        rows.append({"wall_s": wall, "calls": after[0] - calls, "bytes": after[1] - sent,
                     "collective_s": after[2] - seconds})
    mgr.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def measure(world: int, tensors: int, numel: int, saves: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="statereg-coord-") as tmp:
        out = Path(tmp, "out")
        out.mkdir()
        mp.start_processes(_rank, args=(world, str(Path(tmp, "init")), str(Path(tmp, "ckpt")),
                                        tensors, numel, saves, str(out)),
                           nprocs=world, join=True, start_method="forkserver")
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    per_save = [{key: max(rank[i][key] for rank in ranks) for key in ranks[0][i]}
                for i in range(saves)]
    later = per_save[1:]
    return {"ranks": world, "tensors": tensors, "first": per_save[0],
            "later": {key: statistics.median(s[key] for s in later) for key in later[0]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tensors", type=int, nargs="+", default=[1000])
    parser.add_argument("--numel", type=int, default=16, help="elements per tensor")
    parser.add_argument("--saves", type=int, default=6, help="the first and the later ones")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 2 ranks, 10 tensors, 2 saves")
    args = parser.parse_args()
    if args.quick:
        args.ranks, args.tensors, args.saves = [2], [10], 2
    import statereg

    # Ranks fork from one server that imported torch once (outside every measured window).
    mp.set_forkserver_preload(["torch", "torch.distributed"])
    print(f"statereg from {Path(statereg.__file__).parent}, torch {torch.__version__}")
    print("| ranks | tensors | save | wall ms | in collectives ms | calls | bytes sent |")
    print("|---|---|---|---|---|---|---|")
    for world in args.ranks:
        for tensors in args.tensors:
            result = measure(world, tensors, args.numel, args.saves)
            for which in ("first", "later"):
                row = result[which]
                print(f"| {world} | {tensors} | {which} | {row['wall_s'] * 1e3:.1f} | "
                      f"{row['collective_s'] * 1e3:.1f} | {row['calls']:.0f} | "
                      f"{row['bytes']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
