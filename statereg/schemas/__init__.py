"""Declaration and manifest models: pydantic only, importable without torch."""

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
    "ComponentRecord",
    "ComponentSpec",
    "FileRecord",
    "KeepBestSpec",
    "Manifest",
    "PrefixSpec",
    "ProfileSpec",
    "RegistrySpec",
    "SaveSpec",
    "StorageSpec",
    "parse_manifest",
]
