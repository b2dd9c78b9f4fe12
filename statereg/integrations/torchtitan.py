"""A TorchTitan-style checkpointer backed by statereg, for FSDP2 / pipeline training loops.

TorchTitan's `CheckpointManager` (torchtitan/components/checkpoint.py) is driven by its
`[checkpoint]` config section and three calls in the loop: `load(step)` before training,
`maybe_wait_for_staging()` before `optimizer.step()`, and `save(step, last_step)` after each
step. `TitanCheckpointManager` takes the same objects (`model_parts`, an optimizer container,
lr schedulers, a stateful dataloader, extra `states` such as the train state) and the same
config keys, and compiles them into a statereg declaration, so the loop keeps its shape and
gains statereg's manifest-last commits, checksums, any fsspec storage and exact resume
(the process's RNG is a component, which TorchTitan leaves out: dropout resumes exactly).

It needs no torchtitan: torchtitan imports triton and does not import on every machine.
torchtitan's own `JobConfig.checkpoint` works as `checkpoint_config` where it does import
(the keys are read by name). docs/integrations/torchtitan.md maps every config key.

Saves are asynchronous unless `async_mode` (or the `spec`'s `save.async`) says otherwise:
left out, `async_mode` means statereg's integration default, `thread` on CPU and `pinned` on
CUDA (without early_return: `save()` returns once the state is in host memory). `close()`
waits for the last save.

`save()` commits only at an optimizer-step boundary: if gradients were accumulated since the
optimizer last stepped (a loop that calls it between micro-batches), it saves nothing that
call, since the checkpoint would hold the data position past micro-batches whose gradients
it does not hold (torchtitan's own loop calls it after the step, where this never applies).

It touches no private name of torchtitan (it reads the `[checkpoint]` keys and an
OptimizersContainer's `optimizers` list, both public) and uses statereg's public API, except
`unwrap_module`, the rule by which the core names a wrapped model's keys.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

import statereg
from statereg import CheckpointManager as _Manager
from statereg import (
    CheckpointMismatchError,
    CheckpointNotFoundError,
    RegistrySpec,
    SpecError,
)
from statereg.integrations._common import GradientsInFlight, declaration_dict, default_async
from statereg.state.model import unwrap_module  # beyond the public API: see the docstring

logger = logging.getLogger(__name__)

# TorchTitan's names for its states (torchtitan/components/checkpoint.py), kept as the
# component names so `exclude_from_loading` takes the same values.
MODEL = "model"
OPTIMIZER = "optimizer"
LR_SCHEDULER = "lr_scheduler"
DATALOADER = "dataloader"
TRAIN_STATE = "train_state"
RNG = "rng"
RESERVED = (MODEL, OPTIMIZER, LR_SCHEDULER, DATALOADER, RNG)

# torchtitan's async_mode -> statereg's save.async (and early_return for the pinned mode,
# whose staging TorchTitan also finishes in maybe_wait_for_staging()).
ASYNC_MODES: dict[str, tuple[str, bool]] = {
    "disabled": ("off", False),
    "async": ("thread", False),
    "async_with_pinned_mem": ("pinned", True),
}
# torchtitan's export_dtype -> statereg.export_hf's dtype.
EXPORT_DTYPES: dict[str, str | None] = {"float32": None, "bfloat16": "bf16", "float16": "fp16"}


@dataclasses.dataclass
class TitanCheckpointConfig:
    """TorchTitan's `[checkpoint]` section (torchtitan.config.Checkpoint), field for field.

    Defaults are torchtitan's, except `enable` (True: constructing the manager is asking for
    checkpoints) and `async_mode` (None: statereg's integration default, an asynchronous
    save; torchtitan's "disabled" still turns it off). docs/integrations/torchtitan.md says
    what each key does here.
    """

    enable: bool = True
    folder: str = "checkpoint"
    interval: int = 500
    initial_load_path: str | None = None
    initial_load_model_only: bool = True
    initial_load_in_hf: bool = False
    initial_load_in_hf_quantized: bool = False
    last_save_model_only: bool = True
    last_save_in_hf: bool = False
    export_dtype: Literal["float16", "bfloat16", "float32"] = "float32"
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] | None = None
    keep_latest_k: int = 10
    load_step: int = -1
    exclude_from_loading: list[str] = dataclasses.field(default_factory=list)
    enable_first_step_checkpoint: bool = False
    create_seed_checkpoint: bool = False
    load_only: bool = False
    enable_ft_dataloader_checkpoints: bool = True

    @classmethod
    def of(cls, config: Any = None, **overrides: Any) -> TitanCheckpointConfig:
        """The config from this class, a dict, or torchtitan's `Checkpoint` (read by field
        name, so torchtitan need not import); `overrides` win. An unknown dict key or
        override is a SpecError naming the allowed keys."""
        names = [f.name for f in dataclasses.fields(cls)]
        if config is None:
            values: dict[str, Any] = {}
        elif isinstance(config, Mapping):
            values = dict(config)
        else:
            values = {n: getattr(config, n) for n in names if hasattr(config, n)}
        values.update(overrides)
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise SpecError(f"checkpoint config: unknown key(s) {', '.join(unknown)}; torchtitan's "
                            f"[checkpoint] keys are: {', '.join(names)}")
        made = cls(**values)
        made._check()
        return made

    def _check(self) -> None:
        if self.async_mode is not None and self.async_mode not in ASYNC_MODES:
            raise SpecError(f"checkpoint.async_mode {self.async_mode!r}: use one of "
                            f"{', '.join(ASYNC_MODES)}")
        if self.export_dtype not in EXPORT_DTYPES:
            raise SpecError(f"checkpoint.export_dtype {self.export_dtype!r}: use one of "
                            f"{', '.join(EXPORT_DTYPES)}")
        if self.interval < 1:
            raise SpecError(f"checkpoint.interval {self.interval}: must be at least 1 step")
        if self.keep_latest_k < 0:
            raise SpecError(f"checkpoint.keep_latest_k {self.keep_latest_k}: use 0 (keep all) "
                            "or a positive count")
        if self.initial_load_in_hf and not self.initial_load_model_only:
            raise SpecError("checkpoint.initial_load_in_hf needs initial_load_model_only: true: "
                            "a Hugging Face directory holds model weights only")
        if self.initial_load_in_hf_quantized:
            raise SpecError("checkpoint.initial_load_in_hf_quantized is not supported: statereg "
                            "reads safetensors as they are and does not dequantize; load a "
                            "dequantized export")
        if self.last_save_in_hf and not self.last_save_model_only:
            raise SpecError("checkpoint.last_save_in_hf needs last_save_model_only: true: a "
                            "Hugging Face directory holds model weights only")
        if self.export_dtype != "float32" and not self.last_save_in_hf:
            raise SpecError(
                f"checkpoint.export_dtype {self.export_dtype!r} applies to the Hugging Face "
                "export of the last save (last_save_in_hf: true); statereg checkpoints keep the "
                "training dtype, so every one of them resumes exactly. Set last_save_in_hf: "
                "true, or export_dtype: float32")


class ModelParts(nn.Module):
    """Several model parts (virtual pipeline stages on one rank) seen as one model whose keys
    are the parts' own, unprefixed, as TorchTitan's ModelWrapper flattens them.

    Parts must not share a key. Only what statereg reads is provided: state_dict(),
    named_parameters() and named_buffers(); the parts stay the modules the loop runs.
    """

    parts: tuple[nn.Module, ...]

    def __init__(self, parts: Sequence[nn.Module]) -> None:
        super().__init__()
        # Not registered as submodules: their keys must not get a "0." prefix.
        self.__dict__["parts"] = tuple(unwrap_module(p) for p in parts)
        seen: dict[str, int] = {}
        for i, part in enumerate(self.parts):
            for key in part.state_dict():
                if key in seen:
                    raise SpecError(f"model_parts {seen[key]} and {i} both hold {key!r}; parts "
                                    "must hold disjoint keys (the full model's names, as "
                                    "pipeline splitting gives them)")
                seen[key] = i

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        merged: dict[str, Any] = {}
        for part in self.parts:
            merged.update(part.state_dict())
        return merged

    def named_parameters(self, prefix: str = "", recurse: bool = True,  # type: ignore[override]
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        for part in self.parts:
            yield from part.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True,  # type: ignore[override]
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        for part in self.parts:
            yield from part.named_buffers(prefix, recurse, remove_duplicate)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("ModelParts is a checkpointing view; run the parts themselves")


class OptimizersView(torch.optim.Optimizer):
    """Several torch optimizers (one per model part, as in TorchTitan's OptimizersContainer)
    seen as one: their param groups in order and their state merged; a load splits the state
    back to each. Never stepped: the loop steps its own optimizers."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        # Optimizer.__init__ would build new param groups; this view keeps the real ones.
        self.optimizers = list(optimizers)
        for opt in self.optimizers:
            if not isinstance(opt, torch.optim.Optimizer):
                raise SpecError(f"optimizers: got a {type(opt).__name__} in the list; pass "
                                "torch.optim.Optimizer objects")

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [group for opt in self.optimizers for group in opt.param_groups]

    @property
    def state(self) -> dict[Any, Any]:  # type: ignore[override]
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Each optimizer gets its own groups and the state of its parameters, re-indexed
        from the view's order (all groups of all optimizers, in order) to its own."""
        state, groups = state_dict["state"], state_dict["param_groups"]
        first_param = first_group = 0
        for opt in self.optimizers:
            count = sum(len(g["params"]) for g in opt.param_groups)
            mine = groups[first_group:first_group + len(opt.param_groups)]
            opt.load_state_dict({
                "state": {i - first_param: s for i, s in state.items()
                          if first_param <= i < first_param + count},
                "param_groups": [{**g, "params": [i - first_param for i in g["params"]]}
                                 for g in mine],
            })
            first_param += count
            first_group += len(opt.param_groups)

    def step(self, closure: Any = None) -> Any:
        raise TypeError("OptimizersView is a checkpointing view; step the optimizers")


class _Schedulers:
    """A list of lr schedulers as one stateful object (each keeps its own state)."""

    def __init__(self, schedulers: Sequence[Any]) -> None:
        self.schedulers = list(schedulers)

    def state_dict(self) -> dict[str, Any]:
        return {"schedulers": [s.state_dict() for s in self.schedulers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["schedulers"]
        if len(saved) != len(self.schedulers):
            raise CheckpointMismatchError(
                f"component {LR_SCHEDULER!r}: the checkpoint holds {len(saved)} lr schedulers, "
                f"this run has {len(self.schedulers)}; build one per model part as when saved")
        for scheduler, one in zip(self.schedulers, saved, strict=True):
            scheduler.load_state_dict(one)


def _stateful(name: str, obj: Any, fix: str) -> None:
    for method in ("state_dict", "load_state_dict"):
        if not callable(getattr(obj, method, None)):
            raise SpecError(f"{name}: a {type(obj).__name__} has no {method}(), so its position "
                            f"cannot be saved or restored; {fix}")


def _model_object(model_parts: nn.Module | Sequence[nn.Module]) -> nn.Module:
    parts = [model_parts] if isinstance(model_parts, nn.Module) else list(model_parts)
    if not parts or not all(isinstance(p, nn.Module) for p in parts):
        raise SpecError("model_parts: pass an nn.Module or a non-empty list of them")
    return parts[0] if len(parts) == 1 else ModelParts(parts)


def _optimizer_object(optimizers: Any) -> tuple[Any, str]:
    """The object for the optimizer component and its kind: a torch optimizer (or a view of
    several) is kind optimizer, keyed by parameter name; anything else stateful is a custom
    DCP component loaded into the structure its own state_dict() returns."""
    inner = getattr(optimizers, "optimizers", None)  # torchtitan's OptimizersContainer
    if isinstance(optimizers, (list, tuple)):
        inner = optimizers
    if isinstance(inner, (list, tuple)) and inner and all(
            isinstance(o, torch.optim.Optimizer) for o in inner):
        return (inner[0] if len(inner) == 1 else OptimizersView(inner)), "optimizer"
    if isinstance(optimizers, torch.optim.Optimizer):
        return optimizers, "optimizer"
    _stateful(OPTIMIZER, optimizers, "pass torch optimizers, a list of them, or an object "
              "with state_dict() and load_state_dict()")
    return optimizers, "custom"


def _join(base: str, folder: str) -> str:
    if "://" in folder or not base or os.path.isabs(folder):
        return folder
    return f"{base.rstrip('/')}/{folder}" if "://" in base else os.path.join(base, folder)


class TitanCheckpointManager:
    """TorchTitan's CheckpointManager surface on statereg: `load(step) -> bool`,
    `save(curr_step, last_step)`, `maybe_wait_for_staging()`, `close()`.

    `model_parts`: one module or a list (virtual stages on this rank; their keys are the full
    model's). `optimizers`: a torch optimizer, a list (one per part), torchtitan's
    OptimizersContainer, or any object with state_dict()/load_state_dict(). `lr_schedulers`:
    one, a list, or a container. `dataloader`: stateful (torchdata's StatefulDataLoader).
    `states`: more Stateful objects by name, e.g. {"train_state": trainer}. `pp_group`: this
    rank's pipeline-stage process group (the ranks holding the same stages): model, optimizer
    and schedulers are then saved once per stage (sharing per_group). `rng`: save every
    rank's generators (dropout resumes exactly). `spec`: your own statereg declaration
    instead of the one built here (components named model, optimizer, lr_scheduler,
    dataloader, rng and after `states`' keys). Construct on every rank.
    """

    def __init__(self, dataloader: Any, model_parts: nn.Module | Sequence[nn.Module],
                 optimizers: Any, lr_schedulers: Any = None,
                 states: Mapping[str, Any] | None = None, checkpoint_config: Any = None,
                 sd_adapter: Any = None, base_folder: str = "", ft_manager: Any = None, *,
                 spec: RegistrySpec | str | os.PathLike[str] | dict[str, Any] | None = None,
                 storage_options: dict[str, Any] | None = None, pp_group: Any = None,
                 rng: bool = True,
                 on_world_size_change: Literal["error", "reset"] = "error",
                 hf_folder: str | None = None, hf_prefix: dict[str, str] | None = None,
                 ) -> None:
        if sd_adapter is not None:
            raise SpecError("sd_adapter is not supported: statereg maps Hugging Face names by a "
                            "prefix rule only (hf_prefix={'add': 'model.'}); rename keys in the "
                            "model definition, or convert the directory first")
        if ft_manager is not None:
            raise SpecError("ft_manager (torchft) is not supported: statereg has no per-replica "
                            "checkpoints; run without fault-tolerant replicas")
        self.config = TitanCheckpointConfig.of(checkpoint_config)
        self.enable = self.config.enable
        self.model = _model_object(model_parts)
        self.hf_prefix = hf_prefix
        objects: dict[str, Any] = {MODEL: self.model}
        optimizer, optimizer_kind = _optimizer_object(optimizers)
        objects[OPTIMIZER] = optimizer
        if lr_schedulers is not None:
            objects[LR_SCHEDULER] = (_Schedulers(lr_schedulers)
                                     if isinstance(lr_schedulers, (list, tuple))
                                     else lr_schedulers)
            _stateful(LR_SCHEDULER, objects[LR_SCHEDULER], "pass torch lr schedulers")
        if dataloader is not None:
            _stateful(DATALOADER, dataloader, "use torchdata's StatefulDataLoader (a plain "
                      "torch DataLoader restarts its epoch on a resume, so it cannot be exact)")
            objects[DATALOADER] = dataloader
        for name, obj in (states or {}).items():
            if name in RESERVED:
                raise SpecError(f"states: {name!r} is the manager's own component; name it "
                                "otherwise")
            _stateful(f"states[{name!r}]", obj, "give it state_dict() and load_state_dict()")
            objects[name] = obj
        self._kinds = {MODEL: "model", OPTIMIZER: optimizer_kind,
                       **{n: "scheduler" for n in objects if n == LR_SCHEDULER},
                       **{n: "dataloader" for n in objects if n == DATALOADER},
                       **{n: "custom" for n in states or {}}}
        self.url = _join(base_folder, self.config.folder)
        if spec is None:
            built: Any = self._declaration(objects, storage_options, pp_group is not None, rng,
                                           on_world_size_change)
        else:
            built, _ = declaration_dict(spec, "spec")
        save = built.setdefault("save", {})
        default_async(save, next((p.device for p in self.model.parameters()), "cpu"))
        self.spec = statereg.load_spec(built)
        for name in self.config.exclude_from_loading:
            if name not in self.spec.components:
                raise SpecError(f"checkpoint.exclude_from_loading names {name!r}, which is not "
                                f"a component; components: {', '.join(self.spec.components)}")
        groups = {"pp": pp_group} if pp_group is not None else None
        self._objects = objects
        self._groups = groups
        self.mgr = _Manager(self.spec, groups=groups, **objects) if self.enable else None
        self.hf_folder = hf_folder
        self._model_only: _Manager | None = None
        self._staged: Any = None
        torch_optimizers = (optimizer.optimizers if isinstance(optimizer, OptimizersView)
                            else [optimizer] if optimizer_kind == "optimizer" else [])
        self._gradients = (GradientsInFlight(self.model.parameters(), torch_optimizers)
                           if self.enable else None)

    # -- the declaration ----------------------------------------------------------------

    def _declaration(self, objects: dict[str, Any], options: dict[str, Any] | None,
                     pipelined: bool, rng: bool, world_size_change: str) -> dict[str, Any]:
        """The statereg declaration these settings mean (docs/integrations/torchtitan.md)."""
        stage = {"sharing": "per_group", "group": "pp"} if pipelined else {}
        components: dict[str, Any] = {}
        for name in objects:
            kind = self._kinds[name]
            decl: dict[str, Any] = {"kind": kind}
            if name in (MODEL, OPTIMIZER, LR_SCHEDULER):
                decl.update(stage)
            if kind == "custom" and name == OPTIMIZER:
                decl["format"] = "dcp"
            if name == DATALOADER and world_size_change != "error":
                decl["on_world_size_change"] = world_size_change
            if kind == "optimizer":
                decl["model"] = MODEL
            components[name] = decl
        if rng:
            components[RNG] = {"kind": "rng"}
            if world_size_change != "error":
                components[RNG]["on_world_size_change"] = world_size_change
        save: dict[str, Any] = {"every_steps": self.config.interval}
        if self.config.async_mode is not None:  # else default_async (in __init__)
            save["async"], early = ASYNC_MODES[self.config.async_mode]
            if early:
                save["early_return"] = True
        if self.config.keep_latest_k:
            save["keep_last"] = self.config.keep_latest_k
        return {"storage": {"url": self.url, "options": dict(options or {})},
                "components": components, "save": save,
                "profiles": {"model_only": {"include": [MODEL]}}}

    # -- saving -------------------------------------------------------------------------

    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        assert self.mgr is not None
        save = self.spec.save
        if save.every_steps or save.every_seconds or save.every:
            # Asked at every step, as the cadence wants (a time-based one is collective).
            due = self.mgr.should_save(curr_step)
        else:  # a spec of the user's without a cadence: checkpoint.interval decides
            due = curr_step % self.config.interval == 0
        if self.config.load_only:
            return False
        return due or last_step or (curr_step == 1 and self.config.enable_first_step_checkpoint)

    @torch.no_grad()
    def save(self, curr_step: int, last_step: bool = False) -> None:
        """Save if `curr_step` is due (every `interval` steps, step 1 with
        enable_first_step_checkpoint, and the last step). The last step saves the model only
        with last_save_model_only (exported to Hugging Face with last_save_in_hf);
        `save(0, last_step=True)` is the seed checkpoint. Collective: call on every rank."""
        if self.mgr is None:
            return
        if self._gradients is not None and self._gradients.pending:
            # Before the cadence is asked (time-based: collective), as on every rank alike.
            if self.mgr.world.rank == 0:
                logger.info("save(%d) between the micro-batches of a gradient accumulation: "
                            "not saved (the checkpoint would lose their gradients)", curr_step)
            return
        if not self._should_save(curr_step, last_step):
            return
        if last_step and self.config.last_save_model_only:
            self._save_model_only(curr_step)
            return
        self._staged = self.mgr.save(curr_step)

    def _save_model_only(self, step: int) -> None:
        """A checkpoint of the model alone (the seed at step 0, or the end of training), in
        the same root; a later load() loads the model from it and nothing else."""
        assert self.mgr is not None
        self.mgr.wait()
        if self._model_only is None:
            spec = self.spec.model_copy(update={
                "components": {MODEL: self.spec.components[MODEL]},
                "save": self.spec.save.model_copy(update={
                    "async_mode": "off", "early_return": False, "keep_last": None,
                    "keep_every": None, "keep_best": None, "every_steps": None}),
                "profiles": {}})
            self._model_only = _Manager(spec, groups=self._groups, **{MODEL: self.model})
        url = self._model_only.save(step)
        assert url is not None
        logger.info("saved a model-only checkpoint at step %d: %s", step, url)
        if self.config.last_save_in_hf and step > 0:
            self.export_hf(str(url), step)

    def export_hf(self, url: str, step: int) -> str:
        """Write checkpoint `url`'s model as a Hugging Face safetensors directory (rank 0
        writes, every rank waits; export_dtype casts); returns its location."""
        assert self.mgr is not None
        out = self.hf_folder or f"{self.url.rstrip('/')}/hf/step-{step}"
        dtype = EXPORT_DTYPES[self.config.export_dtype]
        options = self.spec.storage.options
        done = self.mgr.world.from_leader(
            lambda: statereg.export_hf(url, out, dtype=dtype, options=options))
        logger.info("exported step %d to Hugging Face safetensors at %s (%s)", step, done.path,
                    self.config.export_dtype)
        return done.path

    def maybe_wait_for_staging(self) -> None:
        """Wait until the last save's copy of the state is done (async_with_pinned_mem returns
        from save() before it): call it before optimizer.step(), as TorchTitan's loop does."""
        if self._staged is not None:
            self._staged.wait_staged()
            self._staged = None

    # -- loading ------------------------------------------------------------------------

    @torch.no_grad()
    def load(self, step: int = -1) -> bool:
        """Resume: the checkpoint at `step` (-1: checkpoint.load_step, whose -1 is the
        latest) from this run's folder; if the folder holds none, the initial load
        (initial_load_path, in Hugging Face format with initial_load_in_hf). Returns whether
        anything was loaded. A model-only checkpoint (seed, last save) loads the model only;
        otherwise every component but exclude_from_loading. Collective: call on every rank,
        before the first iter(dataloader)."""
        if self.mgr is None:
            return False
        step = self.config.load_step if step == -1 else step
        found = self._find(step)
        if found is None:
            return self._initial_load()
        if self.config.initial_load_path and self.mgr.world.rank == 0:
            logger.warning("checkpoint.initial_load_path is set but %s holds checkpoints: "
                           "resuming from them", self.url)
        if set(found.components) == {MODEL}:
            logger.info("%s holds the model only (a seed or last save): loading the model",
                        found.path)
            self.mgr.load(step=found.step, include=[MODEL])
        else:
            self.mgr.load(step=found.step, exclude=list(self.config.exclude_from_loading))
        return True

    def _find(self, step: int) -> Any:
        """The checkpoint load() resumes from (peek: rank 0 reads, every rank receives)."""
        assert self.mgr is not None
        if step == -1:
            return self.mgr.peek()
        try:
            return self.mgr.peek(step=step)
        except CheckpointNotFoundError as exc:  # it names the committed steps
            raise CheckpointNotFoundError(f"checkpoint.load_step={step}: {exc}") from None

    def _initial_load(self) -> bool:
        """Start from initial_load_path: a Hugging Face directory (initial_load_in_hf), a
        statereg checkpoint, or a plain DCP checkpoint (torchtitan's layout, or
        dcp.save({"model": ...})); the model only unless initial_load_model_only is false."""
        assert self.mgr is not None
        path = self.config.initial_load_path
        if not path:
            return False
        options = self.spec.storage.options if _same_scheme(path, self.url) else None
        if self.config.initial_load_in_hf:
            report = statereg.load_model_from(path, self.model, prefix=self.hf_prefix,
                                              options=options)
            logger.info("initial load from Hugging Face %s: %s", path, report)
            return True
        model_only = self.config.initial_load_model_only
        try:
            statereg.read_manifest(path, options)
        except CheckpointNotFoundError:
            if not model_only:
                raise SpecError(f"checkpoint.initial_load_path {path} is a plain DCP checkpoint, "
                                "not a statereg one: it loads with initial_load_model_only: "
                                "true") from None
            self._initial_plain_dcp(path, options)
            return True
        # The run's storage options go to the initial load only on the same kind of store
        # (`options` above), and then explicitly: another bucket is another store.
        if model_only:
            self.mgr.load(path, include=[MODEL], storage_options=options)
        else:
            self.mgr.load(path, exclude=list(self.config.exclude_from_loading),
                          storage_options=options)
        return True

    def _initial_plain_dcp(self, path: str, options: dict[str, Any] | None) -> None:
        """A plain DCP directory: `model.<key>` items (dcp.save({"model": ...})) load through
        the model component, checked before anything changes; TorchTitan's own layout keeps
        the model's keys at the top level beside `optimizer.*` and the rest, so the model's
        keys load from there and every one of them must be present."""
        assert self.mgr is not None
        try:
            self.mgr.load(path, include=[MODEL], storage_options=options)
            return
        except CheckpointMismatchError as exc:
            if "has no tensors under" not in str(exc):
                raise
        report = statereg.load_model_from(path, self.model, strict=False, options=options)
        if report.missing:
            raise CheckpointMismatchError(
                f"checkpoint.initial_load_path {path}: the model's keys {list(report.missing)[:5]}"
                f" ({len(report.missing)} in all) are not in it (it holds "
                f"{len(report.loaded)} of the model's {len(report.loaded) + len(report.missing)}"
                "; those were loaded): is it this model's checkpoint?")
        logger.info("initial load from plain DCP %s: %s", path, report)

    # -- lifetime -----------------------------------------------------------------------

    def close(self) -> None:
        """Wait for the pending save to commit and stop statereg's background threads."""
        if self._gradients is not None:
            self._gradients.remove()
        for mgr in (self.mgr, self._model_only):
            if mgr is not None:
                mgr.close()

    def __enter__(self) -> TitanCheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _same_scheme(a: str, b: str) -> bool:
    def scheme(url: str) -> str:
        head, sep, _ = url.partition("://")
        return head.lower() if sep else ""
    return scheme(a) == scheme(b)


# A drop-in name: `from statereg.integrations.torchtitan import CheckpointManager`.
CheckpointManager = TitanCheckpointManager
