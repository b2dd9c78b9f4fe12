"""What the framework integrations share: reading the user's declaration, where the
framework supplies the components, and merging the two (no framework imported here)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

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
        return source.model_dump(by_alias=True, exclude_defaults=True), "<RegistrySpec>"
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
