"""statereg on the same state and disk: sync save, load, and async save (stall and total).

Stall is the time from `save()` until the training loop may run `optimizer.step()` safely:
with `async: thread` that is when `save()` returns (the tensors are copied to host buffers);
with `early_return` it is when `wait_staged()` returns, called right after `save()` (a real
loop overlaps that copy with forward and backward). Total is from `save()` until `wait()`
returns, i.e. the checkpoint is committed. The first async save of a manager allocates its
staging buffers and is reported apart; the repetitions after it reuse them.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

import statereg
from perfsuite.measure import PageCache, PeakRSS, Timing, fresh_dir, measure, peak_rss
from perfsuite.workload import TrainingState


def spec_for(url: str, *, options: dict[str, Any] | None = None,
             compression: dict[str, Any] | None = None, save: dict[str, Any] | None = None,
             io_threads: int | None = 2) -> dict[str, Any]:
    """None for `io_threads`: the backend's default (2 on disk, 8 on object stores)."""
    storage: dict[str, Any] = {"url": url, "options": options or {}}
    if io_threads is not None:
        storage["io_threads"] = io_threads
    if compression is not None:
        storage["compression"] = compression
    return {"storage": storage, "save": save or {},
            "components": {"model": {"kind": "model"}, "optimizer": {"kind": "optimizer"}}}


def manager(state: TrainingState, spec: dict[str, Any]) -> statereg.CheckpointManager:
    return statereg.CheckpointManager(spec, model=state.model, optimizer=state.optimizer)


class Saves:
    """Sync saves of one state, each a new step; `load` reads the last one back."""

    def __init__(self, state: TrainingState, spec: dict[str, Any]) -> None:
        self.mgr = manager(state, spec)
        self.step = 0

    def save(self) -> None:
        self.step += 1
        self.mgr.save(step=self.step)

    def load(self) -> None:
        self.mgr.load(step=self.step)


def _async_rows(state: TrainingState, root: Path, reps: int, cache: PageCache, mode: str,
                early_return: bool) -> dict[str, Timing]:
    spec = spec_for(str(root), save={"async": mode, "early_return": early_return})
    mgr = manager(state, spec)
    stalls, totals = [], []
    peak = PeakRSS()
    first: tuple[float, float, PeakRSS] | None = None
    for rep in range(reps + 1):
        fresh_dir(root)
        cache.drop()
        with peak_rss() as rep_peak:
            start = time.perf_counter()
            handle = mgr.save(step=rep)
            if early_return:
                handle.wait_staged()
            staged = time.perf_counter()
            state.mutate()
            mgr.wait()
            done = time.perf_counter()
        if first is None:
            first = (staged - start, done - start, rep_peak)
            continue
        stalls.append(staged - start)
        totals.append(done - start)
        peak = rep_peak if rep_peak.peak_gb >= peak.peak_gb else peak
    mgr.close()
    del mgr
    assert first is not None
    name = f"async: {mode}" + (" + early_return" if early_return else "")
    key = f"async_{mode}" + ("_early" if early_return else "")
    nbytes = state.nbytes
    return {
        f"{key}_stall": Timing(f"{name}: training stall", stalls, nbytes, peak),
        f"{key}_total": Timing(f"{name}: save() until committed", totals, nbytes, peak),
        f"{key}_first_stall": Timing(f"{name}: stall of the first save (allocates buffers)",
                                     [first[0]], nbytes, first[2]),
    }


def run(state: TrainingState, work: Path, reps: int, cache: PageCache) -> dict[str, Timing]:
    rows: dict[str, Timing] = {}
    root = work / "statereg"
    nbytes = state.nbytes

    def clear() -> None:
        fresh_dir(root)
        cache.drop()

    saves = Saves(state, spec_for(str(root)))
    rows["save"] = measure("statereg save (sync, io_threads=2)", saves.save, reps, nbytes, clear)
    rows["load"] = measure("statereg load (verify=fast, cold cache)", saves.load, reps, nbytes,
                           cache.drop)
    del saves
    modes = [("thread", False), ("thread", True)]
    if torch.cuda.is_available():
        modes.append(("pinned", False))
    for mode, early in modes:
        rows |= _async_rows(state, root, reps, cache, mode, early)
    fresh_dir(root)
    return rows
