"""JSON Schemas of statereg.yaml, manifest.json and the CLI's --json documents, as shipped in
statereg/schemas/."""

from __future__ import annotations

from typing import Any, Literal

from statereg.schemas.cli import cli_json_schema
from statereg.schemas.manifest import Manifest
from statereg.schemas.spec import RegistrySpec

SCHEMA_FILES = {"spec": "statereg.schema.json", "manifest": "manifest.schema.json",
                "cli": "cli.schema.json"}


def json_schema(which: Literal["spec", "manifest", "cli"] = "spec") -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) for the declaration, the manifest or the documents
    `statereg <command> --json` prints."""
    if which == "cli":
        schema = cli_json_schema()
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        return schema
    model = RegistrySpec if which == "spec" else Manifest
    schema = model.model_json_schema(by_alias=True, mode="validation")
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return schema
