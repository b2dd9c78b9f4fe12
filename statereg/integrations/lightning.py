"""statereg for PyTorch Lightning: one Callback that saves and resumes a fit exactly.

    trainer = Trainer(callbacks=[StateregCheckpoint("statereg.yaml", every_n_train_steps=100)],
                      enable_checkpointing=False)
    trainer.fit(model)          # a new fit() resumes from the newest committed checkpoint

What it saves, as statereg components (a declaration may name any of them to change how it is
stored, e.g. `model: {kind: model, format: safetensors}`): `model` (the LightningModule),
`optimizer` (`optimizer_1`, ...: every optimizer of the module), `scheduler` (`scheduler_1`,
...), `train_dataloader` (`train_dataloader_1`, ...: must be stateful, e.g. torchdata's
StatefulDataLoader), `rng` (Python, NumPy, torch, CUDA generators) and `fit_loop` (Lightning's
loop progress: epoch, global step, batch within the epoch).

Why a Callback and not a CheckpointIO: CheckpointIO receives a finished dict and a path, never
the live objects, so it cannot load tensors in place (format dcp, sharded) nor restore a
dataloader before Lightning iterates it. Lightning's own checkpoints hold no RNG state, so
they do not resume exactly (docs/integrations/lightning.md).

Where it hooks, and why (the order decides exactness):
- `on_fit_start` (after the strategy built optimizers and wrapped the model, before the fit
  loop starts): build the manager and load model, optimizers, schedulers and the fit loop's
  progress, so Lightning's loop restarts mid-epoch as from its own checkpoint.
- `on_train_start` (Lightning built the loader and iterated it from the epoch's start): set
  its sampler's epoch, give it its saved position (statereg's `train_dataloader` component,
  one per rank), iterate it again, and only then restore the RNG, so the draws that making
  an iterator takes (DataLoader's base seed) do not shift the training stream.
- `on_train_batch_end` (after the optimizer and the step-interval schedulers stepped): save,
  but only after a batch whose optimizer step ran (global_step advanced). With
  `accumulate_grad_batches` >= 2 the other batches end between the micro-batches of an
  accumulation: a checkpoint there would hold the data position and generators past
  micro-batches whose gradients it does not hold, and a resume from it would lose them. So no
  cadence (steps, seconds, auto) saves there, and the first save comes after the first real
  optimizer step (global_step 0 is never saved). Lightning's ModelCheckpoint skips step 0
  the same way, but not a time-based save mid-accumulation.
- `on_validation_start`/`end`: validation is made neutral to the training RNG stream (its
  state is put back when validation ends), so a resumed run, which does not repeat the
  validation of the saved step, draws exactly what an uninterrupted one draws.

Saves are asynchronous unless the declaration says `save.async` (`thread` on CPU, `pinned` on
CUDA): the fit waits only for the copy to host memory; `on_train_end` waits for the last
save, and so does an exception that ends the fit (`on_exception`), before it propagates.

A resume checks that the train dataloader is the one saved (batch size, dataset length,
shuffle, drop_last): another one is refused with a CheckpointMismatchError naming the change
(statereg.state.objects.check_loader_shape), before the loader is touched.

A save after the last batch of an epoch resumes at the next epoch's start: the loader is not
restored (it would be at its end), and its iterator is made again after the RNG is restored,
drawing what an uninterrupted run draws there.

Under DDP, Lightning wraps a shuffling loader's own sampler in a DistributedSamplerWrapper;
that sampler's generator is saved too (at the epoch's start and at the save), since the
loader's state does not reach it.

Lightning documents neither its loops nor its sampler wrapper: every such name this module
uses is in the one block below its imports (PRIVATE_NAMES), checked when it is imported and
by tests/integrations/test_private_contract.py against lightning 2.6.6, the release CI tests
(constraints.txt); docs/integrations/index.md says what happens on another release.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from datetime import timedelta
from os import PathLike
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from statereg import CheckpointManager, LoadResult, RegistrySpec, SpecError, load_spec
from statereg.integrations._common import (
    PrivateName,
    check_private_names,
    declaration_dict,
    default_async,
)

# Beyond the public API (statereg/__init__.py): the core's own DDP layout, loader checks and
# generator capture, so a fit resumes by its rules (docs/integrations/index.md).
from statereg.state.ddp import DDPBucketLayout
from statereg.state.objects import check_loader_shape, resuming_loader
from statereg.state.rng import RNGAdapter

try:  # Lightning is needed only when this module is used: import it here, not in statereg
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - the standalone package
    import pytorch_lightning as pl  # type: ignore[no-redef]

logger = logging.getLogger(__name__)

# -- Lightning's private names: this block is the only code that touches them --------------
# Lightning's loops (`trainer.fit_loop` is a `_FitLoop`) and the dataset wrapper it puts
# around a sampler under DDP are private. Each name is listed once here, checked at import
# (a release without one fails at once, naming it), and read only through the functions
# below; tests/integrations/test_private_contract.py checks every one against the release CI
# pins. Update TESTED_LIGHTNING with constraints.txt.
TESTED_LIGHTNING = "2.6.6"
_PL = pl.__name__  # lightning.pytorch, or pytorch_lightning (the standalone package)
_WRAPPED = ("a fit under DDP whose train loader's sampler draws from a generator of its own "
            "does not save that generator, and does not resume bit-exactly")
FIT_LOOP_DATA_FETCHER = PrivateName(
    f"{_PL}.loops.fit_loop._FitLoop", "_data_fetcher",
    "iterated again once the loader's saved position is given", on_instances=True)
FIT_LOOP_EPOCH_PROGRESS = PrivateName(
    f"{_PL}.loops.fit_loop._FitLoop", "epoch_progress", "the epoch being processed",
    on_instances=True)
PROGRESS_CURRENT = PrivateName(f"{_PL}.loops.progress._Progress", "current",
                               "the epoch being processed", on_instances=True)
TRACKER_PROCESSED = PrivateName(f"{_PL}.loops.progress._ProcessedTracker", "processed",
                                "the epoch being processed", on_instances=True)
FIT_LOOP_EPOCH_LOOP = PrivateName(
    f"{_PL}.loops.fit_loop._FitLoop", "epoch_loop",
    "whether the saved batch was its epoch's last", on_instances=True)
EPOCH_LOOP_BATCH_PROGRESS = PrivateName(
    f"{_PL}.loops.training_epoch_loop._TrainingEpochLoop", "batch_progress",
    "whether the saved batch was its epoch's last", on_instances=True)
BATCH_PROGRESS_IS_LAST = PrivateName(
    f"{_PL}.loops.progress._BatchProgress", "is_last_batch",
    "whether the saved batch was its epoch's last", on_instances=True)
SAMPLER_WRAPPER = PrivateName(
    f"{_PL}.overrides.distributed", "_DatasetSamplerWrapper",
    "recognising the sampler Lightning wrapped under DDP", feature=_WRAPPED)
_WRAPPER_PATH = f"{SAMPLER_WRAPPER.owner}.{SAMPLER_WRAPPER.name}"
WRAPPER_SAMPLER = PrivateName(_WRAPPER_PATH, "_sampler", "the wrapped sampler's generator",
                              on_instances=True, feature=_WRAPPED)
WRAPPER_RESET = PrivateName(_WRAPPER_PATH, "reset", "listing the wrapped sampler again",
                            feature=_WRAPPED)
PRIVATE_NAMES = (FIT_LOOP_DATA_FETCHER, FIT_LOOP_EPOCH_PROGRESS, PROGRESS_CURRENT,
                 TRACKER_PROCESSED, FIT_LOOP_EPOCH_LOOP, EPOCH_LOOP_BATCH_PROGRESS,
                 BATCH_PROGRESS_IS_LAST, SAMPLER_WRAPPER, WRAPPER_SAMPLER, WRAPPER_RESET)
_OFF = check_private_names(__name__, "lightning", pl.__version__, TESTED_LIGHTNING,
                           PRIVATE_NAMES)
_WRAPPER_CLASS: type | None = None if _WRAPPED in _OFF else SAMPLER_WRAPPER.value


def _data_fetcher(trainer: pl.Trainer) -> Any:
    return trainer.fit_loop._data_fetcher


def _epoch_processed(trainer: pl.Trainer) -> int:
    progress: Any = trainer.fit_loop.epoch_progress.current  # processed: not annotated
    return int(progress.processed)


def _ended_an_epoch(trainer: pl.Trainer) -> bool:
    return bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)


def _wrapped_sampler(wrapper: Any) -> Any:
    return wrapper._sampler


def _list_wrapped_again(wrapper: Any) -> None:
    """The wrapper class's own reset (an instance's may be replaced: _epoch_order_from)."""
    WRAPPER_RESET.value(wrapper)

# -- end of Lightning's private names ------------------------------------------------------

# What to do instead of resuming with another train dataloader.
_NEW_FIT = ("start a new fit in another storage.url (statereg resumes the newest checkpoint "
            "of the one it is given)")


def _indexed(base: str, index: int) -> str:
    return base if index == 0 else f"{base}_{index}"


def _set_sampler_epoch(loader: Any, epoch: int) -> None:
    """What Lightning does at each epoch's start (loops/utilities.py): set_epoch on the
    loader's samplers that have it."""
    samplers: tuple[Any, ...] = (getattr(loader, "sampler", None),
                                 getattr(getattr(loader, "batch_sampler", None), "sampler",
                                         None))
    for sampler in samplers:
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)


def _wrapper_of(loader: Any) -> Any:
    """Lightning's `_DatasetSamplerWrapper` inside a DistributedSamplerWrapper, or None."""
    sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    wrapped = getattr(sampler, "dataset", None)
    return wrapped if _WRAPPER_CLASS is not None and isinstance(wrapped, _WRAPPER_CLASS) \
        else None


@contextlib.contextmanager
def _epoch_order_from(loader: Any, generator: torch.Generator | None,
                      state: torch.Tensor | None) -> Iterator[None]:
    """While a restored iterator is made, every listing of the wrapped sampler starts from
    the epoch's saved generator state: making it lists the sampler twice (once for the
    iterator, once to skip to the saved position), an uninterrupted run once."""
    wrapper = _wrapper_of(loader)
    if wrapper is None or generator is None or state is None:
        yield
        return

    def reset() -> None:
        generator.set_state(state)
        _list_wrapped_again(wrapper)

    wrapper.reset = reset
    try:
        yield
    finally:
        del wrapper.reset


def _wrapped_generator(loader: Any) -> torch.Generator | None:
    """The generator of the sampler Lightning wrapped in a DistributedSamplerWrapper.

    Under DDP, Lightning puts a shuffling loader's own sampler (torchdata's RandomSampler,
    which draws from a generator of its own) inside a DistributedSamplerWrapper, which draws
    the epoch's order from it when the epoch's iterator starts; the loader's state does not
    reach it there, so its generator is kept here."""
    wrapper = _wrapper_of(loader)
    generator = None if wrapper is None else getattr(_wrapped_sampler(wrapper), "generator", None)
    return generator if isinstance(generator, torch.Generator) else None


class _TrainLoader:
    """The fit's train dataloader as a dataloader component: the loader's state, and the
    generator of a sampler Lightning wrapped (see _wrapped_generator). A load keeps the state
    until on_train_start, the first hook that sees the loader."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        self.restored: dict[str, Any] | None = None

    def live_loader(self) -> Any:
        """The fit's train dataloader once Lightning built it (on_train_start), else None:
        the dataloader adapter records its shape at a save and checks it at on_train_start."""
        return self.trainer.train_dataloader

    def loader(self) -> Any:
        loader = self.trainer.train_dataloader
        if loader is None:
            raise SpecError("StateregCheckpoint: the fit has no train dataloader to save")
        if not (callable(getattr(loader, "state_dict", None))
                and callable(getattr(loader, "load_state_dict", None))):
            raise SpecError(
                f"StateregCheckpoint: the train dataloader ({type(loader).__name__}) is not "
                "stateful, so a resume cannot continue mid-epoch exactly: build it with "
                "torchdata.stateful_dataloader.StatefulDataLoader (the same arguments as "
                "DataLoader), or give it state_dict() and load_state_dict() (one loader: "
                "combine several into one)"
            )
        return loader

    def check_sized(self) -> None:
        if self.trainer.num_training_batches == float("inf"):
            raise SpecError(
                "StateregCheckpoint: the train dataloader has no length (an IterableDataset "
                "without __len__), so Lightning fetches one batch ahead of the step, and the "
                "loader's state at a save would skip a batch on resume; give the dataset a "
                "__len__ (or limit_train_batches) to resume exactly"
            )

    def generator(self) -> torch.Generator | None:
        return _wrapped_generator(self.loader())

    def state_dict(self) -> dict[str, Any]:
        generator = self.generator()
        return {"loader": self.loader().state_dict(),
                "sampler_generator": None if generator is None else generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.restored = state  # applied by StateregCheckpoint.on_train_start


class _EpochStream:
    """What the current epoch's loader iterator found when it was made (per rank): the
    global generators, and the wrapped sampler's generator.

    Making an iterator draws from them (the DataLoader's base seed; a sampler's order for the
    epoch). A mid-epoch resume makes its iterator from this state, so it draws the same."""

    def __init__(self) -> None:
        self.state: dict[str, Any] | None = None

    def take(self, rng: RNGAdapter, generator: torch.Generator | None) -> None:
        self.state = {"rng": rng.capture(),
                      "sampler_generator": None if generator is None else generator.get_state()}

    def put_back(self, rng: RNGAdapter, generator: torch.Generator | None) -> None:
        state = self.state_dict()
        rng.restore(state["rng"])
        if generator is not None and state["sampler_generator"] is not None:
            generator.set_state(state["sampler_generator"])

    def state_dict(self) -> dict[str, Any]:
        if self.state is None:
            raise SpecError("StateregCheckpoint: a save before the fit's first epoch started")
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


class _FitLoopState:
    """Lightning's fit-loop progress (epoch, step, batch in the epoch) as a custom component,
    without the loop's copy of the loader state (the train_dataloader component holds it)."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        state = dict(self.trainer.fit_loop.state_dict())
        own = state.get("state_dict")
        if isinstance(own, dict):
            state["state_dict"] = {k: v for k, v in own.items() if k != "combined_loader"}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainer.fit_loop.load_state_dict(state)


class StateregCheckpoint(pl.Callback):
    """Save and resume a Lightning fit with statereg, bit for bit.

    `spec`: a statereg.yaml path, a dict or a RegistrySpec; it needs `storage` (and may set
    `save:` and `components:`), the callback declares the trainer's objects itself.
    Cadence, as Lightning's ModelCheckpoint: `every_n_train_steps`, `train_time_interval`
    (a timedelta or seconds), `every_n_epochs` (the default, 1, when nothing else is given);
    `monitor`/`mode`/`save_top_k` keep the best checkpoints by a logged metric (keep_best);
    `save_last` saves when training ends. `objects`: more live objects for components the
    declaration names (e.g. an EMA copy). Each save's statistics go to the trainer's
    loggers as statereg/stall_s, statereg/committed_s and statereg/bytes.
    """

    def __init__(self, spec: str | PathLike[str] | dict[str, Any] | RegistrySpec, *,
                 every_n_train_steps: int | None = None,
                 train_time_interval: timedelta | float | None = None,
                 every_n_epochs: int | None = None, monitor: str | None = None,
                 mode: str = "min", save_top_k: int = 1, save_last: bool = True,
                 objects: dict[str, Any] | None = None) -> None:
        super().__init__()
        self._declared = declaration_dict(spec, "StateregCheckpoint")[0]
        save = self._declared.setdefault("save", {})
        if every_n_train_steps is not None:
            save["every_steps"] = every_n_train_steps
        if train_time_interval is not None:
            save["every_seconds"] = (train_time_interval.total_seconds()
                                     if isinstance(train_time_interval, timedelta)
                                     else float(train_time_interval))
        # Whether should_save() has a cadence to answer by (checked after each batch).
        self._by_step = any(save.get(k) for k in ("every_steps", "every_seconds", "every"))
        self.every_n_epochs = every_n_epochs if every_n_epochs or self._by_step else 1
        if monitor is not None:
            save["keep_best"] = {"metric": monitor, "mode": mode, "count": save_top_k}
        self.monitor = monitor
        self.save_last = save_last
        self._objects = dict(objects or {})
        self.mgr: CheckpointManager | None = None
        self.restored: LoadResult | None = None
        self._saved_step: int | None = None
        # global_step when the last batch began, and whether that batch stepped the optimizer
        # (only then is the fit at an optimizer-step boundary, where a save may come).
        self._step_seen: int | None = None
        self._stepped = False
        self._logged_step: int | None = None
        self._rng = RNGAdapter("rng")
        self._loader: _TrainLoader | None = None
        self._new_epoch = False
        self._epoch = _EpochStream()
        self._epoch_taken: int | None = None  # the epoch whose stream on_train_start took
        self._rng_before_validation: dict[str, Any] | None = None

    # -- building the declaration from the trainer ---------------------------------------

    def _spec(self, trainer: pl.Trainer) -> RegistrySpec:
        data = dict(self._declared)
        data["save"] = dict(data.get("save") or {})
        default_async(data["save"], trainer.strategy.root_device)
        components: dict[str, Any] = dict(data.get("components") or {})
        defaults: dict[str, dict[str, Any]] = {
            "model": {"kind": "model"}, "rng": {"kind": "rng"},
            "fit_loop": {"kind": "custom", "format": "torch"},
            "epoch_rng": {"kind": "custom", "sharing": "per_rank", "format": "json"}}
        if isinstance(trainer.strategy.model, DistributedDataParallel):
            defaults["ddp"] = {"kind": "custom"}
        for i, _ in enumerate(trainer.optimizers):
            defaults[_indexed("optimizer", i)] = {"kind": "optimizer", "model": "model"}
        for i, _ in enumerate(trainer.lr_scheduler_configs):
            defaults[_indexed("scheduler", i)] = {"kind": "scheduler"}
        defaults["train_dataloader"] = {"kind": "dataloader"}
        for name, declared in defaults.items():
            components.setdefault(name, declared)
        data["components"] = components
        return load_spec(data)

    def _trainer_objects(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                         ) -> dict[str, Any]:
        self._loader = _TrainLoader(trainer)
        objects: dict[str, Any] = {"model": pl_module, "train_dataloader": self._loader,
                                   "fit_loop": _FitLoopState(trainer),
                                   "epoch_rng": self._epoch}
        if isinstance(trainer.strategy.model, DistributedDataParallel):
            # A new DDP averages gradients in another bucket order than the run it resumes
            # (docs/exact-resume.md#under-ddp): its layout is state too.
            objects["ddp"] = DDPBucketLayout(trainer.strategy.model)
        for i, optimizer in enumerate(trainer.optimizers):
            objects[_indexed("optimizer", i)] = optimizer
        for i, config in enumerate(trainer.lr_scheduler_configs):
            objects[_indexed("scheduler", i)] = config.scheduler
        return {**objects, **self._objects}

    # -- resuming -------------------------------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        spec = self._spec(trainer)
        self.mgr = CheckpointManager(spec, **self._trainer_objects(trainer, pl_module))
        # Everything but the generators: those are restored once the loader was iterated.
        self.restored = self.mgr.load(exclude=["rng"])
        if self.restored is not None:
            self._saved_step = self.restored.step
            # Saved after the last batch of an epoch, the loader is at that epoch's end, and
            # restoring it would give the next epoch no batch (Lightning does not iterate a
            # restored loader again): the next epoch starts from a fresh iterator instead.
            self._new_epoch = _ended_an_epoch(trainer)
            if trainer.is_global_zero:
                logger.info("resuming the fit from %s (global step %d)", self.restored.path,
                            self.restored.step)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.mgr is not None
        assert self._loader is not None
        self._step_seen, self._stepped = trainer.global_step, False
        self._loader.loader()  # refuse a loader that cannot resume, before the first step
        self._loader.check_sized()
        if self._loader.restored is not None:
            self._loader.restored = check_loader_shape(
                "train_dataloader", self._loader.restored, self._loader.loader(), _NEW_FIT)
        # Lightning built the loader and made its first iterator, from the epoch's start.
        # Every fit makes it again here, so that what it draws follows a known state of the
        # generators: mid-epoch, the state the saved epoch's iterator found (so a sampler
        # that draws its order from them replays it), then the loader's saved position,
        # then the step's generators; otherwise, the current state, kept for this epoch's
        # saves. The sampler's epoch is set first: DistributedSampler shuffles by it.
        fetcher = _data_fetcher(trainer)
        loader = self._loader.loader()
        generator = self._loader.generator()
        epoch = self._epoch_taken = _epoch_processed(trainer)
        if self.restored is None:
            self._epoch.take(self._rng, generator)
        elif self._new_epoch:
            # The loader's state is at the saved epoch's end: run that iterator out (so the
            # loader starts its next epoch, its sampler's generator where the epoch left it)
            # before the generators are restored; the new epoch's iterator is made after.
            saved = self._loader.restored
            assert saved is not None
            loader.load_state_dict(saved["loader"])
            with resuming_loader("train_dataloader", _NEW_FIT):
                for _ in loader:
                    pass
            if generator is not None and saved["sampler_generator"] is not None:
                generator.set_state(saved["sampler_generator"])
            self._load_rng()
            self._epoch.take(self._rng, generator)
        else:
            self._epoch.put_back(self._rng, generator)
        _set_sampler_epoch(loader, epoch)
        if self.restored is None or self._new_epoch:
            iter(fetcher)
            return
        assert self._loader.restored is not None
        loader.load_state_dict(self._loader.restored["loader"])
        with _epoch_order_from(loader, generator, self._epoch.state_dict()["sampler_generator"]), \
                resuming_loader("train_dataloader", _NEW_FIT):
            iter(fetcher)
        self._load_rng()

    def _load_rng(self) -> None:
        assert self.mgr is not None and self.restored is not None
        self.mgr.load(self.restored.path, include=["rng"])

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The epoch's iterator is made after this hook (Lightning's epoch loop), except for
        # the fit's first epoch, whose iterator on_train_start made.
        if _epoch_processed(trainer) != self._epoch_taken:
            assert self._loader is not None
            self._epoch.take(self._rng, self._loader.generator())

    # -- saving ---------------------------------------------------------------------------

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        assert self.mgr is not None
        step = trainer.global_step
        # Every rank steps at the same batches, so a time-based cadence (collective) is
        # asked on every rank alike.
        self._stepped, self._step_seen = step != self._step_seen, step
        if self._may_save(trainer) and self._by_step and self.mgr.should_save(step):
            self._save(trainer)
        self._log_saved(trainer)

    def _may_save(self, trainer: pl.Trainer) -> bool:
        """Whether the fit is at an optimizer-step boundary it has not saved yet: the last
        batch stepped the optimizer (see the module docstring), so no gradients of later
        micro-batches are pending."""
        return self._stepped and trainer.global_step != self._saved_step

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        n = self.every_n_epochs
        if n and (trainer.current_epoch + 1) % n == 0 and self._may_save(trainer):
            self._save(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.mgr is not None
        if self.save_last and self._may_save(trainer):
            self._save(trainer)
        elif self.save_last and not self._stepped and trainer.is_global_zero \
                and trainer.global_step not in (0, self._saved_step):
            logger.warning(
                "the fit ended between the micro-batches of a gradient accumulation (global "
                "step %d): no checkpoint at its end, since a resume from it would lose their "
                "gradients; the newest checkpoint is the last one at an optimizer step",
                trainer.global_step)
        self.mgr.wait()
        self._log_saved(trainer)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        # Lightning calls no teardown hook of callbacks after an exception: commit the save in
        # flight (a resume finds it) and stop the manager's thread here. A failure of that
        # save is logged, not raised over the exception that ended the fit.
        mgr, self.mgr = self.mgr, None
        if mgr is None:
            return
        try:
            mgr.close()
        except Exception:
            logger.exception("the last checkpoint's save failed as the fit ended with %s",
                             type(exception).__name__)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.mgr is not None:
            self.mgr.close()
            self.mgr = None

    def _save(self, trainer: pl.Trainer) -> None:
        assert self.mgr is not None
        extra: dict[str, Any] = {"epoch": trainer.current_epoch}
        if self.monitor is not None:
            value = trainer.callback_metrics.get(self.monitor)
            if value is not None:
                extra[self.monitor] = float(value)
        self.mgr.save(step=trainer.global_step, extra=extra)
        self._saved_step = trainer.global_step

    def _log_saved(self, trainer: pl.Trainer) -> None:
        """Send the last committed save's statistics to the trainer's loggers (rank 0)."""
        assert self.mgr is not None
        info = self.mgr.last_saved
        if info is None or info.step == self._logged_step or not trainer.is_global_zero:
            return
        self._logged_step = info.step
        metrics = {"statereg/stall_s": info.stall_s, "statereg/committed_s": info.committed_s,
                   "statereg/bytes": float(info.bytes)}
        for each in trainer.loggers:
            each.log_metrics(metrics, step=info.step)

    # -- validation leaves the training RNG stream as it found it -------------------------

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._rng_before_validation = self._rng.capture()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._rng_before_validation is not None:
            with torch.no_grad():
                self._rng.restore(self._rng_before_validation)
            self._rng_before_validation = None
