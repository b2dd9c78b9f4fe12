"""What the framework integrations share: reading the user's declaration, where the
framework supplies the components, and merging the two; their default save mode; knowing
whether gradients wait for an optimizer step (no framework imported here)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from statereg.declaration import read_declaration
from statereg.errors import SpecError
from statereg.schemas.spec import RegistrySpec

SpecSource = str | os.PathLike[str] | Mapping[str, Any] | RegistrySpec


def declaration_dict(source: SpecSource | None, default_label: str) -> tuple[dict[str, Any], str]:
    """The user's declaration as a plain dict and a label for messages. Unlike load_spec,
    `components` may be left out: the framework knows its objects."""
    if source is None:
        return {}, default_label
    if isinstance(source, RegistrySpec):
        data = source.model_dump(by_alias=True, exclude_defaults=True)
        if "async_mode" in source.save.model_fields_set:
            # Given explicitly, even as the default `off`: it overrides default_async.
            data.setdefault("save", {})["async"] = source.save.async_mode
        return data, "<RegistrySpec>"
    if isinstance(source, Mapping):
        return json.loads(json.dumps(dict(source))), "<dict>"
    return read_declaration(source), os.fspath(source)


def section(data: dict[str, Any], key: str, label: str) -> dict[str, Any]:
    """data[key] as a mapping (created empty when absent)."""
    value = data.setdefault(key, {})
    if value is None:
        value = data[key] = {}
    if not isinstance(value, dict):
        raise SpecError(f"{label}: {key} must be a mapping")
    return value


def merge_components(data: dict[str, Any], ours: dict[str, dict[str, Any]], label: str,
                     who: str) -> None:
    """Set data["components"] to the framework's components `ours`, refined by what the
    user declared for them (format, sharing, ...). Declaring a component the framework has no
    object for, or another kind, is an error; `required` stays the framework's."""
    declared = data.get("components") or {}
    if not isinstance(declared, dict):
        raise SpecError(f"{label}: components must be a mapping")
    merged = {name: dict(comp) for name, comp in ours.items()}
    for name, comp in declared.items():
        if name not in ours:
            raise SpecError(
                f"{label}: components.{name}: {who} has no object for it; it saves "
                f"{', '.join(ours)} (refine those, or leave 'components' out)")
        if not isinstance(comp, dict) or comp.get("kind", ours[name]["kind"]) != \
                ours[name]["kind"]:
            raise SpecError(f"{label}: components.{name} must be kind {ours[name]['kind']!r}")
        merged[name] = {**ours[name], **comp, "required": ours[name].get("required", True)}
    data["components"] = merged


def set_once(save: dict[str, Any], key: str, value: Any, label: str, source: str) -> None:
    """Fill save[key] from the framework's setting `source`; a yaml value that says
    otherwise is an error naming both."""
    if key in save and save[key] != value:
        raise SpecError(
            f"{label}: save.{key} is {save[key]!r} but {source} says {value!r}; keep one of "
            f"them ({source} is used when the yaml leaves save.{key} out)")
    save[key] = value


def default_async(save: dict[str, Any], device: torch.device | str) -> None:
    """Fill save.async when the declaration leaves it out: `thread` for a model on CPU,
    `pinned` on CUDA. A trainer's loop should not wait for the write of each checkpoint
    (the copy to host memory is all it waits for); the integration waits for the last save
    at the end of training and on an exception. An explicit `async` (even `off`), or
    STATEREG_SAVE__ASYNC, wins."""
    if "async" not in save and "async_mode" not in save:
        save["async"] = "pinned" if torch.device(device).type == "cuda" else "thread"


class GradientsInFlight:
    """Whether gradients were accumulated since the optimizer last stepped: then the loop is
    between the micro-batches of a gradient accumulation, and a checkpoint taken now would
    hold the data position and generators past micro-batches whose gradients it does not
    hold, so a resume from it would lose them. A save waits for the next optimizer step.

    It hooks each parameter's gradient accumulation and each optimizer's step (public torch
    hooks). Gradients that do not pass through autograd accumulation (FSDP2 writes its
    sharded gradients directly) are not seen; then `pending` stays False, as before."""

    def __init__(self, params: Iterable[torch.Tensor],
                 optimizers: Iterable[torch.optim.Optimizer]) -> None:
        self.pending = False
        self._handles = [opt.register_step_post_hook(self._stepped) for opt in optimizers]
        if self._handles:  # without an optimizer to see stepping, nothing is ever pending
            self._handles += [p.register_post_accumulate_grad_hook(self._accumulated)
                              for p in params if p.requires_grad]

    def _accumulated(self, param: torch.Tensor) -> None:
        self.pending = True

    def _stepped(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.pending = False

    def remove(self) -> None:
        """Take the hooks off the parameters and optimizers."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
