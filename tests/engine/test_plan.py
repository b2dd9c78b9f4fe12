"""engine/plan.py: per-rank tasks compiled from a declaration and a world layout, and load
tasks compiled from what a manifest says was saved. Plain data, no processes."""

from __future__ import annotations

import pytest

import statereg
from statereg.engine.plan import (
    Saved,
    WorldLayout,
    compile_job,
    compile_load,
    compile_plan,
    render_job,
    unpredicted,
)

FOUR_IN_TWO_STAGES = WorldLayout(0, 4, {"pp": ((0, 1), (2, 3))})


def _spec(**components: dict) -> statereg.RegistrySpec:
    return statereg.load_spec({"storage": {"url": "./c"}, "components": components})


def test_per_group_object_state_is_written_by_the_lowest_rank_of_every_group():
    spec = _spec(stage={"kind": "custom", "sharing": "per_group", "group": "pp",
                        "format": "torch"})
    tasks = [p.task("stage") for p in compile_job(spec, FOUR_IN_TWO_STAGES)]
    assert [t.leader for t in tasks] == [True, False, True, False]
    assert [t.files for t in tasks] == [("stage/group_00000/state.pt",), (),
                                        ("stage/group_00002/state.pt",), ()]


def test_sharded_dcp_every_rank_writes_its_own_data_files_and_rank_0_the_metadata():
    spec = _spec(model={"kind": "model"}, optimizer={"kind": "optimizer"})
    plans = compile_job(spec, WorldLayout(0, 2))
    assert plans[0].task("optimizer").files == ("optimizer/__0_*.distcp", "optimizer/.metadata",
                                                "optimizer/extra.json")
    assert plans[1].task("model").files == ("model/__1_*.distcp",)
    assert all(p.task("model").collective == "world" for p in plans)


def test_global_is_rank_0_alone_and_per_rank_dcp_gets_a_directory_per_rank():
    spec = _spec(model={"kind": "model", "sharing": "per_rank"},
                 sched={"kind": "scheduler"})
    plans = compile_job(spec, WorldLayout(0, 2))
    assert [p.task("sched").takes_part for p in plans] == [True, False]
    assert plans[1].task("model").directory == "model/rank_00001"
    assert plans[1].task("model").collective is None


def test_safetensors_files_are_named_from_measured_tensor_sizes():
    spec = _spec(model={"kind": "model", "format": "safetensors", "max_shard_size": 100})
    sizes = {"model": [("a", 60), ("b", 60), ("c", 10)]}
    task = compile_plan(spec, WorldLayout(0, 1), sizes=sizes).task("model")
    assert task.files == ("model/model-00001-of-00002.safetensors",
                          "model/model-00002-of-00002.safetensors",
                          "model/model.safetensors.index.json")
    assert task.nbytes == 130


def test_unpredicted_names_extra_and_missing_files():
    spec = _spec(model={"kind": "model"})
    plans = compile_job(spec, WorldLayout(0, 2))
    assert unpredicted(["model/__0_0.distcp", "model/.metadata"], plans) == ([], [])
    assert unpredicted(["model/__0_0.distcp", "model/stray"], plans) == (
        ["model/stray"], ["model/.metadata"])


def test_render_prints_every_rank_and_what_it_writes():
    spec = _spec(sched={"kind": "scheduler"})
    text = render_job(compile_job(spec, WorldLayout(0, 2)))
    assert "rank 0 of 2" in text and "sched/state.json" in text
    assert "rank 1 of 2" in text and "(writes nothing)" in text


def test_a_group_the_manager_was_not_given_is_a_spec_error():
    spec = _spec(stage={"kind": "custom", "sharing": "per_group", "group": "pp"})
    with pytest.raises(statereg.SpecError, match="pass groups="):
        compile_plan(spec, WorldLayout(0, 2))


# -- load -------------------------------------------------------------------------------------


def _saved(sharing: str, world_size: int, files: tuple[str, ...] = (), kind: str = "custom",
           fmt: str = "json") -> Saved:
    return Saved(kind, sharing, fmt, world_size, files)


def test_one_copy_patterns_convert_into_each_other():
    spec = _spec(c={"kind": "custom", "sharing": "replicated"})
    tasks = compile_load(spec, {"c": _saved("global", 4, ("c/state.json",))}, ["c"],
                         WorldLayout(1, 2), "ckpt")
    assert tasks["c"].state_files == ("c/state.json",)


def test_every_mismatch_is_reported_at_once_naming_saved_and_declared():
    spec = _spec(a={"kind": "custom", "sharing": "global"},
                 b={"kind": "dataloader"})
    saved = {"a": _saved("per_rank", 2), "b": _saved("per_rank", 4, kind="dataloader")}
    with pytest.raises(statereg.CheckpointMismatchError) as info:
        compile_load(spec, saved, ["a", "b"], WorldLayout(0, 2), "ckpt")
    message = str(info.value)
    assert "component 'a': saved as sharing per_rank, format json on 2 rank(s); declared " \
           "sharing global" in message
    assert "component 'b'" in message and "checkpoint=4, current=2" in message


def test_per_rank_policies_reset_and_reshard_are_explicit():
    spec = _spec(r={"kind": "rng", "on_world_size_change": "reshard"},
                 d={"kind": "dataloader", "on_world_size_change": "reset"})
    saved = {"r": _saved("per_rank", 3, kind="rng"), "d": _saved("per_rank", 3,
                                                                   kind="dataloader")}
    tasks = compile_load(spec, saved, ["r", "d"], WorldLayout(0, 2), "ckpt")
    assert tasks["r"].policy == "reshard"
    assert tasks["r"].state_files == ("r/rank_00000.json", "r/rank_00001.json",
                                      "r/rank_00002.json")
    assert tasks["d"].policy == "reset"


def test_a_kind_changed_since_the_save_is_a_mismatch():
    spec = _spec(c={"kind": "scheduler"})
    with pytest.raises(statereg.CheckpointMismatchError, match="it holds a custom"):
        compile_load(spec, {"c": _saved("global", 1)}, ["c"], WorldLayout(), "ckpt")
