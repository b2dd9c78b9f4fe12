"""One rank of the world-size benchmark; launched by perfsuite/ranks.py through torchrun.

Every rank builds the same transformer, shards it with FSDP2 (`fully_shard` per block, then
the root) over a gloo process group, takes one real AdamW step, then saves and loads the
sharded model and optimizer with statereg. Each timing runs from a barrier to a barrier, so
it is the time of the slowest rank. Writes rank-<r>.json into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from perfsuite.measure import PageCache, fresh_dir, peak_rss
from perfsuite.statereg_io import manager, spec_for
from perfsuite.workload import TrainingState, Transformer, shape_for, train_one_step


def local_bytes(state: TrainingState) -> int:
    """Bytes this rank holds: its shards of the weights and of the optimizer state."""
    tensors = list(state.model.state_dict().values())
    tensors += [v for s in state.optimizer.state.values() for v in s.values()
                if isinstance(v, torch.Tensor)]
    return sum(getattr(t, "_local_tensor", t).nbytes for t in tensors)


def timed_barrier(fn: Callable[[], object]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=float, required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--reps", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--keep-page-cache", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    cache = PageCache(allowed=not args.keep_page_cache) if rank == 0 else None

    vocab, width, layers = shape_for(args.params)
    torch.manual_seed(0)
    model = Transformer(vocab, width, layers)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_one_step(model, optimizer, vocab, seed=rank)
    state = TrainingState(model, optimizer, torch.float32)
    root = Path(args.root)
    mgr = manager(state, spec_for(str(root)))

    def clear() -> None:
        if cache is not None:
            fresh_dir(root)
            cache.drop()

    saves, loads = [], []
    with peak_rss() as peak:
        for step in range(1, args.reps + 1):
            clear()
            saves.append(timed_barrier(lambda s=step: mgr.save(step=s)))
        for _ in range(args.reps):
            if cache is not None:
                cache.drop()
            loads.append(timed_barrier(lambda: mgr.load(step=args.reps)))
    result = {"rank": rank, "world_size": world, "save_s": saves, "load_s": loads,
              "local_bytes": local_bytes(state), "peak_rss_gb": peak.peak_gb,
              "page_cache_dropped": cache.droppable if cache else None}
    Path(args.out, f"rank-{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    if cache is not None:
        fresh_dir(root)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
