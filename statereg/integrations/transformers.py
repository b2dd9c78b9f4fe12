"""statereg for the Hugging Face `Trainer`: its checkpoints become statereg checkpoints.

The user's change is one line, `Trainer(...)` -> `StateregTrainer(...)` (or
`with_statereg(SFTTrainer)(...)` for a Trainer subclass), plus, optionally, a statereg.yaml
given as `statereg="statereg.yaml"`. Everything else comes from the `TrainingArguments`:

- output_dir -> storage.url, unless the yaml (or STATEREG_STORAGE__URL) names one;
- save_strategy / save_steps -> the Trainer decides when to save, as before (steps, epoch,
  best); save.every_steps mirrors save_steps; a yaml `every_seconds` or `every: auto` adds
  saves;
- save_total_limit -> save.keep_last;
- metric_for_best_model / greater_is_better -> save.keep_best {metric: eval_<name>, mode};
- load_best_model_at_end -> `load_best(include=["model"])` at the end of train();
- save_only_model -> checkpoints hold the model (and the TrainerState) only;
- resume_from_checkpoint=True / a statereg URL -> the latest committed checkpoint / that one.

Saves are asynchronous unless the yaml says `save.async` (`thread` on CPU, `pinned` on CUDA):
the Trainer waits for the copy to host memory only; train() waits for the last save before
it returns or re-raises an exception, and before loading the best model at the end.

The Trainer saves only after an optimizer step (its `on_step_end` and epoch end), never
between the micro-batches of a gradient accumulation, and so does a declared
`every_seconds` / `every: auto` (asked in `on_step_end`).

A checkpoint holds `model`, `optimizer`, `scheduler`, `rng` (every rank's generators),
`trainer_state` (the TrainerState, json) and, with fp16, `scaler`. A profile `finetune`
(the model only) is declared unless the yaml declares one.

Why a resume is exact. The Trainer rebuilds its dataloader in each `train()` and, on a
resume, skips the batches already trained in the current epoch (accelerate's
`skip_first_batches`, a batch sampler that skips indices without loading them); its sampler
(accelerate's `SeedableRandomSampler`) draws each epoch's order from `seed + epoch`, so the
skip lands exactly where the killed run was. statereg therefore records the position the
Trainer's own skip logic needs (the TrainerState's global_step), not a dataloader state. The
random generators are applied where the Trainer applies its own: after the skipped
iterator is built and the first batches fetched (or before the epoch's iterator, at an epoch
boundary), because building an iterator draws a seed from the global generator that the
uninterrupted run drew before the checkpoint. The optimizer and scheduler do not exist when
the model is resumed: they are declared `required: false` and read, from the same checkpoint
and verified, when the Trainer has built them (`on_train_begin`).

Since the position is a count of batches, it means the same place in the data only for the
same data stream: the checkpoint records what decides it (batch size per device, gradient
accumulation, world size, dataset length, sampling strategy, drop_last, data seed) and a
resume that changed any of them is refused with a CheckpointMismatchError naming it.

Private Trainer methods overridden (listed in the one block of transformers' private names
below the imports, PRIVATE_NAMES: their signatures are checked when this module is imported,
so a transformers release that changed one fails at once, naming it, and
tests/integrations/test_private_contract.py checks them against the release CI pins):

- `_save_checkpoint(model, trial)`: writes a statereg checkpoint instead of checkpoint-N.
- `_load_from_checkpoint(resume_from_checkpoint, model=None)`: loads the statereg checkpoint.
- `_load_rng_state(checkpoint)`: applies its generators where the Trainer would.
- `_load_best_model()`: `load_best(include=["model"])`.

Each falls back to the Trainer's own when given a Hugging Face checkpoint-N directory, so a
run that has those can resume from one and continue with statereg checkpoints.

Supported: transformers 5.23 (CI tests 5.23.0, the pin in constraints.txt); other releases
warn once at import. Not supported yet (refused when the Trainer is built): DeepSpeed, FSDP,
SageMaker model parallelism; hyperparameter search saves with the Trainer's own checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import transformers
from torch.nn.parallel import DistributedDataParallel
from transformers import Trainer, TrainerCallback, TrainingArguments

from statereg import (
    CheckpointManager,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    RegistrySpec,
    SaveInfo,
    SpecError,
    StateregError,
    export_hf,
    list_checkpoints,
    load_spec,
)
from statereg.integrations._common import (
    PrivateName,
    SpecSource,
    check_private_names,
    declaration_dict,
    default_async,
    merge_components,
    section,
    set_once,
)

# Beyond the public API (statereg/__init__.py): the type export_hf returns, the registry of
# process-wide state, and the core's own DDP layout and generator capture
# (docs/integrations/index.md, "Private names").
from statereg.interop import Export
from statereg.process_state import process_wide
from statereg.state.ddp import DDPBucketLayout
from statereg.state.rng import RNGAdapter

logger = logging.getLogger(__name__)

TESTED_TRANSFORMERS = "5.23.0"
SUPPORTED_TRANSFORMERS = ">=5.23,<5.24"
TRAINER_STATE_NAME = "trainer_state.json"  # what Trainer.train() reads from a resume directory

# -- transformers' private names: the Trainer methods StateregMixin overrides ----------------
# Each is listed once here with the parameters the Trainer calls it with, checked at import
# (a release that renamed or changed one fails at once, naming it) and by
# tests/integrations/test_private_contract.py against the release CI pins (constraints.txt).
PRIVATE_NAMES = (
    PrivateName(Trainer, "_save_checkpoint", "writes a statereg checkpoint instead",
                parameters=("self", "model", "trial")),
    PrivateName(Trainer, "_load_from_checkpoint", "loads the statereg checkpoint",
                parameters=("self", "resume_from_checkpoint", "model")),
    PrivateName(Trainer, "_load_rng_state", "applies its generators where the Trainer would",
                parameters=("self", "checkpoint")),
    PrivateName(Trainer, "_load_best_model", "load_best(include=['model'])",
                parameters=("self",)),
)


def _check_trainer_api() -> None:
    """Fail at import, naming the method, if this transformers changed what we override;
    warn once on a release outside the supported range."""
    check_private_names(__name__, "transformers", transformers.__version__,
                        TESTED_TRANSFORMERS, PRIVATE_NAMES)
    major_minor = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
    if major_minor != (5, 23):
        warnings.warn(
            f"statereg.integrations.transformers is tested with transformers "
            f"{TESTED_TRANSFORMERS}; {transformers.__version__} is outside the supported "
            f"range {SUPPORTED_TRANSFORMERS}: check that a resume is still exact",
            UserWarning, stacklevel=3)


_check_trainer_api()
# -- end of transformers' private names ----------------------------------------------------

_RNG = RNGAdapter("rng")
COMPONENTS: dict[str, dict[str, Any]] = {
    "model": {"kind": "model"},
    "optimizer": {"kind": "optimizer", "required": False},
    "scheduler": {"kind": "scheduler", "required": False},
    "rng": {"kind": "rng"},
    "trainer_state": {"kind": "custom", "format": "json"},
}
SCALER = {"kind": "custom", "format": "json", "required": False}
MODEL_ONLY = ("model", "trainer_state")  # what save_only_model=True saves


def _value(option: Any) -> str:
    return str(getattr(option, "value", option))


def spec_from_training_args(
    args: TrainingArguments,
    source: SpecSource | None = None,
    *, scaler: bool = False,
) -> RegistrySpec:
    """The declaration a StateregTrainer uses: `source` (a statereg.yaml, a dict, a spec or
    None), with the Trainer's components and what TrainingArguments says about saving.

    The yaml may leave out `components` (the Trainer's are added) or refine them (format,
    sharing, ...), but may not declare components the Trainer has no object for. STATEREG_*
    environment variables apply, as to any declaration (STATEREG_STORAGE__URL=s3://...).
    """
    data, label = declaration_dict(source, "TrainingArguments")
    storage = section(data, "storage", label)
    if "url" not in storage:
        if not args.output_dir:
            raise SpecError(f"{label}: no storage.url, and TrainingArguments has no "
                            "output_dir; declare storage.url")
        storage["url"] = os.path.abspath(args.output_dir)
    ours = {n: dict(c) for n, c in COMPONENTS.items()
            if not args.save_only_model or n in MODEL_ONLY}
    if scaler and not args.save_only_model:
        ours["scaler"] = dict(SCALER)
    if args.world_size > 1 and not args.save_only_model:
        # The Trainer wraps the model in DDP: its gradient bucket layout is state for an
        # exact resume at 3+ ranks (docs/exact-resume.md#under-ddp); attached once wrapped.
        ours["ddp"] = {"kind": "custom", "required": False}
    merge_components(data, ours, label, "a StateregTrainer")
    save = section(data, "save", label)
    default_async(save, args.device)
    if (_value(args.save_strategy) == "steps" and args.save_steps >= 1
            and save.get("every") != "auto"):
        set_once(save, "every_steps", int(args.save_steps), label,
                 "TrainingArguments.save_steps")
    if args.save_total_limit:
        set_once(save, "keep_last", int(args.save_total_limit), label,
                 "TrainingArguments.save_total_limit")
    if args.metric_for_best_model:
        metric = args.metric_for_best_model
        metric = metric if metric.startswith("eval_") else f"eval_{metric}"
        mode = "max" if args.greater_is_better else "min"
        best = section(save, "keep_best", label)
        for key, value in (("metric", metric), ("mode", mode)):
            set_once(best, key, value, f"{label} (save.keep_best)",
                     "TrainingArguments (metric_for_best_model, greater_is_better)")
    section(data, "profiles", label).setdefault("finetune", {"include": ["model"]})
    return load_spec(data)


def _drives_cadence(spec: RegistrySpec, args: TrainingArguments) -> bool:
    """Whether statereg's declared cadence must add saves to those the Trainer decides."""
    save = spec.save
    if save.every == "auto" or save.every_seconds is not None:
        return True
    return save.every_steps is not None and _value(args.save_strategy) != "steps"


@dataclass
class _Resume:
    """A resume in progress: the statereg checkpoint, and the directory handed to the
    Trainer as `resume_from_checkpoint` (it holds only trainer_state.json)."""

    url: str
    directory: str
    rng: dict[str, Any] | None = None
    best_global_step: int | None = None


PER_PROCESS_FIELDS = ("is_local_process_zero", "is_world_process_zero")
DATA_STREAM_KEY = "statereg_data_stream"
_DATA_STREAM_WORDS = {
    "train_batch_size": "batch size per device", "gradient_accumulation_steps":
    "gradient_accumulation_steps", "world_size": "world size", "dataset_length":
    "dataset length", "train_sampling_strategy": "train_sampling_strategy",
    "dataloader_drop_last": "dataloader_drop_last", "data_seed": "data seed"}


def _data_stream(trainer: Any) -> dict[str, Any]:
    """What decides which samples the Trainer's step N trains on, given that a resume skips
    `global_step x gradient_accumulation_steps` batches of the epoch: a change in any of them
    resumes on another data stream (the Trainer itself does not check)."""
    args = trainer.args
    dataset = trainer.train_dataset
    try:
        length = len(dataset) if dataset is not None else None
    except TypeError:  # an IterableDataset without a length
        length = None
    return {"train_batch_size": None if args.auto_find_batch_size
            else int(args.train_batch_size),
            "gradient_accumulation_steps": int(args.gradient_accumulation_steps),
            "world_size": int(args.world_size), "dataset_length": length,
            "train_sampling_strategy": _value(getattr(args, "train_sampling_strategy", None)),
            "dataloader_drop_last": bool(args.dataloader_drop_last),
            "data_seed": int(args.data_seed if args.data_seed is not None else args.seed)}


def _check_data_stream(url: str, saved: Any, live: dict[str, Any]) -> None:
    """Refuse a resume whose data stream differs from the saved one, naming each change."""
    if not isinstance(saved, dict):
        return  # saved before the data stream was recorded
    changed = [f"{_DATA_STREAM_WORDS[key]} {saved.get(key)!r} -> {live[key]!r}"
               for key in _DATA_STREAM_WORDS
               if saved.get(key) is not None and live[key] is not None
               and saved.get(key) != live[key]]
    if changed:
        raise CheckpointMismatchError(
            f"{url}: this run's training data is not the one the checkpoint was trained on "
            f"({', '.join(changed)}), so the Trainer's skip of the trained batches would land "
            "elsewhere and resume on another data stream; resume with the TrainingArguments "
            "and dataset the checkpoint was saved with, or start a new run from its weights "
            "with trainer.statereg.load(url, profile='finetune') before train()")


class _TrainerStateRecord:
    """The `trainer_state` component: the TrainerState, saved whole as json, with the data
    stream it trained on (_data_stream); a load keeps it for the Trainer, which reads it from
    trainer_state.json in the resume directory."""

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        state = dataclasses.asdict(self._trainer.state)
        # Which process this is: not training state, it differs by rank (the one copy saved
        # is refused then), and the Trainer sets it again on resume (init_training_references).
        for per_process in PER_PROCESS_FIELDS:
            state.pop(per_process, None)
        return {**state, DATA_STREAM_KEY: _data_stream(self._trainer)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = dict(state)


def _unwrapped_optimizer(optimizer: Any) -> Any:
    """accelerate's AcceleratedOptimizer wraps the torch optimizer as `.optimizer`."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if inner is not None and hasattr(inner, "param_groups") else optimizer


class _StateregCallback(TrainerCallback):
    """The hooks a StateregTrainer needs from the Trainer's loop (public callback events)."""

    def __init__(self, trainer: StateregMixin) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: TrainingArguments, state: Any, control: Any,
                       **kwargs: Any) -> None:
        # The optimizer and scheduler exist now: a resume reads theirs here, verified.
        self.trainer._statereg_attach_live()
        resume = self.trainer._statereg_resume
        if resume is not None and resume.best_global_step:
            state.best_model_checkpoint = self.trainer._statereg_url_of(resume.best_global_step)

    def on_step_end(self, args: TrainingArguments, state: Any, control: Any,
                    **kwargs: Any) -> None:
        trainer = self.trainer
        if trainer._statereg_drives and trainer.statereg.should_save(state.global_step):
            control.should_save = True

    def on_evaluate(self, args: TrainingArguments, state: Any, control: Any,
                    metrics: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.trainer._statereg_eval = (state.global_step, dict(metrics or {}))

    def on_log(self, args: TrainingArguments, state: Any, control: Any,
               logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        info, self.trainer._statereg_saved = self.trainer._statereg_saved, None
        if info is not None and logs is not None:
            # Called first, so every reporting callback (wandb, tensorboard...) gets these.
            logs.update({"statereg/step": info.step, "statereg/stall_s": info.stall_s,
                         "statereg/committed_s": info.committed_s,
                         "statereg/bytes": info.bytes})


class StateregMixin:
    """Makes a `Trainer` (sub)class save and resume with statereg; see the module docstring.

    `statereg`: a statereg.yaml path, a dict or a RegistrySpec (storage, save options,
    profiles...), or None to build everything from the TrainingArguments.
    """

    def __init__(self, *args: Any,
                 statereg: SpecSource | None = None,
                 **kwargs: Any) -> None:
        self._statereg_mgr: CheckpointManager | None = None
        self._statereg_resume: _Resume | None = None
        self._statereg_eval: tuple[int, dict[str, Any]] | None = None
        self._statereg_saved: SaveInfo | None = None
        self._statereg_attached: dict[str, Any] = {}
        super().__init__(*args, **kwargs)
        self._statereg_refuse_unsupported()
        trainer: Any = self  # a Trainer, whose attributes this mixin does not declare
        self.statereg_spec = spec_from_training_args(
            trainer.args, statereg,
            scaler=getattr(trainer.accelerator, "scaler", None) is not None)
        self._statereg_drives = _drives_cadence(self.statereg_spec, trainer.args)
        self._statereg_record = _TrainerStateRecord(self)  # type: ignore[arg-type]
        # First, so that on_log's save statistics reach every reporting callback.
        trainer.callback_handler.callbacks.insert(0, _StateregCallback(self))
        if trainer.args.push_to_hub and _value(trainer.args.hub_strategy) != "end":
            logger.warning(
                "push_to_hub with hub_strategy=%s: a StateregTrainer writes statereg "
                "checkpoints and pushes none of them; export one with "
                "trainer.export_hf(out_dir) (statereg.export_hf) and push that, or use "
                "hub_strategy='end'", _value(trainer.args.hub_strategy))

    def _statereg_refuse_unsupported(self) -> None:
        trainer: Any = self
        for flag, what in (("is_deepspeed_enabled", "DeepSpeed"), ("is_fsdp_enabled", "FSDP"),
                           ("is_fsdp_xla_enabled", "FSDP on XLA")):
            if getattr(trainer, flag, False):
                raise StateregError(
                    f"StateregTrainer does not support {what} yet: its model and optimizer "
                    "are saved by their engine's own checkpointing; use the plain Trainer "
                    "for this run (or statereg with a hand-written loop, docs/distributed.md)")

    # -- the manager -----------------------------------------------------------------------

    @property
    def statereg(self) -> CheckpointManager:
        """The run's CheckpointManager (built on first use; collective under
        torch.distributed, like everything a Trainer does on every rank)."""
        if self._statereg_mgr is None:
            trainer: Any = self
            objects: dict[str, Any] = {"model": trainer.model,
                                       "trainer_state": self._statereg_record}
            if "scaler" in self.statereg_spec.components:
                objects["scaler"] = trainer.accelerator.scaler
            self._statereg_mgr = CheckpointManager(self.statereg_spec, **objects)
            self._statereg_mgr.on_saved(self._statereg_note_saved)
            self._statereg_attached = {"model": trainer.model}
        return self._statereg_mgr

    def _statereg_note_saved(self, info: SaveInfo) -> None:
        self._statereg_saved = info  # logged with the Trainer's next log (on_log)

    def _statereg_attach_live(self) -> None:
        """Give the manager the Trainer's current model, optimizer and scheduler (it
        replaces them: a model_init run builds new ones in train())."""
        trainer: Any = self
        live = {"model": trainer.model, "optimizer": _unwrapped_optimizer(trainer.optimizer),
                "scheduler": trainer.lr_scheduler}
        wrapped = getattr(trainer, "model_wrapped", None)
        if isinstance(wrapped, DistributedDataParallel) and "ddp" not in self._statereg_attached:
            live["ddp"] = DDPBucketLayout(wrapped)
        mgr = self.statereg
        changed = {name: obj for name, obj in live.items()
                   if obj is not None and name in self.statereg_spec.components
                   and self._statereg_attached.get(name) is not obj}
        if changed:
            mgr.attach(**changed)
            self._statereg_attached.update(changed)

    def _statereg_url_of(self, step: int) -> str | None:
        """The URL of the committed checkpoint of `step`, if there is one."""
        self.statereg.wait()
        storage = self.statereg_spec.storage
        return next((info.path for info in list_checkpoints(storage.url, **storage.options)
                     if info.step == step), None)

    # -- train() and resume ------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs: Any) -> Any:
        """Trainer.train; `resume_from_checkpoint=True` resumes from the latest committed
        statereg checkpoint, a statereg URL (or checkpoint name) from that one, and a
        Hugging Face checkpoint-N directory as the Trainer would."""
        directory = None
        if resume_from_checkpoint not in (None, False) and \
                not _is_hf_checkpoint(resume_from_checkpoint):
            url = self._statereg_resolve(resume_from_checkpoint)
            directory = tempfile.mkdtemp(prefix="statereg-resume-")
            self._statereg_resume = _Resume(url, directory)
            resume_from_checkpoint = directory
        try:
            result = super().train(  # type: ignore[misc]
                resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
        except BaseException as exc:
            self._statereg_wait_after(exc)
            raise
        finally:
            self._statereg_resume = None
            if directory is not None:
                shutil.rmtree(directory, ignore_errors=True)
        if self._statereg_mgr is not None:
            self._statereg_mgr.wait()  # the last save is committed when train() returns
        return result

    def _statereg_wait_after(self, exc: BaseException) -> None:
        """train() raised: commit the save in flight (a resume finds it), logging, not
        raising, its failure over the exception that ended training."""
        if self._statereg_mgr is None:
            return
        try:
            self._statereg_mgr.wait()
        except Exception:
            logger.exception("the last checkpoint's save failed as train() ended with %s",
                             type(exc).__name__)

    def _statereg_resolve(self, resume: str | bool) -> str:
        """The statereg checkpoint to resume from (collective: rank 0 reads, all agree)."""
        trainer: Any = self
        if trainer.args.save_only_model:
            raise SpecError(
                "resume_from_checkpoint with save_only_model=True: those checkpoints hold the "
                "model only, so training cannot resume from them; start a new run from the "
                "weights with trainer.statereg.load(url, profile='finetune') before train(), "
                "or set save_only_model=False")
        mgr = self.statereg
        if resume is True:
            info = mgr.peek()
            if info is None:
                raise CheckpointNotFoundError(
                    f"resume_from_checkpoint=True: no committed checkpoint under "
                    f"{self.statereg_spec.storage.url}; train without resume_from_checkpoint "
                    "to start, or pass the URL of a checkpoint")
            return info.path
        if isinstance(resume, bool):  # False: the caller resumes nothing
            raise SpecError("resume_from_checkpoint=False names no checkpoint to resume from")
        info = mgr.peek(os.fspath(resume))
        if info is None:
            raise CheckpointNotFoundError(f"resume_from_checkpoint={resume!r}: not found")
        return info.path

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        resume = self._statereg_resume
        if resume is None or resume_from_checkpoint != resume.directory:
            return super()._load_from_checkpoint(  # type: ignore[misc]
                resume_from_checkpoint, model)
        trainer: Any = self
        mgr = self.statereg
        target = model if model is not None else trainer.model
        if self._statereg_attached.get("model") is not target:
            mgr.attach(model=target)
            self._statereg_attached["model"] = target
        self._statereg_record.loaded = None
        # The load applies the saved generators at once; the Trainer applies them later
        # (_load_rng_state, after its data skip): keep them, and the live ones meanwhile.
        live_rng = _RNG.capture()
        result = mgr.load(resume.url)
        assert result is not None
        resume.rng = _RNG.capture() if "rng" in result.components else None
        _RNG.restore(live_rng)
        state = self._statereg_record.loaded
        if state is None:
            raise SpecError(
                f"{resume.url} holds no trainer_state component, so it was not saved by a "
                "StateregTrainer and the Trainer cannot know where to resume; to start a "
                "new run from its weights call trainer.statereg.load(url, profile='finetune') "
                "(or include=['model']) before train()")
        _check_data_stream(result.path, state.pop(DATA_STREAM_KEY, None), _data_stream(trainer))
        resume.best_global_step = state.get("best_global_step")
        # The URL of the best checkpoint is set again in on_train_begin: the Trainer drops a
        # best_model_checkpoint that is no local directory (an s3:// URL) with a warning.
        state = {**state, "best_model_checkpoint": None}
        Path(resume.directory, TRAINER_STATE_NAME).write_text(json.dumps(state))
        if trainer.is_world_process_zero():
            logger.info("resuming from %s (step %d)", result.path, result.step)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        resume = self._statereg_resume
        if resume is None or checkpoint != resume.directory:
            return super()._load_rng_state(checkpoint)  # type: ignore[misc]
        if resume.rng is not None:
            _RNG.restore(resume.rng)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        trainer: Any = self
        if trial is not None or trainer.hp_search_backend is not None:
            return super()._save_checkpoint(model, trial)  # type: ignore[misc]
        mgr = self.statereg
        self._statereg_attach_live()
        trainer.store_flos()
        state = trainer.state
        # As Trainer._save_checkpoint: callbacks' and the control's state into the TrainerState.
        from transformers.trainer_callback import ExportableState

        for cb in [*trainer.callback_handler.callbacks, trainer.control]:
            if isinstance(cb, ExportableState):
                cb_name = cb.__class__.__name__
                if isinstance(state.stateful_callbacks.get(cb_name), list):
                    state.stateful_callbacks[cb_name].append(cb.state())
                else:
                    state.stateful_callbacks[cb_name] = cb.state()
        extra: dict[str, Any] = {}
        if self._statereg_eval is not None and self._statereg_eval[0] == state.global_step:
            extra = {k: float(v) for k, v in self._statereg_eval[1].items()
                     if isinstance(v, (int, float)) and not isinstance(v, bool)}
        tokens = state.num_input_tokens_seen or None
        handle = mgr.save(state.global_step, tokens_seen=tokens, extra=extra or None)
        if (handle.due and state.best_global_step == state.global_step
                and _value(trainer.args.save_strategy) in ("steps", "epoch", "best")):
            state.best_model_checkpoint = str(handle)

    def _load_best_model(self) -> None:
        trainer: Any = self
        self.statereg.wait()  # the last save may be the best, and is committed first
        result = self.statereg.load_best(include=["model"])
        if result is not None and trainer.is_world_process_zero():
            logger.info("loaded the best model (%s = %s) from %s",
                        self.statereg_spec.save.keep_best.metric  # type: ignore[union-attr]
                        if self.statereg_spec.save.keep_best else "?",
                        result.extra.get(self.statereg_spec.save.keep_best.metric)
                        if self.statereg_spec.save.keep_best else None, result.path)

    # -- export --------------------------------------------------------------------------

    def export_hf(self, out_dir: str | os.PathLike[str], url: str | None = None, *,
                  dtype: str | None = None) -> Export:
        """Write a checkpoint's model (default: the best by keep_best, else the latest) as a
        Hugging Face directory with the model's config.json: loadable with
        `from_pretrained(out_dir)`, pushable to the Hub, without the Trainer's push."""
        mgr = self.statereg
        if url is None:
            chosen = mgr.best() if self.statereg_spec.save.keep_best else []
            url = chosen[0] if chosen else mgr.latest()
            if url is None:
                raise CheckpointNotFoundError(
                    f"export_hf: no committed checkpoint under {self.statereg_spec.storage.url}")
        trainer: Any = self
        config = getattr(trainer.model, "config", None)
        with tempfile.TemporaryDirectory(prefix="statereg-config-") as tmp:
            config_path = None
            if config is not None:
                config.to_json_file(os.path.join(tmp, "config.json"))
                config_path = os.path.join(tmp, "config.json")
            return export_hf(url, out_dir, dtype=dtype, config=config_path,
                             options=self.statereg_spec.storage.options)


def _is_hf_checkpoint(resume: str | bool) -> bool:
    """A Hugging Face checkpoint-N directory (trainer_state.json, no statereg manifest)."""
    if not isinstance(resume, (str, os.PathLike)):
        return False
    path = Path(resume)
    return (path / TRAINER_STATE_NAME).is_file() and not (path / "manifest.json").exists()


class StateregTrainer(StateregMixin, Trainer):
    """`transformers.Trainer` that saves and resumes with statereg (module docstring)."""


_DERIVED: dict[type, type] = {Trainer: StateregTrainer}
process_wide(__name__, "_DERIVED", "one derived class per Trainer class: isinstance and pickling "
             "see one class", kept=True)


def with_statereg(trainer_cls: type[Trainer]) -> type[Trainer]:
    """`trainer_cls` (a Trainer subclass: Seq2SeqTrainer, trl's SFTTrainer...) with
    statereg's saving and resuming: `with_statereg(SFTTrainer)(..., statereg=...)`."""
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, Trainer)):
        raise SpecError(f"with_statereg({trainer_cls!r}): pass a transformers.Trainer subclass")
    if issubclass(trainer_cls, StateregMixin):
        return trainer_cls
    if trainer_cls not in _DERIVED:
        _DERIVED[trainer_cls] = type(f"Statereg{trainer_cls.__name__}",
                                     (StateregMixin, trainer_cls),
                                     {"__module__": trainer_cls.__module__,
                                      "__doc__": f"{trainer_cls.__name__} with statereg "
                                      "checkpoints (statereg.integrations.transformers)."})
    return _DERIVED[trainer_cls]


__all__ = ["SUPPORTED_TRANSFORMERS", "TESTED_TRANSFORMERS", "StateregMixin",
           "StateregTrainer", "spec_from_training_args", "with_statereg"]
