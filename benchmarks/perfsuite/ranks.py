"""World sizes: the same sharded state saved and loaded by 1, 2 and 4 ranks (gloo, FSDP2).

Each world size runs in its own `torchrun --standalone` job (perfsuite/rank_worker.py), so
the parent holds no process group and each job starts from fresh processes. A row's time is
the slowest rank's (barrier to barrier); its peak RSS is the largest of any rank.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from perfsuite.measure import PeakRSS, Timing, fresh_dir
from perfsuite.workload import shape_for

WORKER = Path(__file__).with_name("rank_worker.py")


def _one_world(world: int, params: float, work: Path, reps: int, drop_cache: bool,
               timeout: float) -> tuple[dict[str, Timing], dict[str, Any]]:
    out = fresh_dir(work / f"ranks-{world}")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(world), str(WORKER), "--params", str(params),
               "--root", str(work / f"ranks-{world}-store"), "--reps", str(reps),
               "--out", str(out)] + ([] if drop_cache else ["--keep-page-cache"])
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"world size {world} failed:\n{done.stderr[-3000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]
    fresh_dir(out)
    nbytes = sum(r["local_bytes"] for r in ranks)
    peak = PeakRSS(peak_gb=max(r["peak_rss_gb"] for r in ranks))
    slowest = {kind: [max(r[kind][i] for r in ranks) for i in range(reps)]
               for kind in ("save_s", "load_s")}
    rows = {
        f"save_w{world}": Timing(f"statereg save, world size {world}", slowest["save_s"],
                                 nbytes, peak),
        f"load_w{world}": Timing(f"statereg load, world size {world}", slowest["load_s"],
                                 nbytes, peak),
    }
    return rows, {"bytes": nbytes, "peak_rss_gb_per_rank": [r["peak_rss_gb"] for r in ranks]}


def run(worlds: list[int], params: float, work: Path, reps: int, drop_cache: bool,
        timeout: float = 600) -> tuple[dict[str, Timing], dict[str, Any]]:
    rows: dict[str, Timing] = {}
    data: dict[str, Any] = {"params": params, "shape": dict(zip(
        ("vocab", "width", "layers"), shape_for(params), strict=True))}
    for world in worlds:
        world_rows, world_data = _one_world(world, params, work, reps, drop_cache, timeout)
        rows |= world_rows
        data[str(world)] = world_data
    return rows, data
