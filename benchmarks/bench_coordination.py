"""Coordination per save and bytes read per rank per load on real gloo ranks, against plain DCP.

What it measures (re-run it unchanged after the read-once and plan-reuse work of issue 17):
on 2, 4 and 8 processes of this machine, joined in a gloo process group (the pattern of
tests/distributed/harness.py), every rank holds the same FSDP2-sharded model (`--layers`
Linear(`--width`, `--width`) layers, fully_shard per layer) and its AdamW state after one step.
statereg (components model and optimizer, sync save to local disk) and plain DCP
(dcp.save / dcp.load of get_model_state_dict and get_optimizer_state_dict with
FileSystemWriter / FileSystemReader) save that same state `--saves` times each, then load it.

- Coordination time per save: the wall time a rank spends inside torch.distributed calls
  (every function of torch.distributed that statereg, DCP and FSDP call is wrapped while the
  save runs; calls torch makes inside those are not counted twice). It includes waiting for
  slower ranks, so it is an upper bound on the cost of coordinating. The first save and the
  median of the later ones are shown, each the mean over ranks; collective calls per save
  and the bytes they carried (pickled objects, tensors) are counted the same way.
- Bytes read per rank per load: the growth of `rchar` in /proc/self/io during the load
  (every read() of every file, whatever library; gloo's socket traffic is not in it), after
  one warm-up load so that Python's own imports are not counted; against the bytes of the
  checkpoint on disk (its unique bytes). The load's collective calls are counted as a
  save's are (benchmarks/bench_scale.py's ledger of a load is checked against them).

    python benchmarks/bench_coordination.py                     # 2, 4 and 8 ranks
    python benchmarks/bench_coordination.py --ranks 2 --saves 2  # a quick look
    python benchmarks/bench_coordination.py --quick   # smoke test: 2 ranks, 2 tiny layers
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import pickle
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

import statereg

# Every torch.distributed function a save or load of either library may call.
WRAPPED = ("all_gather_object", "gather_object", "scatter_object_list",
           "broadcast_object_list", "barrier", "all_reduce", "all_gather", "broadcast",
           "gather", "scatter", "reduce_scatter", "all_gather_into_tensor",
           "reduce_scatter_tensor", "all_to_all")


class Tally:
    """Time, calls and payload bytes inside torch.distributed while `active`."""

    def __init__(self) -> None:
        self.active = False
        self.seconds = 0.0
        self.calls = 0
        self.bytes = 0
        self._depth = 0

    def reset(self) -> None:
        self.seconds, self.calls, self.bytes = 0.0, 0, 0

    def wrap(self, name: str) -> None:
        original = getattr(dist, name)
        signature = inspect.signature(original)

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if not self.active or self._depth:
                return original(*args, **kwargs)
            self._depth += 1
            self.calls += 1
            self.bytes += _payload(name, signature.bind(*args, **kwargs).arguments)
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
                self._depth -= 1

        setattr(dist, name, counted)


def _payload(name: str, arguments: dict[str, Any]) -> int:
    """What this rank hands to a collective: pickled objects, or tensor bytes."""
    if name in ("all_gather_object", "gather_object"):
        return len(pickle.dumps(arguments["obj"]))
    if name == "broadcast_object_list":
        return sum(len(pickle.dumps(o)) for o in arguments["object_list"])
    if name == "scatter_object_list":
        return sum(len(pickle.dumps(o)) for o in arguments.get("scatter_object_input_list")
                   or ())
    tensors = [a for v in arguments.values() for a in (v if isinstance(v, list) else [v])]
    return sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))


def rchar() -> int:
    with open("/proc/self/io") as io:
        for line in io:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no rchar line")


def build(layers: int, width: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).sum().backward()
    optimizer.step()
    return model, optimizer


def timed(tally: Tally, fn: Callable[[], Any]) -> dict[str, float]:
    """Run fn on every rank at once; its wall time and what it spent in torch.distributed."""
    dist.barrier()
    tally.reset()
    tally.active = True
    started = time.perf_counter()
    fn()
    seconds = time.perf_counter() - started
    tally.active = False
    return {"seconds": seconds, "coordination_s": tally.seconds, "calls": tally.calls,
            "bytes": tally.bytes}


def read_bytes(tally: Tally, fn: Callable[[], Any]) -> dict[str, float]:
    """Run fn on every rank at once; its wall time, the bytes it read and its collectives."""
    dist.barrier()
    tally.reset()
    tally.active = True
    before = rchar()
    started = time.perf_counter()
    fn()
    seconds = time.perf_counter() - started
    tally.active = False
    return {"seconds": seconds, "bytes_read": rchar() - before, "calls": tally.calls}


def rank_main(rank: int, world: int, init: str, root: str, args: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    tally = Tally()
    for name in WRAPPED:
        tally.wrap(name)
    model, optimizer = build(args["layers"], args["width"])
    spec = {"storage": {"url": f"{root}/statereg"}, "save": {"async": "off"},
            "components": {"model": {"kind": "model"}, "optimizer": {"kind": "optimizer"}}}
    result: dict[str, Any] = {"statereg": {"saves": [], "loads": []},
                              "dcp": {"saves": [], "loads": []}}
    with statereg.CheckpointManager(spec, model=model, optimizer=optimizer) as mgr:
        for step in range(1, args["saves"] + 1):
            result["statereg"]["saves"].append(timed(tally, lambda s=step: mgr.save(step=s)))
        for _ in range(2):  # the first load warms up imports and caches; the second counts
            result["statereg"]["loads"].append(read_bytes(tally, mgr.load))

    def dcp_save(step: int) -> None:
        state = {"model": get_model_state_dict(model),
                 "optim": get_optimizer_state_dict(model, optimizer)}
        dcp.save(state, storage_writer=dcp.FileSystemWriter(f"{root}/dcp/step_{step:08d}"))

    def dcp_load() -> None:
        state = {"model": get_model_state_dict(model),
                 "optim": get_optimizer_state_dict(model, optimizer)}
        last = f"{root}/dcp/step_{args['saves']:08d}"
        dcp.load(state, storage_reader=dcp.FileSystemReader(last))
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"])

    for step in range(1, args["saves"] + 1):
        result["dcp"]["saves"].append(timed(tally, lambda s=step: dcp_save(s)))
    for _ in range(2):
        result["dcp"]["loads"].append(read_bytes(tally, dcp_load))
    Path(root, f"rank_{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def checkpoint_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def run(world: int, args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix=f"statereg-coord-{world}-", dir=args.dir))
    try:
        options = {"layers": args.layers, "width": args.width, "saves": args.saves}
        mp.start_processes(rank_main, args=(world, str(root / "pg-init"), str(root), options),
                           nprocs=world, join=True, start_method="forkserver")
        ranks = [json.loads((root / f"rank_{r}.json").read_text()) for r in range(world)]
        newest = sorted((root / "statereg").glob("step_*"))[-1]
        unique = {"statereg": checkpoint_bytes(newest),
                  "dcp": checkpoint_bytes(root / "dcp" / f"step_{args.saves:08d}")}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = {}
    for library in ("statereg", "dcp"):
        saves = [[r[library]["saves"][i] for r in ranks] for i in range(args.saves)]
        loads = [r[library]["loads"][-1] for r in ranks]

        def mean(figures: list[dict[str, float]], key: str) -> float:
            return statistics.fmean(f[key] for f in figures)

        later = saves[1:] or saves
        rows[library] = {
            "first_save_s": max(f["seconds"] for f in saves[0]),
            "later_save_s": statistics.median(max(f["seconds"] for f in s) for s in later),
            "first_coordination_s": mean(saves[0], "coordination_s"),
            "later_coordination_s": statistics.median(mean(s, "coordination_s") for s in later),
            "first_calls": mean(saves[0], "calls"),
            "later_calls": statistics.median(mean(s, "calls") for s in later),
            "later_bytes_per_rank": statistics.median(mean(s, "bytes") for s in later),
            "load_s": max(f["seconds"] for f in loads),
            "load_calls": mean(loads, "calls"),
            "read_per_rank_mean": mean(loads, "bytes_read"),
            "read_per_rank_max": max(f["bytes_read"] for f in loads),
            "unique_bytes": unique[library],
        }
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--saves", type=int, default=4, help="saves per library (first + later)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: $TMPDIR)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 2 ranks, 2 saves, 2 layers of width 32")
    args = parser.parse_args(argv)
    if args.quick:
        args.ranks, args.saves, args.layers, args.width = [2], 2, 2, 32
    mp.set_forkserver_preload(["torch", "torch.distributed.fsdp", "statereg.manager"])
    started = time.perf_counter()
    results = {world: run(world, args) for world in args.ranks}
    params = args.layers * (args.width * args.width + args.width)
    print(f"# {params / 1e6:.2f}M parameters (fp32) + AdamW state, FSDP2 over all ranks; "
          f"{args.saves} saves each; {time.perf_counter() - started:.0f} s")
    print("| ranks | library | first save s | later save s | coordination s first | "
          "coordination s later | collectives first / later | sent per rank per later save | "
          "load s | load collectives | read per rank (mean / max) | checkpoint bytes | "
          "read / checkpoint |")
    print("|" + "---|" * 13)
    for world, rows in results.items():
        for library, r in rows.items():
            print(f"| {world} | {library} | {r['first_save_s']:.3f} | {r['later_save_s']:.3f} | "
                  f"{r['first_coordination_s']:.3f} | {r['later_coordination_s']:.3f} | "
                  f"{r['first_calls']:.0f} / {r['later_calls']:.0f} | "
                  f"{r['later_bytes_per_rank'] / 1e3:.1f} kB | {r['load_s']:.3f} | "
                  f"{r['load_calls']:.0f} | "
                  f"{r['read_per_rank_mean'] / 1e6:.2f} / {r['read_per_rank_max'] / 1e6:.2f} MB | "
                  f"{r['unique_bytes'] / 1e6:.2f} MB | "
                  f"{world * r['read_per_rank_mean'] / r['unique_bytes']:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
