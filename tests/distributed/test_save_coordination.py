"""Save coordination stays flat: after a job's first save, a save of unchanged shapes reuses
its DCP plans and `.metadata`, and its collectives are a fixed number of calls whatever the
tensor count; a shape change plans afresh; every checkpoint loads bit for bit.

The counts come from the real calls: each rank wraps torch.distributed's collective
functions (which statereg and DCP call through the `torch.distributed` module) with a
counter of calls and of the bytes each call sends (pickled objects, tensor bytes), and
StateregSavePlanner.create_global_plan (DCP's plan gather ends in it on rank 0).
"""

from __future__ import annotations

import functools
import inspect
import json
import pickle
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from harness import run_ranks
from torch import nn

import statereg
from statereg.dcp.planner import StateregSavePlanner

COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object",
               "scatter_object_list", "all_gather", "broadcast", "gather", "scatter",
               "all_reduce", "reduce_scatter", "all_to_all", "barrier")


class CollectiveCounter:
    """Counts this process's calls of torch.distributed collectives and the bytes each sends."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.sent = 0
        self.global_plans = 0

    def install(self) -> None:
        for name in COLLECTIVES:
            setattr(dist, name, self._counted(name, getattr(dist, name)))
        plan = StateregSavePlanner.create_global_plan

        @functools.wraps(plan)
        def counted_plan(planner: Any, all_plans: Any) -> Any:
            self.global_plans += 1
            return plan(planner, all_plans)

        StateregSavePlanner.create_global_plan = counted_plan  # type: ignore[method-assign]

    def _counted(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            self.sent += self._bytes_sent(name, signature.bind(*args, **kwargs).arguments)
            return original(*args, **kwargs)

        return counted

    @staticmethod
    def _bytes_sent(name: str, arguments: dict[str, Any]) -> int:
        rank = dist.get_rank()
        if name in ("all_gather_object", "gather_object"):
            return len(pickle.dumps(arguments["obj"]))
        if name == "broadcast_object_list":
            sent = arguments["object_list"] if arguments.get("src", 0) == rank else []
            return len(pickle.dumps(sent)) if sent else 0
        if name == "scatter_object_list":
            sent = arguments.get("scatter_object_input_list") if arguments.get("src", 0) == rank \
                else None
            return len(pickle.dumps(sent)) if sent else 0
        tensor = arguments.get("tensor")
        return tensor.nbytes if isinstance(tensor, torch.Tensor) else 0

    def snapshot(self) -> tuple[int, int, int]:
        return sum(self.calls.values()), self.sent, self.global_plans


class ManyTensors(nn.Module):
    def __init__(self, count: int) -> None:
        super().__init__()
        self.params = nn.ParameterList(nn.Parameter(torch.randn(64)) for _ in range(count))


# (job, tensors, compression): compressed items' lengths change with their bytes, so their
# locations travel to rank 0 again with their digests.
JOBS = (("n10", 10, None), ("n200", 200, None), ("n10-zstd", 10, {"codec": "zstd"}))


def _saves(rank: int, world: int, root: Path, out: Path) -> None:
    counter = CollectiveCounter()
    counter.install()
    figures: dict[str, Any] = {}
    for job, count, compression in JOBS:
        torch.manual_seed(count)  # the same state on every rank
        model = ManyTensors(count)
        mgr = statereg.CheckpointManager(
            {"storage": {"url": str(root / job), "compression": compression},
             "components": {"model": {"kind": "model"}}}, model=model)
        saves = []
        for step in range(1, 5):
            if step == 3:  # a shape change: the plans kept so far no longer fit
                model.params[3] = nn.Parameter(torch.randn(96))
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(step)  # new values: each save's digests must be its own
            if rank == 0:
                torch.save({k: v.clone() for k, v in model.state_dict().items()},
                           out / f"{job}-step{step}.pt")
            calls, sent, plans = counter.snapshot()
            mgr.save(step=step)
            after = counter.snapshot()
            saves.append({"calls": after[0] - calls, "bytes": after[1] - sent,
                          "global_plans": after[2] - plans})
        figures[job] = saves
        calls = counter.calls.copy()
        mgr.load()
        figures[f"{job}-load"] = dict(counter.calls - calls)
        mgr.close()
    (out / f"rank{rank}.json").write_text(json.dumps(figures))


def test_later_saves_reuse_plans_with_a_fixed_number_of_collectives(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    run_ranks(2, _saves, tmp_path, tmp_path / "ckpt", out)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for figures in ranks:
        small, large, compressed = figures["n10"], figures["n200"], figures["n10-zstd"]
        # Steps 2 and 4 reuse the plans (4: those planned at 3, after the shape change).
        later = [saves[i]["calls"] for saves in (small, large, compressed) for i in (1, 3)]
        assert len(set(later)) == 1, figures
        assert small[0]["calls"] == large[0]["calls"] > later[0]
        # The shape change at step 3 plans afresh: as many collectives as a first save.
        assert small[2]["calls"] == small[0]["calls"]
        assert large[2]["calls"] == large[0]["calls"]
    for saves in (ranks[0][job] for job, _, _ in JOBS):
        # DCP's plan gather runs (rank 0 makes the global plan) only at steps 1 and 3.
        assert [s["global_plans"] for s in saves] == [1, 0, 1, 0]
    # What a later save sends grows with the tensor count only by the item digests the
    # ranks report to rank 0 (8 bytes per item; each item here is written by one rank).
    for rank, figures in enumerate(ranks):
        grown = figures["n200"][1]["bytes"] - figures["n10"][1]["bytes"]
        assert 0 <= grown <= 8 * 190 + 256, (rank, grown)
        first_grown = figures["n200"][0]["bytes"] - figures["n10"][0]["bytes"]
        assert first_grown > 10 * grown + 1000, (rank, first_grown, grown)

    # World.agree's success path is one all-reduce of a flag: a load's agreements (checking,
    # verifying, the component's prepare, its shared read, its apply) are five all_reduce
    # calls, and its one all-gather is the targets' fingerprints, whatever the tensor count.
    for figures in ranks:
        for job, _, _ in JOBS:
            load = figures[f"{job}-load"]
            assert load["all_reduce"] == 5 and load["all_gather_object"] == 1, (job, load)
    # Rank 0's outcome goes out without the manifest: a later save's broadcast is a few
    # bytes, so rank 0 sends no more than rank 1 beyond its own larger file reports.
    for job, _, _ in JOBS:
        extra = ranks[0][job][1]["bytes"] - ranks[1][job][1]["bytes"]
        assert extra < 400, (job, extra)

    for job, count, _ in JOBS:
        url = str(tmp_path / "ckpt" / job)
        for step in range(1, 5):
            expected = torch.load(out / f"{job}-step{step}.pt")
            model = ManyTensors(count)
            if step >= 3:
                model.params[3] = nn.Parameter(torch.zeros(96))
            statereg.verify(f"{url}/step_{step:08d}")
            mgr = statereg.CheckpointManager(
                {"storage": {"url": url}, "components": {"model": {"kind": "model"}}},
                model=model)
            assert mgr.load(step=step).step == step
            loaded = model.state_dict()
            assert loaded.keys() == expected.keys()
            for key, value in expected.items():
                assert torch.equal(loaded[key], value), (job, step, key)
