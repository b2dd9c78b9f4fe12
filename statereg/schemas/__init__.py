"""Declaration and manifest models: pydantic only, importable without torch."""

from statereg.schemas.export import SCHEMA_FILES, json_schema
from statereg.schemas.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    ComponentRecord,
    FileRecord,
    Manifest,
    parse_manifest,
)
from statereg.schemas.spec import (
    ComponentSpec,
    CompressionSpec,
    KeepBestSpec,
    PrefixSpec,
    ProfileSpec,
    RegistrySpec,
    SaveSpec,
    StorageSpec,
)

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "SCHEMA_FILES",
    "ComponentRecord",
    "ComponentSpec",
    "CompressionSpec",
    "FileRecord",
    "KeepBestSpec",
    "Manifest",
    "PrefixSpec",
    "ProfileSpec",
    "RegistrySpec",
    "SaveSpec",
    "StorageSpec",
    "json_schema",
    "parse_manifest",
]
