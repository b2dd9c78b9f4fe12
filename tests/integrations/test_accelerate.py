"""Accelerate with statereg (statereg.integrations.accelerate): save_state / load_state
checkpoint everything the Accelerator holds, and a resume is bit-identical."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from integrations.trainees import Counter, MarkovTokens, digest, tiny_gpt2, train_accelerate
from test_transformers import assert_same_steps, run_three

import statereg
from statereg.integrations import accelerate as sr_accelerate


def test_sigkill_mid_epoch_then_resume_is_bit_identical(tmp_path: Path) -> None:
    # 12 steps per epoch, saves every 5 (async), kill after step 23: resume from step 20,
    # 8 batches into the second epoch, or from step 15 if the save of step 20 was still
    # being written (either way the DataLoaderShard's epoch counter must come back too).
    config = {"max_steps": 30, "save_steps": 5, "loader": "torchdata",
              "statereg": {"save": {"async": "thread", "keep_last": 2}}}
    want, got = run_three(tmp_path, train_accelerate, config, 1, kill_after=23,
                          resume_from=(15, 20))
    assert_same_steps(want[0], got[0], 30)
    assert got[0].final["seen"] == want[0].final["seen"] == 30 * 4  # register_for_checkpointing


def test_resume_at_an_epoch_boundary_is_bit_identical(tmp_path: Path) -> None:
    # Saves every 12 steps = at the last batch of each epoch: the resume starts a new epoch.
    # Synchronous saves, declared: the kill two steps later must find step 12 committed.
    config = {"max_steps": 30, "save_steps": 12, "statereg": {"save": {"async": "off"}}}
    want, got = run_three(tmp_path, train_accelerate, config, 1, kill_after=14,
                          resume_from=(12,))
    assert_same_steps(want[0], got[0], 30)


def accelerator_with(tmp_path: Path, stateful: bool = True, seedable: bool = True, *,
                     samples: int = 16, batch_size: int = 4, accumulation: int = 1,
                     ) -> tuple[Any, ...]:
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation,
                              dataloader_config=DataLoaderConfiguration(
                                  use_stateful_dataloader=stateful,
                                  use_seedable_sampler=seedable))
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(MarkovTokens(samples), batch_size=batch_size,
                                         shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    return accelerator, model, optimizer, loader


def test_everything_registered_becomes_a_component(tmp_path: Path) -> None:
    accelerator, *_ = accelerator_with(tmp_path)
    accelerator.register_for_checkpointing(Counter())
    spec = sr_accelerate.spec_for(accelerator, {"storage": {"url": str(tmp_path / "c")}})
    assert {n: c.kind for n, c in spec.components.items()} == {
        "model": "model", "optimizer": "optimizer", "dataloader": "dataloader",
        "custom_0": "custom", "accelerator": "custom", "rng": "rng"}
    assert spec.profiles["finetune"].include == ["model"]


def test_a_dataloader_that_cannot_resume_mid_epoch_is_refused(tmp_path: Path) -> None:
    accelerator, *_ = accelerator_with(tmp_path, stateful=False)
    with pytest.raises(statereg.SpecError, match=(
            r"dataloader: accelerator.prepare\(\) made a dataloader that cannot say where it "
            r"is inside its epoch.*DataLoaderConfiguration\(use_stateful_dataloader=True\)")):
        sr_accelerate.save_state(accelerator, {"storage": {"url": str(tmp_path / "c")}}, 1)
    accelerator, *_ = accelerator_with(tmp_path, seedable=False)
    with pytest.raises(statereg.SpecError, match=(
            r"dataloader: its RandomSampler draws each epoch's order from a generator that "
            r"BatchSampler does not save.*use_seedable_sampler=True\): each epoch's order then "
            r"comes from seed \+ epoch")):
        sr_accelerate.save_state(accelerator, {"storage": {"url": str(tmp_path / "c")}}, 1)
    # Left out on request: the user skips batches, as with Accelerate's own checkpoints.
    with sr_accelerate.manager(accelerator, {"storage": {"url": str(tmp_path / "c")}},
                               dataloaders=False) as mgr:
        assert "dataloader" not in mgr.spec.components


def test_save_to_s3_by_storage_url_and_finetune_from_it(tmp_path: Path, s3_server: Any,
                                                        s3_admin: Any) -> None:
    from storage_servers import new_bucket, s3_options

    spec = {"storage": {"url": f"s3://{new_bucket(s3_admin)}/run",
                        "options": s3_options(s3_server.endpoint)}}
    accelerator, model, optimizer, loader = accelerator_with(tmp_path)
    for step, batch in enumerate(loader, 1):
        accelerator.backward(model(**batch).loss)
        optimizer.step()
        optimizer.zero_grad()
        sr_accelerate.save_state(accelerator, spec, step)
    sr_accelerate.close(accelerator)
    trained = digest(accelerator.unwrap_model(model))
    # A new Accelerator, new objects: the weights only, from the S3 checkpoint.
    accelerator2, model2, *_ = accelerator_with(tmp_path)
    assert digest(accelerator2.unwrap_model(model2)) != trained
    result = sr_accelerate.load_state(accelerator2, spec, profile="finetune")
    assert result is not None and result.step == 4 and result.components == ("model",)
    assert digest(accelerator2.unwrap_model(model2)) == trained
    sr_accelerate.close(accelerator2)


def test_two_gloo_ranks_resume_in_a_later_epoch_is_bit_identical(tmp_path: Path) -> None:
    # 2 ranks: Accelerate shards batches with its seedable sampler, whose order comes from
    # seed + the DataLoaderShard's epoch counter. 6 steps per epoch; saves every 4, the kill
    # after step 10 resumes from step 8, 2 batches into the second epoch (synchronous saves,
    # declared, so that step 8 is committed at the kill).
    config = {"max_steps": 16, "save_steps": 4, "statereg": {"save": {"async": "off"}}}
    want, got = run_three(tmp_path, train_accelerate, config, 2, kill_after=10,
                          resume_from=(8,))
    for rank in range(2):
        assert_same_steps(want[rank], got[rank], 16)


class LoaderRecord:
    """Reads a checkpoint's dataloader component as saved."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


@pytest.mark.parametrize("how", ["accumulate", "by-hand"])
def test_save_state_commits_only_at_optimizer_steps(tmp_path: Path, how: str) -> None:
    """A loop that calls save_state after every micro-batch, two micro-batches a step (with
    accelerator.accumulate(), or stepping the optimizer every other batch by hand), commits
    after each optimizer step only: never step 0 after the first micro-batch, and each
    checkpoint's loader position is 2 batches per step."""
    accelerator, model, optimizer, loader = accelerator_with(
        tmp_path, samples=32, accumulation=2 if how == "accumulate" else 1)
    spec = {"storage": {"url": str(tmp_path / "c")}}
    assert sr_accelerate.load_state(accelerator, spec) is None
    step = 0
    for i, batch in enumerate(loader):
        if how == "accumulate":
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
                optimizer.step()
                optimizer.zero_grad()
            step += accelerator.sync_gradients
        else:
            accelerator.backward(model(**batch).loss / 2)
            if i % 2 == 1:
                optimizer.step()
                optimizer.zero_grad()
                step += 1
        sr_accelerate.save_state(accelerator, spec, step)
    sr_accelerate.close(accelerator)
    steps = sorted(int(p.name.removeprefix("step_")) for p in (tmp_path / "c").glob("step_*"))
    assert steps == [1, 2, 3, 4]
    record = LoaderRecord()
    reader_spec = {"storage": {"url": str(tmp_path / "c")},
                   "components": {"dataloader": {"kind": "dataloader"}}}
    with statereg.CheckpointManager(reader_spec, dataloader=record) as reader:
        for saved in steps[:-1]:  # the last is at the epoch's end: a new epoch's start
            reader.load(step=saved, include=["dataloader"])
            assert record.state["loader"]["_num_yielded"] == 2 * saved


@pytest.mark.parametrize(("changed", "named"), [
    ({"batch_size": 2}, "batch size 4 -> 2"),
    ({"samples": 12}, "dataset length 16 -> 12"),
])
def test_a_resume_with_another_loader_is_refused_naming_the_change(
        tmp_path: Path, changed: dict[str, Any], named: str) -> None:
    accelerator, model, optimizer, loader = accelerator_with(tmp_path)
    spec = {"storage": {"url": str(tmp_path / "c")}}
    for step, batch in enumerate(loader, 1):
        accelerator.backward(model(**batch).loss)
        optimizer.step()
        optimizer.zero_grad()
        sr_accelerate.save_state(accelerator, spec, step)
        if step == 2:
            break
    sr_accelerate.close(accelerator)
    accelerator2, *_ = accelerator_with(tmp_path, **changed)
    with pytest.raises(statereg.CheckpointMismatchError, match=(
            rf"component 'dataloader': the data loader is not the one the checkpoint saved "
            rf"\({named}\)")):
        sr_accelerate.load_state(accelerator2, spec)
    sr_accelerate.close(accelerator2)


def test_saves_are_asynchronous_by_default_and_end_training_waits(tmp_path: Path) -> None:
    accelerator, model, optimizer, loader = accelerator_with(tmp_path)
    spec = {"storage": {"url": str(tmp_path / "c")}}
    assert sr_accelerate.spec_for(accelerator, spec).save.async_mode == "thread"
    explicit = {**spec, "save": {"async": "off"}}
    assert sr_accelerate.spec_for(accelerator, explicit).save.async_mode == "off"
    batch = next(iter(loader))
    accelerator.backward(model(**batch).loss)
    optimizer.step()
    handle = sr_accelerate.save_state(accelerator, spec, 1)
    assert handle is not None
    accelerator.end_training()  # closes the manager first: the save is committed
    assert (tmp_path / "c" / "step_00000001" / "manifest.json").exists()
    assert handle.info().step == 1
