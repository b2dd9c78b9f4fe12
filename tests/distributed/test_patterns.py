"""replicated, per_rank, per_group and global sharing on real gloo process groups."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from torch import nn

import statereg


class Counter:
    """A small stateful object (e.g. a per-rank data cursor or a stage's bookkeeping)."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]

    def reshard_state_dict(self, states: list[dict], rank: int, world_size: int) -> dict:
        """A global cursor: the total is split evenly over the new ranks."""
        total = sum(s["value"] for s in states)
        return {"value": total // world_size}


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    # Data outweighs framing; BatchNorm brings a 0-dim buffer (num_batches_tracked), which
    # replica validation must hash too.
    return nn.Sequential(nn.Linear(128, 256), nn.Linear(256, 64), nn.BatchNorm1d(64))


def _data_bytes(url: str, options: dict[str, Any], component: str) -> int:
    """Bytes of the component's DCP data files, as the manifest recorded them."""
    manifest = statereg.read_manifest(f"{url}/step_00000001", options)
    return sum(f.size for f in manifest.files
               if f.path.startswith(f"{component}/") and f.path.endswith(".distcp"))


# -- replicated ---------------------------------------------------------------------------


def _replicated_spec(url: str, options: dict[str, Any], validate: bool = False) -> dict:
    return {"storage": {"url": url, "options": options},
            "components": {"model": {"kind": "model", "sharing": "replicated",
                                     "validate": validate}}}


def replicated_save(rank: int, world: int, url: str, options: dict, validate: bool,
                    perturb: bool) -> None:
    model = _model(seed=0)  # identical on every rank, like DDP
    if perturb and rank == 1:
        with torch.no_grad():
            model[1].bias[3] += 1.0
    spec = _replicated_spec(url, options, validate)
    mgr = statereg.CheckpointManager(spec, model=model)
    if not perturb:
        mgr.save(step=1)
        return
    with pytest.raises(statereg.CheckpointMismatchError) as info:
        mgr.save(step=1)
    assert "'1.bias'" in str(info.value) and "rank(s) [1]" in str(info.value)


@pytest.mark.parametrize("store", ["local", "s3"], indirect=True)
def test_replicated_model_is_written_once(store, tmp_path: Path) -> None:
    single = str(tmp_path / "single")
    model = _model(seed=0)
    statereg.CheckpointManager(_replicated_spec(single, {}), model=model).save(step=1)

    run_ranks(2, replicated_save, tmp_path, store.url, store.options, True, False)
    one_copy = sum(t.nbytes for t in model.state_dict().values())
    written = _data_bytes(store.url, store.options, "model")
    # Every tensor is written by exactly one rank: one copy plus a few KB of file framing.
    assert one_copy <= written < one_copy * 1.1, (one_copy, written)
    assert written <= _data_bytes(single, {}, "model") + 4096

    loaded = _model(seed=7)
    statereg.CheckpointManager(_replicated_spec(store.url, store.options), model=loaded).load()
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def replicated_loads_again(rank: int, world: int, url: str) -> None:
    # DCP's load plan is kept per checkpoint and targets: loads of one checkpoint after
    # another, on every rank of a gloo group, each bit-exact, one plan per checkpoint.
    from statereg.dcp import reader

    plans = []
    plan = reader._local_plan
    reader._local_plan = lambda *args, **kwargs: plans.append(1) or plan(*args, **kwargs)
    model = _model(seed=0)
    mgr = statereg.CheckpointManager(_replicated_spec(url, {}), model=model)
    mgr.save(step=1)
    first = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model[0].weight.add_(1.0)
    mgr.save(step=2)
    second = {k: v.clone() for k, v in model.state_dict().items()}
    for step, expected, made in ((2, second, 1), (1, first, 2), (2, second, 2), (1, first, 2)):
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        mgr.load(step=step)
        for key, value in expected.items():
            assert torch.equal(model.state_dict()[key], value), (rank, step, key)
        assert len(plans) == made, (rank, step, len(plans))


def test_loads_again_reuse_their_plan_on_every_rank(tmp_path: Path) -> None:
    run_ranks(2, replicated_loads_again, tmp_path, str(tmp_path / "ckpt"))


def test_replicas_that_differ_fail_the_save_naming_tensor_and_ranks(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    run_ranks(2, replicated_save, tmp_path, str(root), {}, True, True)
    assert not (root / "step_00000001" / "manifest.json").exists()


# -- per_rank -----------------------------------------------------------------------------


def _per_rank_spec(root: Path, policy: str = "error") -> dict:
    return {"storage": {"url": str(root)},
            "components": {"rng": {"kind": "rng", "on_world_size_change": policy},
                           "cursor": {"kind": "dataloader", "on_world_size_change": policy}}}


def per_rank_save(rank: int, world: int, root: Path, out: Path) -> None:
    torch.manual_seed(1000 + rank)
    mgr = statereg.CheckpointManager(_per_rank_spec(root), cursor=Counter(10 * (rank + 1)))
    mgr.save(step=1)
    (out / f"expected-{rank}.json").write_text(json.dumps(torch.rand(4).tolist()))


def per_rank_load(rank: int, world: int, root: Path, out: Path) -> None:
    torch.manual_seed(0)  # scramble: the load must restore this rank's own stream
    cursor = Counter()
    statereg.CheckpointManager(_per_rank_spec(root), cursor=cursor).load()
    assert cursor.value == 10 * (rank + 1)
    assert torch.rand(4).tolist() == json.loads((out / f"expected-{rank}.json").read_text())


def test_per_rank_state_returns_to_its_own_rank(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    run_ranks(2, per_rank_save, tmp_path, root, tmp_path)
    files = {f.path for f in statereg.read_manifest(str(root / "step_00000001")).files}
    assert {"rng/rank_00000.json", "rng/rank_00001.json", "cursor/rank_00000.json",
            "cursor/rank_00001.json"} <= files
    run_ranks(2, per_rank_load, tmp_path, root, tmp_path)

    # World size 2 -> 1: an error by default, naming both sizes and what to do.
    with pytest.raises(statereg.CheckpointMismatchError) as info:
        statereg.CheckpointManager(_per_rank_spec(root), cursor=Counter()).load()
    assert "checkpoint=2, current=1" in str(info.value)
    assert "on_world_size_change" in str(info.value)

    # reset: the fresh state stays.
    cursor = Counter(5)
    statereg.CheckpointManager(_per_rank_spec(root, "reset"), cursor=cursor).load()
    assert cursor.value == 5

    # reshard: the cursor splits its global total; RNG streams derive from the checkpoint,
    # reproducibly.
    draws = []
    for _ in range(2):
        cursor = Counter()
        statereg.CheckpointManager(_per_rank_spec(root, "reshard"), cursor=cursor).load()
        assert cursor.value == 30
        draws.append(torch.rand(3))
    assert torch.equal(draws[0], draws[1])


# -- per_group and global -----------------------------------------------------------------


def _stage_model(stage: int) -> nn.Module:
    torch.manual_seed(stage)
    return nn.Linear(4 + stage, 4)  # each pipeline stage holds different parameters


def _group_spec(root: Path) -> dict:
    return {"storage": {"url": str(root)},
            "components": {
                "stage": {"kind": "model", "sharing": "per_group", "group": "pp"},
                "stats": {"kind": "custom", "sharing": "per_group", "group": "pp"},
                "scheduler": {"kind": "scheduler", "sharing": "global"},
            }}


# Two pipeline stages of two ranks each; a group is named by its lowest rank on storage.
SAVED_LAYOUT = [[0, 1], [2, 3]]


def _pipeline(rank: int, layout: list[list[int]]) -> tuple[int, dict]:
    """This rank's stage and its `pp` group; every rank creates every group, in order."""
    groups = [dist.new_group(ranks) for ranks in layout]
    stage = next(i for i, ranks in enumerate(layout) if rank in ranks)
    return stage, {"pp": groups[stage]}


def _scheduler(lr_steps: int) -> torch.optim.lr_scheduler.StepLR:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    for _ in range(lr_steps):
        opt.step()
        sched.step()
    return sched


def per_group_save(rank: int, world: int, root: Path) -> None:
    stage, groups = _pipeline(rank, SAVED_LAYOUT)
    mgr = statereg.CheckpointManager(
        _group_spec(root), groups=groups, stage=_stage_model(stage),
        stats=Counter(100 + stage), scheduler=_scheduler(5))
    mgr.save(step=1)


def per_group_load(rank: int, world: int, root: Path, layout: list[list[int]]) -> None:
    stage, groups = _pipeline(rank, layout)
    model = _stage_model(stage)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    stats, sched = Counter(), _scheduler(0)
    mgr = statereg.CheckpointManager(_group_spec(root), groups=groups, stage=model,
                                     stats=stats, scheduler=sched)
    mgr.load()
    expected = _stage_model(stage)
    for key, value in expected.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), (rank, key)
    assert stats.value == 100 + stage
    assert sched.state_dict() == _scheduler(5).state_dict()  # the one copy, on every rank


def per_group_layout_changed(rank: int, world: int, root: Path,
                             layout: list[list[int]]) -> None:
    stage, groups = _pipeline(rank, layout)
    sched = _scheduler(0)
    mgr = statereg.CheckpointManager(_group_spec(root), groups=groups,
                                     stage=_stage_model(stage), stats=Counter(),
                                     scheduler=sched)
    with pytest.raises(statereg.CheckpointMismatchError) as info:
        mgr.load()
    message = str(info.value)
    assert "component 'stage'" in message and "group 'pp'" in message, message
    assert "2 group copies (group_00000, group_00002) saved on 4 ranks" in message, message
    assert "2 'pp' groups (group_00000, group_00001) on 2 ranks" in message, message
    assert "checkpoint=4, current=2" in message, message
    assert sched.state_dict() == _scheduler(0).state_dict()  # nothing was modified
    # global state does not care: it loads without the per_group components.
    mgr.load(exclude=["stage", "stats"])
    assert sched.state_dict() == _scheduler(5).state_dict()


@pytest.fixture(scope="module")
def saved_in_two_groups_of_two(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("per-group")
    run_ranks(4, per_group_save, tmp, tmp / "ckpt")
    return tmp / "ckpt"


def test_per_group_copies_map_back_to_their_group_and_global_is_rank_0s(
        saved_in_two_groups_of_two: Path, tmp_path: Path) -> None:
    root = saved_in_two_groups_of_two
    files = {f.path for f in statereg.read_manifest(str(root / "step_00000001")).files}
    assert {"stats/group_00000/state.json", "stats/group_00002/state.json",
            "stage/group_00000/.metadata", "stage/group_00002/.metadata",
            "scheduler/state.json"} <= files
    assert not any(p.startswith("scheduler/") and p != "scheduler/state.json" for p in files)
    run_ranks(4, per_group_load, tmp_path, root, SAVED_LAYOUT)


def test_world_size_change_global_loads_anywhere_per_group_needs_the_same_groups(
        saved_in_two_groups_of_two: Path, tmp_path: Path) -> None:
    root = saved_in_two_groups_of_two
    # 4 -> 3 ranks, the same groups by lowest rank: stage 1 lost a member, and its one rank
    # loads the whole copy (DCP reshards within a group).
    run_ranks(3, per_group_load, tmp_path, root, [[0, 1], [2]])
    # 4 -> 2 ranks, one rank per stage: group_00001 has no copy and group_00002's would be
    # left behind; the per_group components refuse, global state still loads.
    run_ranks(2, per_group_layout_changed, tmp_path, root, [[0], [1]])
    # 4 -> 1: one process, no process group at all.
    sched = _scheduler(0)
    mgr = statereg.CheckpointManager(_group_spec(root), stage=_stage_model(0), stats=Counter(),
                                     scheduler=sched)
    mgr.load(include=["scheduler"])
    assert sched.state_dict() == _scheduler(5).state_dict()


def _adamw(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 512)).square().mean().backward()
    opt.step()
    return model, opt


def replicated_optimizer_round_trip(rank: int, world: int, root: Path) -> None:
    declared = {"storage": {"url": str(root)},
                "components": {"model": {"kind": "model", "sharing": "replicated"},
                               "optimizer": {"kind": "optimizer", "sharing": "replicated"}}}
    model, opt = _adamw(seed=1)
    statereg.CheckpointManager(declared, model=model, optimizer=opt).save(step=1)
    fresh_model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))
    fresh = torch.optim.AdamW(fresh_model.parameters())
    statereg.CheckpointManager(declared, model=fresh_model, optimizer=fresh).load()
    for saved, loaded in zip(model.parameters(), fresh_model.parameters(), strict=True):
        before, after = opt.state[saved], fresh.state[loaded]
        # The same entries, in the order AdamW made them, although deduplication had the
        # two ranks write different moments of one parameter.
        assert list(after) == list(before) == ["step", "exp_avg", "exp_avg_sq"], list(after)
        for key in before:
            assert torch.equal(after[key], before[key]), (rank, key)


def test_a_replicated_optimizer_comes_back_in_its_own_order_from_two_ranks(
        tmp_path: Path) -> None:
    run_ranks(2, replicated_optimizer_round_trip, tmp_path, tmp_path / "ckpt")
    files = statereg.read_manifest(str(tmp_path / "ckpt" / "step_00000001")).files
    writers = {f.path.split("/")[-1][:3] for f in files
               if f.path.startswith("optimizer/") and f.path.endswith(".distcp")}
    assert writers == {"__0", "__1"}, writers  # both ranks wrote some of the moments
