"""What the framework integrations share: reading the user's declaration, where the
framework supplies the components, and merging the two; their default save mode; knowing
whether gradients wait for an optimizer step; checking the framework's private names each
one relies on (no framework imported here)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from statereg.declaration import read_declaration
from statereg.errors import SpecError, StateregError
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


def _resolve(path: str) -> Any:
    """The object at dotted `path` (a module, then attributes), or None if there is none."""
    parts = path.split(".")
    obj: Any
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
            if obj is None:
                return None
        return obj
    return None


@dataclasses.dataclass(frozen=True)
class PrivateName:
    """A name a framework does not document as its API, which an integration relies on:
    `owner.name`, and what the integration does with it. `owner` is the dotted path of a
    module or class (a private class is reached through this table too, never imported), or
    the object itself.

    `on_instances`: the attribute lives on each instance, set by the owner's constructor (a
    dataclass field, or an assignment in `__init__`), so that is what is checked. `parameters`:
    a method the integration overrides, which must take exactly these parameters. `feature`:
    None when the integration cannot work without the name; otherwise what is lost without
    it (said once, in a warning at import).
    """

    owner: Any
    name: str
    use: str
    on_instances: bool = False
    parameters: tuple[str, ...] | None = None
    feature: str | None = None

    @property
    def owner_object(self) -> Any:
        """The module or class, or None when the installed framework has none there."""
        return _resolve(self.owner) if isinstance(self.owner, str) else self.owner

    @property
    def label(self) -> str:
        """`package.module.Class.name`, as the framework's source spells it."""
        owner = self.owner
        if not isinstance(owner, str):
            owner = owner.__name__ if inspect.ismodule(owner) else \
                f"{owner.__module__}.{owner.__qualname__}"
        return f"{owner}.{self.name}"

    def problem(self) -> str | None:
        """Why this name does not resolve in the installed framework, or None when it does."""
        owner = self.owner_object
        if owner is None:
            return f"there is no {self.owner}"
        if self.on_instances:
            fields = ({f.name for f in dataclasses.fields(owner)}
                      if dataclasses.is_dataclass(owner) else set())
            code = getattr(getattr(owner, "__init__", None), "__code__", None)
            if self.name in fields or (code is not None and self.name in code.co_names):
                return None
            return "its constructor does not set it"
        if not hasattr(owner, self.name):
            return "there is no such name"
        if self.parameters is not None:
            got = tuple(inspect.signature(getattr(owner, self.name)).parameters)
            if got != self.parameters:
                return f"it takes ({', '.join(got)}), not ({', '.join(self.parameters)})"
        return None

    @property
    def value(self) -> Any:
        """The module's or class's own object of this name (not for `on_instances`)."""
        return getattr(self.owner_object, self.name)


def check_private_names(integration: str, framework: str, installed: str, tested: str,
                        names: Sequence[PrivateName]) -> frozenset[str]:
    """Resolve an integration's private framework names, once, at its import.

    A required name that does not resolve raises StateregError naming the name, the installed
    release and the one CI tests (constraints.txt), instead of an AttributeError deep inside
    a training hook. A name that only a feature needs turns that feature off with one
    warning saying what is lost. Returns the features turned off."""
    off: dict[str, list[str]] = {}
    for private in names:
        problem = private.problem()
        if problem is None:
            continue
        what = f"{private.label} ({private.use}): {problem}"
        if private.feature is None:
            raise StateregError(
                f"{integration} relies on {framework}'s private {what} in {framework} "
                f"{installed}; install {framework}=={tested}, the release CI tests "
                f"(constraints.txt), or a statereg that supports {framework} {installed}")
        off.setdefault(private.feature, []).append(what)
    for feature, whats in off.items():
        warnings.warn(
            f"{integration}: {framework} {installed} lacks {'; '.join(whats)}, so {feature}; "
            f"{framework}=={tested} (constraints.txt) has everything", UserWarning,
            stacklevel=3)
    return frozenset(off)
