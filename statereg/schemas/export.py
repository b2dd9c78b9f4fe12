"""JSON Schemas of statereg.yaml and manifest.json, as published in the repo's schemas/ folder."""

from __future__ import annotations

from typing import Any, Literal

from statereg.schemas.manifest import Manifest
from statereg.schemas.spec import RegistrySpec

SCHEMA_FILES = {"spec": "statereg.schema.json", "manifest": "manifest.schema.json"}


def json_schema(which: Literal["spec", "manifest"] = "spec") -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) for the declaration or the manifest."""
    model = RegistrySpec if which == "spec" else Manifest
    schema = model.model_json_schema(by_alias=True, mode="validation")
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return schema
