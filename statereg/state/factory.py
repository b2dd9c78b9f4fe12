"""Match live objects to declared components and build one adapter per component."""

from __future__ import annotations

from typing import Any

from statereg.errors import SpecError
from statereg.schemas.spec import RegistrySpec
from statereg.state.model import ModelAdapter
from statereg.state.objects import DataloaderAdapter, ObjectAdapter
from statereg.state.optimizer import OptimizerAdapter
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
        return self._objects.capture()

    def key_differences(self, stored: dict[str, TensorMeta], meta: dict[str, Any],
                        ) -> tuple[list[str], list[str]]:
        return [], []  # DCP fills the object's own structure; it reports what it lacks

    def apply(self, targets: dict[str, Any], meta: dict[str, Any],
              sidecar: dict[str, Any] | None) -> None:
        self._objects.restore(targets)


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
            adapters[name] = ModelAdapter(name, objects[name], comp.prefix,
                                          comp.trainable_only)
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
            adapters[name] = OptimizerAdapter(name, objects[name], model)
        elif comp.kind == "dataloader":
            adapters[name] = DataloaderAdapter(name, comp.kind, objects[name])
        elif comp.resolved_format == "dcp":
            adapters[name] = ObjectTensors(ObjectAdapter(name, comp.kind, objects[name]))
        else:
            adapters[name] = ObjectAdapter(name, comp.kind, objects[name])
    return adapters
