"""The Hugging Face Trainer with statereg (statereg.integrations.transformers).

A real Trainer fit (a 2-layer GPT-2 built from a config, with dropout; a shuffled dataset; a
warmup + cosine LR schedule stepped every step) is killed with SIGKILL mid-epoch and resumed
in a new process with `resume_from_checkpoint=True`: every later step's loss, gradient norm
and learning rate equal the uninterrupted run's bit for bit, and so do the final weights.
"""

from __future__ import annotations

import dataclasses
import signal
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from integrations.trainees import (
    MarkovTokens,
    Run,
    digest,
    launch,
    read_records,
    tiny_gpt2,
    train_hf,
    trainer_args,
)
from transformers import TrainerCallback

import statereg
from statereg.integrations.transformers import StateregTrainer, spec_from_training_args

KILLED = -signal.SIGKILL


def run_three(tmp_path: Path, entry: Any, config: dict[str, Any], nprocs: int,
              kill_after: int, resume_from: tuple[int, ...]) -> tuple[list[Run], list[Run]]:
    """A reference run, a run killed with SIGKILL after step `kill_after`, and its resume in
    new processes, which must start from the latest checkpoint committed before the kill, one
    of `resume_from` (an async save in flight at the kill is lost); returns (reference,
    resumed) records of every rank, whose final weights must agree."""
    ref = {**config, "output_dir": str(tmp_path / "ref"), "records": str(tmp_path / "ref-rec")}
    run = {**config, "output_dir": str(tmp_path / "run"), "records": str(tmp_path / "killed")}
    for conf in (ref, run):
        if isinstance(conf.get("statereg"), dict):
            conf["statereg"] = {**conf["statereg"], "storage": {"url": conf["output_dir"]}}
    assert launch(entry, ref, nprocs) == [0] * nprocs
    assert launch(entry, {**run, "kill_after": kill_after}, nprocs)[0] == KILLED
    killed = read_records(Path(run["records"]))
    assert max(killed.steps) == kill_after
    with statereg.CheckpointManager({"storage": {"url": run["output_dir"]},
                                     "components": {"rng": {"kind": "rng"}}}) as reader:
        latest = reader.peek()
    assert latest is not None and latest.step in resume_from
    resumed_dir = tmp_path / "resumed"
    assert launch(entry, {**run, "records": str(resumed_dir), "resume": True},
                  nprocs) == [0] * nprocs
    want = [read_records(Path(ref["records"]), r) for r in range(nprocs)]
    got = [read_records(resumed_dir, r) for r in range(nprocs)]
    for rank in range(nprocs):
        assert got[rank].start == latest.step, f"rank {rank} did not resume from {latest.path}"
        assert got[rank].final["final"] == want[rank].final["final"], \
            f"rank {rank}: the final weights differ"
    return want, got


def assert_same_steps(want: Run, got: Run, last: int) -> None:
    first = got.start + 1
    assert sorted(got.steps) == list(range(first, last + 1))
    differ = [s for s in got.steps if got.steps[s] != want.steps[s]]
    assert not differ, (f"{len(differ)} of {last - first + 1} steps differ after the resume, "
                        f"first {differ[0]}: uninterrupted {want.steps[differ[0]]}, "
                        f"resumed {got.steps[differ[0]]}")


def test_sigkill_mid_epoch_then_resume_is_bit_identical(tmp_path: Path) -> None:
    # 48 samples, batches of 4: 12 steps per epoch. Saves every 5 steps (asynchronous, the
    # default); the kill after step 17 loses steps 16-17 and the resume starts at step 15, 3
    # batches into epoch 2, or at 10 if the save of step 15 was still being written.
    config = {"max_steps": 30, "save_steps": 5, "save_total_limit": 2}
    want, got = run_three(tmp_path, train_hf, config, 1, kill_after=17, resume_from=(10, 15))
    with statereg.CheckpointManager({"storage": {"url": str(tmp_path / "run")},
                                     "components": {"rng": {"kind": "rng"}}}) as ckpts:
        names = [u.rsplit("/", 1)[-1] for u in ckpts.list()]
    assert names == ["step_00000025", "step_00000030"]  # save_total_limit=2 -> keep_last
    assert_same_steps(want[0], got[0], 30)


def test_four_gloo_ranks_ddp_resume_is_bit_identical(tmp_path: Path) -> None:
    # 4 ranks x batches of 4 over 48 samples: 3 steps per epoch. Saves every 4 steps; the
    # kill after step 11 resumes from step 8, 2 batches into epoch 3 (from 4 if the
    # asynchronous save of step 8 was still being written). Records: rank 0's
    # logged loss (the mean over ranks), gradient norm and LR; every rank's final weights.
    # STATEREG_TEST_DDP_HOOK=module:function is called with each rank's Trainer before
    # train() (a recipe for DDP's first iteration after construction, issue 26).
    config = {"max_steps": 16, "save_steps": 4}
    want, got = run_three(tmp_path, train_hf, config, 4, kill_after=11, resume_from=(4, 8))
    for rank in range(4):
        assert_same_steps(want[rank], got[rank], 16)


# -- what TrainingArguments map to -----------------------------------------------------------


def args_for(tmp_path: Path, **overrides: Any) -> Any:
    config = {"output_dir": str(tmp_path / "out"), "max_steps": 6, "save_steps": 2,
              **overrides}
    return trainer_args(config)


def test_training_arguments_become_the_declaration(tmp_path: Path) -> None:
    args = args_for(tmp_path, save_total_limit=3, eval_strategy="steps", eval_steps=2,
                    metric_for_best_model="loss", load_best_model_at_end=True)
    spec = spec_from_training_args(args)
    assert spec.storage.url == str(tmp_path / "out")
    assert spec.save.every_steps == 2 and spec.save.keep_last == 3
    assert (spec.save.keep_best.metric, spec.save.keep_best.mode) == ("eval_loss", "min")
    assert {n: c.kind for n, c in spec.components.items()} == {
        "model": "model", "optimizer": "optimizer", "scheduler": "scheduler", "rng": "rng",
        "trainer_state": "custom"}
    assert spec.profiles["finetune"].include == ["model"]
    assert spec.save.async_mode == "thread"  # asynchronous unless declared (pinned on CUDA)
    off = spec_from_training_args(args, {"save": {"async": "off"}})
    assert off.save.async_mode == "off"
    only = spec_from_training_args(args_for(tmp_path, save_only_model=True))
    assert list(only.components) == ["model", "trainer_state"]


def test_a_yaml_that_contradicts_training_arguments_is_refused(tmp_path: Path) -> None:
    yaml = tmp_path / "statereg.yaml"
    yaml.write_text("storage: {url: s3://bucket/run}\nsave: {keep_last: 5}\n")
    with pytest.raises(statereg.SpecError, match=(
            r"save.keep_last is 5 but TrainingArguments.save_total_limit says 2; keep one")):
        spec_from_training_args(args_for(tmp_path, save_total_limit=2), yaml)
    yaml.write_text("storage: {url: s3://bucket/run}\ncomponents: {ema: {kind: model}}\n")
    with pytest.raises(statereg.SpecError, match=r"components.ema: a StateregTrainer has no "
                       r"object for it; it saves model, optimizer"):
        spec_from_training_args(args_for(tmp_path), yaml)
    yaml.write_text("storage: {url: s3://bucket/run}\ncomponents: {model: {format: "
                    "safetensors}}\nsave: {async: thread}\n")
    spec = spec_from_training_args(args_for(tmp_path), yaml)
    assert spec.storage.url == "s3://bucket/run"
    assert spec.components["model"].format == "safetensors"
    assert spec.components["optimizer"].required is False


def in_process_trainer(tmp_path: Path, spec: Any = None, *, samples: int = 24,
                       callbacks: list[Any] | None = None, args_changes: dict[str, Any] | None
                       = None, **overrides: Any) -> StateregTrainer:
    """A StateregTrainer of a tiny GPT-2 on `samples` sequences; `args_changes`: more
    TrainingArguments fields (e.g. gradient_accumulation_steps)."""
    torch.set_num_threads(1)
    args = args_for(tmp_path, **overrides)
    if args_changes:
        args = dataclasses.replace(args, **args_changes)
    eval_dataset = MarkovTokens(8, seed=99) if overrides.get("eval_strategy") else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return StateregTrainer(model=tiny_gpt2(), args=args,
                               train_dataset=MarkovTokens(samples), eval_dataset=eval_dataset,
                               callbacks=callbacks, statereg=spec)


def test_resume_true_without_a_checkpoint_says_so(tmp_path: Path) -> None:
    trainer = in_process_trainer(tmp_path)
    with pytest.raises(statereg.CheckpointNotFoundError, match=(
            r"resume_from_checkpoint=True: no committed checkpoint under .*out; train "
            "without resume_from_checkpoint to start")):
        trainer.train(resume_from_checkpoint=True)


def test_best_model_at_end_loads_the_best_checkpoint_model_only(tmp_path: Path) -> None:
    trainer = in_process_trainer(tmp_path, eval_strategy="steps", eval_steps=2,
                                 metric_for_best_model="loss", load_best_model_at_end=True,
                                 save_total_limit=1)
    trainer.train()
    mgr = trainer.statereg
    best = mgr.best()
    assert trainer.state.best_model_checkpoint == best[0]
    evals = {e["step"]: e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e}
    best_step = min(evals, key=evals.get)
    assert best[0].endswith(f"step_{best_step:08d}")
    # keep_last 1 + keep_best: the best and the last survive.
    assert [u.rsplit("/", 1)[-1] for u in mgr.list()] == sorted(
        {f"step_{best_step:08d}", "step_00000006"})
    # The model is the best checkpoint's: a fresh model loaded from it has the same weights.
    fresh = tiny_gpt2(seed=1)
    with statereg.CheckpointManager({"storage": {"url": str(tmp_path / "x")},
                                     "components": {"model": {"kind": "model"}}},
                                    model=fresh) as reader:
        reader.load(best[0], include=["model"])
    assert digest(fresh) == digest(trainer.model)
    assert digest(fresh) != digest(in_process_trainer(tmp_path / "y").model)


def test_save_to_s3_by_storage_url_and_finetune_from_it(tmp_path: Path, s3_server: Any,
                                                        s3_admin: Any) -> None:
    from storage_servers import new_bucket, s3_options

    url = f"s3://{new_bucket(s3_admin)}/run"
    spec = {"storage": {"url": url, "options": s3_options(s3_server.endpoint)}}
    trainer = in_process_trainer(tmp_path, spec)
    trainer.train()
    assert [u.rsplit("/", 1)[-1] for u in trainer.statereg.list()] == [
        "step_00000002", "step_00000004", "step_00000006"]
    # A new run starts from the S3 checkpoint's weights only (profile finetune).
    other = in_process_trainer(tmp_path / "ft", spec)
    before = {n: t.clone() for n, t in other.optimizer.state_dict().items()} \
        if other.optimizer is not None else {}
    result = other.statereg.load(trainer.statereg.latest(), profile="finetune")
    assert result.components == ("model",) and result.step == 6
    assert digest(other.model) == digest(trainer.model)
    assert before == {}
    out = trainer.export_hf(tmp_path / "hf")
    from transformers import GPT2LMHeadModel

    exported = GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    assert digest(exported) == digest(trainer.model) and out is not None


def test_importing_statereg_imports_no_trainer_framework() -> None:
    import subprocess
    import sys

    code = ("import sys, statereg, statereg.integrations; statereg.CheckpointManager; "
            "print(sorted(m for m in ('transformers', 'accelerate', 'lightning', "
            "'pytorch_lightning') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_resume_from_a_statereg_url_continues_exactly_in_process(tmp_path: Path) -> None:
    first = in_process_trainer(tmp_path)
    first.train()
    step4 = next(u for u in first.statereg.list() if u.endswith("step_00000004"))
    second = in_process_trainer(tmp_path / "again")  # saves under again/out
    second.train(resume_from_checkpoint=step4)
    def losses(trainer: StateregTrainer) -> dict[int, float]:
        return {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}

    # The TrainerState came back with the log of steps 1-4; steps 5 and 6 ran again.
    assert losses(second) == losses(first) and sorted(losses(second)) == [1, 2, 3, 4, 5, 6]
    assert digest(second.model) == digest(first.model)


def test_a_declared_time_cadence_adds_saves(tmp_path: Path) -> None:
    trainer = in_process_trainer(tmp_path, {"save": {"every_seconds": 1e-9}},
                                 save_strategy="no")
    assert trainer.statereg_spec.save.every_steps is None
    trainer.train()
    assert [u.rsplit("_", 1)[-1] for u in trainer.statereg.list()] == [
        f"{s:08d}" for s in range(1, 7)]


def test_with_statereg_derives_a_trainer_subclass_once(tmp_path: Path) -> None:
    from transformers import Seq2SeqTrainer, Trainer

    from statereg.integrations.transformers import with_statereg

    derived = with_statereg(Seq2SeqTrainer)
    assert issubclass(derived, Seq2SeqTrainer) and derived.__name__ == "StateregSeq2SeqTrainer"
    assert with_statereg(Seq2SeqTrainer) is derived and with_statereg(Trainer) is StateregTrainer
    with pytest.raises(statereg.SpecError, match=r"pass a transformers\.Trainer subclass"):
        with_statereg(dict)  # type: ignore[arg-type]


# -- gradient accumulation, asynchronous saves, a resume on other data ----------------------


class RngAtStepEnd(TrainerCallback):
    """The torch generator's state at the end of each optimizer step; raises after step
    `fail_after` (a crash that is an exception)."""

    def __init__(self, fail_after: int | None = None) -> None:
        self.states: dict[int, torch.Tensor] = {}
        self.fail_after = fail_after

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.fail_after is not None and state.global_step > self.fail_after:
            raise RuntimeError("the run crashed")
        self.states[state.global_step] = torch.get_rng_state()


def test_saves_come_only_after_optimizer_steps_under_accumulation(tmp_path: Path) -> None:
    """gradient_accumulation_steps=2 and a time cadence due at every step: each checkpoint
    holds the generators as they were at the end of its optimizer step, not a micro-batch's
    dropout later, and there is one per optimizer step, none before the first."""
    seen = RngAtStepEnd()
    trainer = in_process_trainer(tmp_path, {"save": {"every_seconds": 1e-9}},
                                 save_strategy="no", callbacks=[seen],
                                 args_changes={"gradient_accumulation_steps": 2})
    trainer.train()
    assert [u.rsplit("_", 1)[-1] for u in trainer.statereg.list()] == [
        f"{s:08d}" for s in range(1, 7)]
    reader_spec = {"storage": {"url": str(tmp_path / "out")},
                   "components": {"rng": {"kind": "rng"}}}
    with statereg.CheckpointManager(reader_spec) as reader:
        for step in range(1, 7):
            reader.load(step=step, include=["rng"])
            assert torch.equal(torch.get_rng_state(), seen.states[step]), f"step {step}"


def test_an_exception_in_train_still_commits_the_save_in_flight(tmp_path: Path) -> None:
    trainer = in_process_trainer(tmp_path, callbacks=[RngAtStepEnd(fail_after=4)])
    assert trainer.statereg_spec.save.async_mode == "thread"
    with pytest.raises(RuntimeError, match="the run crashed"):
        trainer.train()
    assert [u.rsplit("/", 1)[-1] for u in trainer.statereg.list()] == [
        "step_00000002", "step_00000004"]


@pytest.mark.parametrize(("changes", "named"), [
    ({"args_changes": {"per_device_train_batch_size": 2}}, "batch size per device 4 -> 2"),
    ({"samples": 20}, "dataset length 24 -> 20"),
    ({"args_changes": {"gradient_accumulation_steps": 2}}, "gradient_accumulation_steps 1 -> 2"),
])
def test_a_resume_on_other_data_is_refused_naming_the_change(
        tmp_path: Path, changes: dict[str, Any], named: str) -> None:
    """The Trainer resumes by skipping global_step x accumulation batches of the epoch: with
    another batch size or dataset that would silently continue on another data stream."""
    in_process_trainer(tmp_path, max_steps=4).train()
    other = in_process_trainer(tmp_path, **changes)
    with pytest.raises(statereg.CheckpointMismatchError, match=(
            rf"step_00000004: this run's training data is not the one the checkpoint was "
            rf"trained on \({named}\)")):
        other.train(resume_from_checkpoint=True)
