"""Scale in tensor count: save and load of states of many small tensors, and where save time goes.

Each state is one model component holding N fp32 tensors of `numel` elements. During the
timed saves, the functions below are wrapped with timers (a measurement hook in this
benchmark only; the library is unchanged) and their time is summed per category:

- plan: statereg reading the state and agreeing on it (`capture`, `check_consistency`,
  `check_replicas`) and the save planner (`StateregSavePlanner`: `set_up_planner`,
  `create_local_plan`, `create_global_plan`, `finish_plan`);
- manifest: claiming the directory (`claim_checkpoint`), DCP's `.metadata`
  (`BackendWriter.finish`), building and committing the manifest, retention;
- checksums: every `update` of the per-file xxh3 hashers. These run in the writer threads,
  so this is thread time summed over threads, an upper bound on their share of wall time.

The rest of a save is DCP serialising and writing the items. `compile_plan` runs once when
the manager is built, not per save; it is reported apart.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

import statereg
import statereg.backends.checksum as backend_checksum
import statereg.engine.save_steps as engine_save
import statereg.engine.saver as engine_saver
from perfsuite.measure import PageCache, Timing, fresh_dir, measure
from statereg.dcp.planner import StateregSavePlanner
from statereg.dcp.writer import BackendWriter

# Each function is wrapped where its caller looks it up (the Saver calls capture and the
# checks; save_steps calls the rest): tests/test_benchmarks.py checks every one is called.
CATEGORIES = {
    "plan": [(engine_saver, "capture"), (engine_saver, "check_consistency"),
             (engine_saver, "check_replicas"),
             (StateregSavePlanner, "set_up_planner"), (StateregSavePlanner, "create_local_plan"),
             (StateregSavePlanner, "create_global_plan"), (StateregSavePlanner, "finish_plan")],
    "manifest": [(engine_save, "claim_checkpoint"), (BackendWriter, "finish"),
                 (engine_save, "build_manifest"), (engine_save, "commit"),
                 (engine_save, "apply_retention")],
}


class ManyTensors(nn.Module):
    def __init__(self, count: int, numel: int) -> None:
        super().__init__()
        self.params = nn.ParameterList(nn.Parameter(torch.randn(numel)) for _ in range(count))


class Clock:
    """Seconds spent per wrapped function; safe to add to from writer threads."""

    def __init__(self) -> None:
        self.spent: dict[tuple[str, str], list[float]] = {}

    def timed(self, category: str, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        spent = self.spent.setdefault((category, name), [])

        # wraps() keeps the signature visible: DCP inspects set_up_planner's parameters.
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent.append(time.perf_counter() - start)  # list.append is atomic

        return wrapper

    def by_category(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for (category, _), spent in self.spent.items():
            totals[category] = totals.get(category, 0.0) + sum(spent)
        return totals

    def by_function(self) -> dict[str, float]:
        return {name: sum(spent) for (_, name), spent in self.spent.items()}


class _TimedHasher:
    def __init__(self, hasher: Any, spent: list[float]) -> None:
        self._hasher = hasher
        self._spent = spent

    def update(self, data: Any) -> None:
        start = time.perf_counter()
        self._hasher.update(data)
        self._spent.append(time.perf_counter() - start)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._hasher, name)


@contextmanager
def instrumented(clock: Clock) -> Iterator[None]:
    """Wrap the functions of every category with `clock`'s timers; restore them after."""
    originals = []
    for category, targets in CATEGORIES.items():
        for owner, name in targets:
            original = getattr(owner, name)
            originals.append((owner, name, original))
            setattr(owner, name, clock.timed(category, name, original))
    new_hasher = backend_checksum.new_hasher
    originals.append((backend_checksum, "new_hasher", new_hasher))
    spent = clock.spent.setdefault(("checksums", "xxh3 update"), [])
    backend_checksum.new_hasher = lambda: _TimedHasher(new_hasher(), spent)
    try:
        yield
    finally:
        for owner, name, original in reversed(originals):
            setattr(owner, name, original)


def _one_count(count: int, numel: int, work: Path, reps: int, cache: PageCache,
               time_load: bool) -> tuple[dict[str, Timing], dict[str, Any]]:
    torch.manual_seed(0)
    model = ManyTensors(count, numel)
    nbytes = count * numel * 4
    root = work / f"scale-{count}"
    spec = {"storage": {"url": str(root)}, "components": {"model": {"kind": "model"}}}
    start = time.perf_counter()
    mgr = statereg.CheckpointManager(spec, model=model)
    build_s = time.perf_counter() - start
    step = iter(range(1, 10**6))
    saved: list[int] = []

    def clear() -> None:
        fresh_dir(root)
        cache.drop()

    def save() -> None:
        saved.append(next(step))
        mgr.save(step=saved[-1])

    clock = Clock()
    with instrumented(clock):
        save_row = measure(f"statereg save, {count} tensors", save, reps, nbytes, clear)
    rows = {f"save_{count}": save_row}
    if time_load:
        rows[f"load_{count}"] = measure(f"statereg load, {count} tensors",
                                        lambda: mgr.load(step=saved[-1]), reps, nbytes,
                                        cache.drop)
    fresh_dir(root)
    saves = len(save_row.seconds)
    parts = {c: v / saves for c, v in clock.by_category().items()}
    share = sum(parts.values()) / (sum(save_row.seconds) / saves)
    data = {"tensors": count, "bytes": nbytes, "manager_init_s": round(build_s, 4),
            "per_save_s": {c: round(v, 4) for c, v in parts.items()},
            "per_function_s": {f: round(v / saves, 4) for f, v in clock.by_function().items()},
            "overhead_share_of_save": round(share, 4)}
    return rows, data


def run(counts: list[int], numel: int, work: Path, reps: int, cache: PageCache,
        load_max: int) -> tuple[dict[str, Timing], dict[str, Any]]:
    """Loads are timed up to `load_max` tensors: past that a load costs about as much as the
    save (DCP reads each item with torch.load) and is no target."""
    rows: dict[str, Timing] = {}
    breakdown = {}
    for count in counts:
        count_rows, data = _one_count(count, numel, work, reps, cache, count <= load_max)
        rows |= count_rows
        breakdown[str(count)] = data
    return rows, {"numel_per_tensor": numel, "breakdown": breakdown}
