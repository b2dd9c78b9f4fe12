"""Turn statereg.yaml (or a dict), overrides and STATEREG_* variables into a RegistrySpec.

Torch-free, so `statereg plan` and `statereg schema` answer fast.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from statereg import env
from statereg.errors import SpecError
from statereg.schemas.spec import RegistrySpec

ENV_PREFIX = env.SPEC_PREFIX
ENV_NESTING = "__"


class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe YAML loader that rejects duplicate keys instead of keeping the last one."""


def _construct_unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, f"a mapping key must be a plain value, not {type(key).__name__}",
                key_node.start_mark,
            ) from None
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"duplicate key {key!r} (first defined on line {seen[key] + 1})",
                key_node.start_mark,
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping
)


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{path}: file not found; pass the path of your statereg.yaml") from None
    except OSError as exc:
        raise SpecError(f"{path}: cannot read the declaration ({exc.strerror})") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        if "'\\t'" in problem:
            problem += "; YAML indents with spaces, never tabs: replace the tab with spaces"
        raise SpecError(f"{where}: invalid YAML: {problem}") from None


def read_declaration(source: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    """The declaration as written (a YAML file's mapping, or a copy of a dict), before
    defaults, environment overrides and validation: for integrations that add components."""
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source))
    path = Path(source)
    data = _read_yaml(path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SpecError(f"{path}: the declaration must be a mapping with 'storage' and "
                        "'components'")
    return data


def _set_dotted(data: dict[str, Any], dotted: str, value: Any, source: str) -> None:
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise SpecError(f"{source}: cannot set {dotted!r}: {key!r} is not a mapping")
        node = child
    node[keys[-1]] = value


def _env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """STATEREG_STORAGE__URL=s3://b/r -> {"storage.url": "s3://b/r"} (values parse as YAML)."""
    roots = set(RegistrySpec.model_fields)
    found: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        parts = name[len(ENV_PREFIX) :].lower().split(ENV_NESTING)
        if parts[0] not in roots or not all(parts):
            continue
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        found[".".join(parts)] = raw if value is None else value
    return found


def _check_text(value: Any, label: str, where: list[str], depth: int = 0) -> None:
    """Every string must be encodable text: YAML's "\\ud800" escape makes a lone surrogate,
    which no message (nor a storage URL) can carry. Nesting is bounded too."""
    if depth > 100:
        raise SpecError(f"{label}: {'.'.join(where[:5])}...: nested more than 100 levels deep")
    items: Any = ()
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    elif isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            spot = ".".join(where) or "(root)"
            raise SpecError(f"{label}: {spot}: {value.encode('utf-8', 'backslashreplace')!r} "
                            "is not valid text (a lone surrogate escape such as \\ud800)"
                            ) from None
        return
    for key, item in items:
        if isinstance(key, str):
            _check_text(key, label, where)
        _check_text(item, label, [*where, str(key)], depth + 1)


def _may_hold_options(loc: tuple[Any, ...]) -> bool:
    """Whether the input at `loc` can contain storage.options (credentials): never echo it."""
    options = ("storage", "options")
    return tuple(loc[:2]) == options or options[: len(loc)] == tuple(loc)


def format_validation_error(exc: ValidationError, source: str) -> str:
    """One line per problem: `source: field.path: message`; unknown fields end the path."""
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        if err["type"] == "unknown_field":
            loc.append(err["ctx"]["field"])
        where = ".".join(loc) or "(root)"
        msg = err["msg"]
        if err["type"] == "missing":
            msg = "required field is missing"
        elif "input" in err and err["type"] not in ("unknown_field", "value_error") \
                and not _may_hold_options(err["loc"]):
            msg = f"{msg} (got {err['input']!r})"
        lines.append(f"{source}: {where}: {msg.removeprefix('Value error, ')}")
    return "\n".join(lines)


def load_spec(
    source: str | os.PathLike[str] | Mapping[str, Any] | RegistrySpec,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> RegistrySpec:
    """Load a declaration from a YAML path or a dict, then apply STATEREG_* and `overrides`.

    Precedence (last wins): the file, environment variables, `overrides`.
    """
    if isinstance(source, RegistrySpec):
        data: Any = source.model_dump(by_alias=True, exclude_defaults=True)
        label = "<RegistrySpec>"
    elif isinstance(source, Mapping):
        data = copy.deepcopy(dict(source))
        label = "<dict>"
    else:
        path = Path(source)
        data = _read_yaml(path)
        label = str(path)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(
            f"{label}: the declaration must be a mapping with 'storage' and 'components'"
        )
    given = _env_overrides(env.spec_overrides() if environ is None else environ)
    for dotted, value in given.items():
        _set_dotted(data, dotted, value, f"{label} (from {ENV_PREFIX}{dotted.upper()})")
    for dotted, value in (overrides or {}).items():
        _set_dotted(data, dotted, value, f"{label} (override {dotted})")
    _check_text(data, label, [])
    try:
        return RegistrySpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(format_validation_error(exc, label)) from None
