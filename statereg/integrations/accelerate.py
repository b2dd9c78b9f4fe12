"""statereg for Accelerate: `save_state` / `load_state` equivalents that checkpoint
everything the `Accelerator` holds.

    from statereg.integrations.accelerate import load_state, save_state

    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    accelerator.register_for_checkpointing(my_object)
    restored = load_state(accelerator, "statereg.yaml")     # None in a fresh run
    step = restored.step if restored else 0
    ...
        if step % 100 == 0:
            save_state(accelerator, "statereg.yaml", step)

Both take the Accelerator and a statereg declaration (a path, a dict, a RegistrySpec), or a
CheckpointManager from `manager(accelerator, spec)`. Given a declaration, the manager is
built on the first call and kept for the Accelerator (saves stay asynchronous across calls,
retention and the cadence see every save); `wait(accelerator)` waits for the last save, and
it is closed (waiting for that save) by `accelerator.end_training()`, which then destroys
the process group, or at exit. Call `load_state` after `prepare()` and
`register_for_checkpointing()`, and before the first batch, as with Accelerate's own
`load_state`.

Saves are asynchronous unless the declaration says `save.async` (`thread` on CPU, `pinned`
on CUDA): `save_state` returns once the state is copied to host memory.

`save_state` commits only at an optimizer-step boundary: between the micro-batches of a
gradient accumulation (`accelerator.sync_gradients` is False inside `accumulate()`, or
gradients were accumulated since the optimizer last stepped) it saves nothing and returns
None, since a checkpoint there would hold the data position past micro-batches whose
gradients it does not hold. A loop that calls it after every batch therefore saves after the
optimizer step of that batch's accumulation, and never before the first one.

What is saved, as components (names follow Accelerate's file names):

- `model`, `model_1`, ...: each prepared model, unwrapped (keys without DDP's `module.`);
- `optimizer`, `optimizer_1`, ...: each prepared optimizer, keyed by parameter name;
- `scheduler`, `scheduler_1`, ...: each prepared scheduler;
- `dataloader`, `dataloader_1`, ...: each prepared dataloader's position inside its epoch
  and its epoch counter. They must be stateful, in an order a resume can reproduce:
  `Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True,
  use_seedable_sampler=True))` with a torch DataLoader (or, on one process, a torchdata
  StatefulDataLoader); `manager(..., dataloaders=False)` leaves them out, and you skip
  batches yourself (`accelerator.skip_first_batches`);
- `custom_0`, `custom_1`, ...: the objects given to `register_for_checkpointing`;
- `scaler`: the GradScaler (fp16), `accelerator`: its step counter (gradient accumulation);
- `rng`: every rank's random generators.

A yaml may leave `components` out, or refine the ones above (e.g. `custom_0: {format:
torch}`); `storage.url` defaults to `<project_dir>/checkpoints`, and a ProjectConfiguration's
`total_limit` becomes `save.keep_last`.

Why a resume is exact: the dataloader position is restored, not replayed, and the epoch
counter of Accelerate's DataLoaderShard with it (its sampler's order comes from seed + epoch,
and the counter is not in the StatefulDataLoader's state). A loader saved at the end of an
epoch resumes at the start of the next, as the uninterrupted loop does. A loader that is not
the one saved (batch size, dataset length, shuffle, drop_last) is refused with a
CheckpointMismatchError naming the change. The iterator that
continues a resumed epoch is built without drawing from the global generator (the
uninterrupted run drew that seed before the checkpoint), so dropout after the resume draws
what it drew.

Accelerate keeps what `prepare()` made in private lists, and torchdata marks a finished epoch
with a private key: every such name is in the one block below the imports (PRIVATE_NAMES),
checked when this module is imported and by tests/integrations/test_private_contract.py
against the releases CI tests (constraints.txt).
"""

from __future__ import annotations

import atexit
import importlib.metadata
import importlib.util
import logging
import os
import weakref
from typing import Any, Literal

import accelerate
import torch
from accelerate import Accelerator

from statereg import CheckpointManager, LoadResult, RegistrySpec, SpecError, load_spec
from statereg.engine.saver import SaveHandle  # beyond the public API: what save() returns
from statereg.integrations._common import (
    GradientsInFlight,
    PrivateName,
    SpecSource,
    check_private_names,
    declaration_dict,
    default_async,
    merge_components,
    section,
    set_once,
)
from statereg.process_state import process_wide  # beyond the public API: the registry
from statereg.state.objects import DataloaderAdapter  # beyond the public API: the core adapter

logger = logging.getLogger(__name__)

# -- Accelerate's and torchdata's private names: this block is the only code that touches them
# Each is listed once here, checked at import (a release without one fails at once, naming
# it), and read or written only through the functions below;
# tests/integrations/test_private_contract.py checks every one against the release CI pins.
# Update TESTED_ACCELERATE with constraints.txt.
TESTED_ACCELERATE = "1.15.0"
TESTED_TORCHDATA = "0.11.0"
Prepared = Literal["models", "optimizers", "schedulers", "dataloaders", "custom_objects"]
PREPARED: dict[str, PrivateName] = {
    what: PrivateName(Accelerator, f"_{what}", use, on_instances=True)
    for what, use in (("models", "the models prepare() made"),
                      ("optimizers", "the optimizers prepare() made"),
                      ("schedulers", "the schedulers prepare() made"),
                      ("dataloaders", "the dataloaders prepare() made"),
                      ("custom_objects", "the objects given to register_for_checkpointing"))}
SHARD_STATE = PrivateName("accelerate.data_loader.DataLoaderAdapter", "dl_state_dict",
                          "the position state_dict() returns, set on a load",
                          on_instances=True)
SHARD_EPOCH = PrivateName("accelerate.data_loader.DataLoaderShard", "iteration",
                          "the epoch counter its sampler's order comes from",
                          on_instances=True)
PRIVATE_NAMES = (*PREPARED.values(), SHARD_STATE, SHARD_EPOCH)
check_private_names(__name__, "accelerate", accelerate.__version__, TESTED_ACCELERATE,
                    PRIVATE_NAMES)
# torchdata is what makes accelerate's stateful dataloaders; without it there are none.
TORCHDATA_FINISHED = PrivateName("torchdata.stateful_dataloader.stateful_dataloader",
                                 "_ITERATOR_FINISHED",
                                 "the state key saying the epoch's last batch was yielded")
_ITERATOR_FINISHED: str | None = None
if importlib.util.find_spec("torchdata") is not None:
    check_private_names(__name__, "torchdata", importlib.metadata.version("torchdata"),
                        TESTED_TORCHDATA, [TORCHDATA_FINISHED])
    _ITERATOR_FINISHED = TORCHDATA_FINISHED.value


def _prepared(accelerator: Accelerator, what: Prepared) -> list[Any]:
    """What `accelerator.prepare()` (or register_for_checkpointing) holds, in order."""
    return list(getattr(accelerator, PREPARED[what].name))


def _set_shard_state(loader: Any, state: dict[str, Any]) -> None:
    loader.dl_state_dict = state


def _shard_epoch(loader: Any) -> int | None:
    """A DataLoaderShard's (or DataLoaderDispatcher's) epoch counter; None without one."""
    epoch = getattr(loader, "iteration", None)
    return None if epoch is None else int(epoch)


def _set_shard_epoch(loader: Any, epoch: int) -> None:
    loader.iteration = epoch

# -- end of the private names ----------------------------------------------------------------

# One manager per Accelerator when save_state / load_state are given a declaration.
_MANAGERS: weakref.WeakKeyDictionary[Accelerator, tuple[RegistrySpec, CheckpointManager]] = \
    weakref.WeakKeyDictionary()
# Whether gradients wait for an optimizer step, per Accelerator (hooked on first use).
_GRADIENTS: weakref.WeakKeyDictionary[Accelerator, GradientsInFlight] = \
    weakref.WeakKeyDictionary()


def _indexed(base: str, i: int) -> str:
    return base if i == 0 else f"{base}_{i}"


class _LoaderPosition:
    """A prepared dataloader's state: the StatefulDataLoader's position and the
    DataLoaderShard's epoch counter (which sets its sampler's epoch)."""

    def __init__(self, name: str, loader: Any) -> None:
        self.name = name
        self.loader = loader

    def live_loader(self) -> Any:
        """The prepared loader: its shape is recorded and checked by the dataloader adapter."""
        return self.loader

    def state_dict(self) -> dict[str, Any]:
        state = dict(self.loader.state_dict())
        iteration = _shard_epoch(self.loader) or 0
        if _ITERATOR_FINISHED is not None and state.get(_ITERATOR_FINISHED):
            # The epoch's last batch was yielded: the uninterrupted loop goes on with a new
            # epoch, built afresh (drawing its seed from the global generator), so resume so.
            return {"iteration": iteration + 1, "loader": None}
        return {"iteration": iteration, "loader": state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        loader = self.loader
        base = getattr(loader, "base_dataloader", loader)
        adapter = DataloaderAdapter(self.name, "dataloader", base)
        if state["loader"] is not None:
            # statereg's dataloader adapter: refuses a loader already iterated, loads the
            # position, and builds the resumed iterator outside the global generator.
            adapter.restore(state["loader"])
            _set_shard_state(loader, dict(state["loader"]))
        else:
            # A new epoch: its iterator is built afresh at the next iter(), drawing its seed
            # from the (restored) global generator as the uninterrupted loop's does. Not the
            # one the loader made for its first state_dict() (in prepare()): that one was
            # drawn before the load.
            adapter.check_ready()
            base.load_state_dict({})
        if _shard_epoch(loader) is not None:
            _set_shard_epoch(loader, int(state["iteration"]))


class _AcceleratorStep:
    """The Accelerator's own counter (`accelerator.step`, gradient accumulation)."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, int]:
        return {"step": int(self.accelerator.step)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.accelerator.step = int(state["step"])


def _torchdata(obj: Any) -> bool:
    return type(obj).__module__.startswith("torchdata.stateful_dataloader")


def _check_order_restorable(name: str, loader: Any) -> None:
    """Refuse a loader whose shuffle order a resume cannot reproduce. The StatefulDataLoader
    under a DataLoaderShard saves its sampler's position and generator when its batch sampler
    and sampler are torchdata's own (one process: accelerate then shards nothing); otherwise
    it replays the sampler, which gives the saved epoch's order only if that order comes from
    seed + epoch (accelerate's SeedableRandomSampler, a DistributedSampler: `set_epoch`),
    the epoch being the counter saved with the position."""
    batches = getattr(loader, "batch_sampler", None)
    if batches is None:
        return
    inner = getattr(batches, "batch_sampler", batches)  # BatchSamplerShard wraps one
    sampler = getattr(inner, "sampler", None)
    if sampler is None or callable(getattr(sampler, "set_epoch", None)) \
            or isinstance(sampler, torch.utils.data.SequentialSampler):
        return
    if batches is inner and _torchdata(batches) and _torchdata(sampler):
        return
    raise SpecError(
        f"{name}: its {type(sampler).__name__} draws each epoch's order from a generator "
        f"that {type(batches).__name__} does not save, so a resume would continue in "
        "another order; give accelerator.prepare() a torch.utils.data.DataLoader and create "
        "the Accelerator with DataLoaderConfiguration(use_stateful_dataloader=True, "
        "use_seedable_sampler=True): each epoch's order then comes from seed + epoch")


def _parameters(module: Any) -> set[int]:
    return {id(p) for p in module.parameters()}


def live_objects(accelerator: Accelerator, *, dataloaders: bool = True,
                 ) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """The components (declarations) and their objects for everything `accelerator` holds."""
    comps: dict[str, dict[str, Any]] = {}
    objects: dict[str, Any] = {}
    models = [accelerator.unwrap_model(m) for m in _prepared(accelerator, "models")]
    for i, model in enumerate(models):
        comps[_indexed("model", i)] = {"kind": "model"}
        objects[_indexed("model", i)] = model
    owners = [_parameters(m) for m in models]
    for i, wrapped in enumerate(_prepared(accelerator, "optimizers")):
        optimizer = getattr(wrapped, "optimizer", wrapped)
        first = next((id(p) for g in optimizer.param_groups for p in g["params"]), None)
        owner = next((j for j, params in enumerate(owners) if first in params), None)
        if owner is None:
            raise SpecError(
                f"optimizer {i} given to accelerator.prepare() updates no parameter of a "
                "prepared model; prepare the model it optimizes in the same Accelerator")
        comps[_indexed("optimizer", i)] = {"kind": "optimizer", "model": _indexed("model", owner)}
        objects[_indexed("optimizer", i)] = optimizer
    for i, wrapped in enumerate(_prepared(accelerator, "schedulers")):
        comps[_indexed("scheduler", i)] = {"kind": "scheduler"}
        objects[_indexed("scheduler", i)] = getattr(wrapped, "scheduler", wrapped)
    if dataloaders:
        for i, loader in enumerate(_prepared(accelerator, "dataloaders")):
            name = _indexed("dataloader", i)
            if not getattr(loader, "use_stateful_dataloader", False):
                raise SpecError(
                    f"{name}: accelerator.prepare() made a dataloader that cannot say where it "
                    "is inside its epoch, so a resume would restart the epoch; create the "
                    "Accelerator with dataloader_config=DataLoaderConfiguration("
                    "use_stateful_dataloader=True) (torchdata), or build the manager with "
                    "manager(accelerator, spec, dataloaders=False) and skip the trained "
                    "batches yourself with accelerator.skip_first_batches")
            _check_order_restorable(name, loader)
            comps[name] = {"kind": "dataloader"}
            objects[name] = _LoaderPosition(name, loader)
    for i, obj in enumerate(_prepared(accelerator, "custom_objects")):
        comps[f"custom_{i}"] = {"kind": "custom"}
        objects[f"custom_{i}"] = obj
    if accelerator.scaler is not None:
        comps["scaler"] = {"kind": "custom"}
        objects["scaler"] = accelerator.scaler
    comps["accelerator"] = {"kind": "custom"}
    objects["accelerator"] = _AcceleratorStep(accelerator)
    comps["rng"] = {"kind": "rng"}
    return comps, objects


def spec_for(accelerator: Accelerator, source: SpecSource | None = None, *,
             dataloaders: bool = True) -> RegistrySpec:
    """`source` with the components of everything `accelerator` holds (live_objects)."""
    comps, _ = live_objects(accelerator, dataloaders=dataloaders)
    return _spec(accelerator, source, comps)


def _spec(accelerator: Accelerator, source: SpecSource | None,
          comps: dict[str, dict[str, Any]]) -> RegistrySpec:
    data, label = declaration_dict(source, "the Accelerator")
    storage = section(data, "storage", label)
    project = accelerator.project_configuration
    if "url" not in storage:
        if not project.project_dir:
            raise SpecError(f"{label}: no storage.url, and the Accelerator has no project_dir; "
                            "declare storage.url")
        storage["url"] = os.path.join(os.path.abspath(project.project_dir), "checkpoints")
    merge_components(data, comps, label, "the Accelerator")
    default_async(section(data, "save", label), accelerator.device)
    if project.total_limit:
        set_once(section(data, "save", label), "keep_last", int(project.total_limit), label,
                 "ProjectConfiguration.total_limit")
    section(data, "profiles", label).setdefault(
        "finetune", {"include": [n for n, c in comps.items() if c["kind"] == "model"]})
    return load_spec(data)


def manager(accelerator: Accelerator, spec: SpecSource | None = None, *,
            dataloaders: bool = True) -> CheckpointManager:
    """A CheckpointManager for everything `accelerator` holds (close it, or use `with`).
    Collective under torch.distributed: call it on every rank."""
    comps, objects = live_objects(accelerator, dataloaders=dataloaders)
    _gradients(accelerator)
    return CheckpointManager(_spec(accelerator, spec, comps), **objects)


def _resolve(accelerator: Accelerator, mgr_or_spec: CheckpointManager | SpecSource,
             ) -> CheckpointManager:
    _gradients(accelerator)  # hooked at the first call (load_state: before any backward)
    if isinstance(mgr_or_spec, CheckpointManager):
        return mgr_or_spec
    comps, objects = live_objects(accelerator)
    spec = _spec(accelerator, mgr_or_spec, comps)
    cached = _MANAGERS.get(accelerator)
    if cached is not None:
        if cached[0] != spec:
            raise SpecError(
                "save_state/load_state got a declaration that differs from the one this "
                "Accelerator's manager was built with (or objects were prepared since); build "
                "one with manager(accelerator, spec) and pass it instead")
        return cached[1]
    mgr = CheckpointManager(spec, **objects)
    _MANAGERS[accelerator] = (spec, mgr)
    _close_before_end_training(accelerator)
    return mgr


def _close_before_end_training(accelerator: Accelerator) -> None:
    """Make `accelerator.end_training()` close this Accelerator's manager (waiting for the
    save in flight) first: it destroys the process group, which an asynchronous save's
    commit still needs."""
    end_training = accelerator.end_training
    if getattr(end_training, "closes_statereg", False):
        return

    def closing_end_training() -> None:
        close(accelerator)
        end_training()

    closing_end_training.closes_statereg = True  # type: ignore[attr-defined]
    accelerator.end_training = closing_end_training  # type: ignore[method-assign]


def _gradients(accelerator: Accelerator) -> GradientsInFlight:
    gradients = _GRADIENTS.get(accelerator)
    if gradients is None:
        params = [p for model in _prepared(accelerator, "models") for p in model.parameters()]
        optimizers = [getattr(o, "optimizer", o) for o in _prepared(accelerator, "optimizers")]
        gradients = _GRADIENTS[accelerator] = GradientsInFlight(params, optimizers)
    return gradients


def at_step_boundary(accelerator: Accelerator) -> bool:
    """Whether the loop is at an optimizer-step boundary (not between the micro-batches of a
    gradient accumulation): what save_state requires to commit."""
    return bool(accelerator.sync_gradients) and not _gradients(accelerator).pending


def save_state(accelerator: Accelerator, mgr_or_spec: CheckpointManager | SpecSource,
               step: int, *, tokens_seen: int | None = None,
               extra: dict[str, Any] | None = None) -> SaveHandle | None:
    """Save everything `accelerator` holds as checkpoint `step` (on every rank); nothing,
    returning None, between the micro-batches of a gradient accumulation (module docstring).
    """
    mgr = _resolve(accelerator, mgr_or_spec)
    if not at_step_boundary(accelerator):
        if mgr.world.rank == 0:
            logger.info("save_state(step=%d) between the micro-batches of a gradient "
                        "accumulation: not saved (the checkpoint would lose their gradients); "
                        "the next call after the optimizer step saves", step)
        return None
    return mgr.save(step, tokens_seen=tokens_seen, extra=extra)


def load_state(accelerator: Accelerator, mgr_or_spec: CheckpointManager | SpecSource,
               path: str | os.PathLike[str] | None = None, **options: Any,
               ) -> LoadResult | None:
    """Restore the latest committed checkpoint (or `path`) into everything `accelerator`
    holds; None in a fresh run. `options` are CheckpointManager.load's (profile, exclude...).
    """
    return _resolve(accelerator, mgr_or_spec).load(path, **options)


def wait(accelerator: Accelerator) -> None:
    """Wait until the last save_state of `accelerator` is committed."""
    cached = _MANAGERS.get(accelerator)
    if cached is not None:
        cached[1].wait()


def close(accelerator: Accelerator) -> None:
    """Wait for the last save and release the manager save_state/load_state built."""
    cached = _MANAGERS.pop(accelerator, None)
    if cached is not None:
        cached[1].close()


@atexit.register
def _close_all() -> None:
    for accelerator in list(_MANAGERS):
        close(accelerator)


process_wide(__name__, "_MANAGERS", "the manager save_state built for each Accelerator, closed "
             "by close(accelerator), which waits for its save: a forked worker has no such "
             "thread to wait for", kept=True)
process_wide(__name__, "_GRADIENTS", "the gradient hooks of each Accelerator's parameters: "
             "forgotten, they would be hooked twice", kept=True)


__all__ = ["at_step_boundary", "close", "live_objects", "load_state", "manager", "save_state",
           "spec_for", "wait"]
