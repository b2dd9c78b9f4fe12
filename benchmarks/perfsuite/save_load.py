"""Scenario save_load: statereg's save and load against plain torch.distributed.checkpoint.

(Formerly benchmarks/bench_save_load.py; benchmarks/results/journal.md, "Save and load against plain
DCP", records its figures.)

    .venv/bin/python benchmarks/suite.py --only save_load --gb 1 --reps 5

On one state (`linear_stack`: square fp32 Linear layers plus AdamW moments, `gb` in all) and
one disk, as medians of `reps`: plain `dcp.save` with FileSystemWriter thread_count 1 and 2,
statereg's sync save (io_threads=2), plain `dcp.load` and statereg's load (verify=fast), the
page cache dropped before each load where permitted; every save writes a fresh folder after
the previous ones are removed. Also what the zip records' CRC-32 (which torch.save computes for
every tensor record) costs on this state. The ratios are of medians measured in this one run.
"""

from __future__ import annotations

import shutil
import statistics
import time
import zlib
from collections.abc import Iterator
from itertools import count
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import statereg
from perfsuite.measure import PageCache, Timing, fresh_dir, measure
from perfsuite.workload import linear_stack

# Row keys in order, with the labels the standalone script printed (docs/performance.md).
LABELS = {
    "dcp_save_t1": "plain dcp.save, thread_count=1",
    "dcp_save_t2": "plain dcp.save, thread_count=2",
    "statereg_save": "statereg save (io_threads=2)",
    "dcp_load": "plain dcp.load",
    "statereg_load": "statereg load (verify=fast)",
}


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


def run(gb: float, work: Path, reps: int, cache: PageCache,
        width: int = 2048) -> tuple[dict[str, Timing], dict[str, Any]]:
    """The five rows of LABELS and the ratios; `width` only shrinks the smoke run's layers."""
    torch.manual_seed(0)
    model, opt = linear_stack(gb, width)
    flat = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, entries in enumerate(opt.state.values()):
        flat |= {f"optim.{i}.{k}": v for k, v in entries.items() if isinstance(v, torch.Tensor)}
    nbytes = sum(t.nbytes for t in flat.values())
    base = fresh_dir(work / "save_load")
    names: Iterator[int] = count()

    def fresh(name: str) -> Path:
        return base / f"{name}-{next(names)}"

    def clear() -> None:
        for child in base.iterdir():
            shutil.rmtree(child)

    def before_load() -> None:
        if cache.droppable:
            cache.drop()

    rows: dict[str, Timing] = {}
    for threads in (1, 2):
        def dcp_save(t: int = threads) -> None:
            dcp.save(flat, storage_writer=dcp.FileSystemWriter(fresh("dcp"), thread_count=t),
                     no_dist=True)
        rows[f"dcp_save_t{threads}"] = measure(LABELS[f"dcp_save_t{threads}"], dcp_save, reps,
                                               nbytes, clear)

    spec = {"storage": {"url": str(base / "sr")},
            "components": {"model": {"kind": "model"}, "optimizer": {"kind": "optimizer"}}}
    steps = count()

    def sr_save() -> None:
        mgr = statereg.CheckpointManager(spec, model=model, optimizer=opt)
        mgr.save(step=next(steps))

    rows["statereg_save"] = measure(LABELS["statereg_save"], sr_save, reps, nbytes, clear)

    # Loads: one checkpoint of each, page cache dropped before each read where permitted.
    clear()
    dcp_dir = fresh("dcp")
    dcp.save(flat, storage_writer=dcp.FileSystemWriter(dcp_dir, thread_count=2), no_dist=True)
    sr_save()
    targets = {k: torch.empty_like(v) for k, v in flat.items()}
    rows["dcp_load"] = measure(
        LABELS["dcp_load"], lambda: dcp.load(targets, checkpoint_id=dcp_dir, no_dist=True),
        reps, nbytes, before_load)
    mgr = statereg.CheckpointManager(spec, model=model, optimizer=opt)
    rows["statereg_load"] = measure(LABELS["statereg_load"], lambda: mgr.load(), reps, nbytes,
                                    before_load)
    shutil.rmtree(base)

    def median(key: str) -> float:
        return statistics.median(rows[key].seconds)

    crc = crc_seconds(list(flat.values()), reps)
    data = {
        "state": {"bytes": nbytes, "tensors": len(flat), "width": width,
                  "layers": len(list(model.children()))},
        "page_cache_dropped": cache.droppable,
        "save_ratio": min(median("dcp_save_t1"), median("dcp_save_t2")) / median("statereg_save"),
        "load_ratio": median("dcp_load") / median("statereg_load"),
        "crc_cpu_s": crc,
        "crc_gib_per_s": nbytes / crc / 2**30 if crc > 0 else None,
        "crc_share_of_save": crc / median("statereg_save"),
    }
    return rows, data


def summary(data: dict[str, Any]) -> list[str]:
    """The lines under the table, as the standalone script printed them."""
    rate = "n/a" if data["crc_gib_per_s"] is None else f"{data['crc_gib_per_s']:.1f}"
    return [
        f"State: {data['state']['bytes'] / 1e9:.2f} GB ({data['state']['tensors']} tensors), "
        f"page cache dropped: {data['page_cache_dropped']}.",
        "",
        f"statereg save speed / best plain DCP save: {data['save_ratio']:.2f}x",
        f"statereg load speed / plain DCP load: {data['load_ratio']:.2f}x",
        f"zip CRC-32 of every tensor record: {data['crc_cpu_s']:.2f} s of CPU ({rate} GiB/s), "
        f"{100 * data['crc_share_of_save']:.0f}% of the statereg save median "
        "(spread over its writer threads)",
    ]
