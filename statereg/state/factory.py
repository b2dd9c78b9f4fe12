"""Match live objects to declared components and build one adapter per component."""

from __future__ import annotations

from typing import Any

import torch

from statereg.errors import CheckpointMismatchError, SpecError
from statereg.schemas.spec import RegistrySpec
from statereg.state.ddp import DDPBucketLayout
from statereg.state.loader_workers import carry_worker_generators
from statereg.state.model import ModelAdapter
from statereg.state.objects import DataloaderAdapter, ObjectAdapter
from statereg.state.optimizer import OptimizerAdapter, is_zero
from statereg.state.protocols import (
    ObjectState,
    TensorCapture,
    TensorMeta,
    TensorState,
    sharded_keys_of,
)
from statereg.state.rng import RNGAdapter

Adapter = TensorState | ObjectState


class ObjectTensors:
    """A custom object whose state dict holds tensors, stored with format dcp: DCP loads the
    saved values into the structure the object's own state_dict() returns, in place."""

    def __init__(self, objects: ObjectAdapter) -> None:
        self.name = objects.name
        self._objects = objects

    def capture(self) -> TensorCapture:
        return TensorCapture(self._objects.capture())

    def sharded_keys(self) -> list[str]:
        return sharded_keys_of(self._objects.capture())

    def unsaved_buffers(self) -> list[str]:
        return []  # the object's whole state dict is saved

    def load_targets(self, stored: dict[str, TensorMeta], meta: dict[str, Any], strict: bool,
                     sidecar: dict[str, Any] | None) -> dict[str, Any]:
        """The object's own state dict, after checking that each of its tensors has the
        saved shape and dtype (DCP would stop half way through with a raw ValueError)."""
        targets = self._objects.capture()
        problems = []
        for key, value in _tensor_leaves(targets):
            saved = stored.get(key)
            if saved is None or not isinstance(value, torch.Tensor):
                continue
            if tuple(value.shape) != saved.shape or value.dtype != saved.dtype:
                problems.append(f"{key} (checkpoint {list(saved.shape)} {saved.dtype}, object "
                                f"{list(value.shape)} {value.dtype})")
        if problems:
            raise CheckpointMismatchError(
                f"component {self.name!r} (format dcp) does not fit the checkpoint: tensors "
                f"differ in shape or dtype: {', '.join(problems[:10])}; build the object as "
                "it was saved, or exclude the component from this load"
            )
        return targets

    def key_differences(self, stored: dict[str, TensorMeta], meta: dict[str, Any],
                        ) -> tuple[list[str], list[str]]:
        return [], []  # DCP fills the object's own structure; it reports what it lacks

    def apply(self, targets: dict[str, Any], meta: dict[str, Any],
              sidecar: dict[str, Any] | None) -> None:
        self._objects.restore(targets)


def _tensor_leaves(state: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted name, tensor) of every tensor in nested dicts and lists, named as DCP's
    flattening names them (dict keys and list indices joined by dots)."""
    found: list[tuple[str, Any]] = []
    pending: list[tuple[str, Any]] = [(prefix, state)]
    while pending:
        name, value = pending.pop()
        if isinstance(value, dict):
            pending.extend((f"{name}.{k}" if name else str(k), v) for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            pending.extend((f"{name}.{i}" if name else str(i), v) for i, v in enumerate(value))
        elif isinstance(value, torch.Tensor):
            found.append((name, value))
    return found


def check_objects(spec: RegistrySpec, objects: dict[str, Any], *, initial: bool) -> None:
    """Every object must have a declaration; at construction, every required one an object."""
    declared = ", ".join(spec.components)
    for key in objects:
        if key not in spec.components:
            raise SpecError(
                f"object given as {key}=... has no declaration; declared components: {declared}. "
                f"Add '{key}' under 'components:' or rename the keyword"
            )
        if spec.components[key].kind == "rng":
            raise SpecError(
                f"component {key!r} is kind 'rng', which takes no object: it captures the "
                "process's own generators; remove the keyword"
            )
    if initial:
        missing = [
            name for name, comp in spec.components.items()
            if comp.required and comp.kind != "rng" and name not in objects
        ]
        if missing:
            raise SpecError(
                f"declared components without an object: {', '.join(missing)}; pass them to "
                "CheckpointManager(...) or declare them 'required: false' and attach later"
            )


def build_adapters(spec: RegistrySpec, objects: dict[str, Any]) -> dict[str, Adapter]:
    """Adapters for the components that have an object now (rng always has one)."""
    adapters: dict[str, Adapter] = {}
    for name, comp in spec.components.items():
        if comp.kind == "model" and name in objects:
            made = ModelAdapter(name, objects[name], comp.prefix, comp.trainable_only)
            made.carry_layout = comp.ddp_layout
            adapters[name] = made
    for name, comp in spec.components.items():
        if comp.kind == "rng":
            adapters[name] = RNGAdapter(name)
        elif name not in objects or comp.kind == "model":
            continue
        elif comp.kind == "optimizer":
            model_name = spec.model_for(name)
            model = adapters.get(model_name)
            if not isinstance(model, ModelAdapter):
                raise SpecError(
                    f"component {name!r} (optimizer) needs the object of model component "
                    f"{model_name!r} to name its parameters; pass {model_name}=..."
                )
            optimizer = objects[name]
            if is_zero(optimizer):
                if comp.resolved_sharing != "per_rank":
                    raise SpecError(
                        f"component {name!r} is a ZeroRedundancyOptimizer: each rank holds the "
                        "optimizer state of its own partition of the parameters, so one "
                        f"{comp.resolved_sharing} copy cannot hold it; declare the component "
                        "sharing: per_rank (each rank saves and loads its own partition, at "
                        "the same world size)"
                    )
                adapters[name] = OptimizerAdapter(name, optimizer.optim, model,
                                                  exposed=optimizer)
            else:
                adapters[name] = OptimizerAdapter(name, optimizer, model)
        elif comp.kind == "dataloader":
            adapters[name] = DataloaderAdapter(name, comp.kind, objects[name])
            carry_worker_generators(objects[name], name)
        elif comp.resolved_format == "dcp":
            adapters[name] = ObjectTensors(ObjectAdapter(name, comp.kind, objects[name]))
        else:
            adapters[name] = ObjectAdapter(name, comp.kind, objects[name])
    # A declaration that carries DDP's bucket layout itself (a DDPBucketLayout component, as
    # the Lightning and HF Trainer integrations add) turns off the model's own carrying.
    layouts = [obj.ddp for obj in objects.values() if isinstance(obj, DDPBucketLayout)]
    for adapter in adapters.values():
        if isinstance(adapter, ModelAdapter) and layouts:
            adapter.carry_layout = False
    return adapters
