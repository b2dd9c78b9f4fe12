"""The manifest: the JSON document whose presence commits a checkpoint (see docs/manifest.md)."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from statereg.errors import ManifestError
from statereg.schemas.spec import Format, Kind, Sharing

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = "1.1"  # 1.1: FileRecord.codec, references, digests
# A manifest lists files and small metadata; anything larger is not one we wrote.
MAX_MANIFEST_BYTES = 64 * 1024 * 1024

_CHECKSUM = re.compile(r"^xxh3_64:[0-9a-f]{16}$")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*:")
_CHECKPOINT_DIR = re.compile(r"^step_\d{8,}$")


def check_relative_path(path: str) -> str:
    """Reject any path that could leave the checkpoint directory: absolute, `..`, or a URL."""
    if not path or path.startswith(("/", "\\")) or _SCHEME.match(path) or "\\" in path:
        raise ValueError(f"path {path!r} must be relative to the checkpoint directory")
    if any(part in ("", ".", "..") for part in path.split("/")):
        raise ValueError(f"path {path!r} must not contain empty, '.' or '..' segments")
    return path


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FileRecord(_Record):
    """One file of a checkpoint, as written: where, how big, and its checksum."""

    path: str = Field(description="Path relative to the checkpoint directory; never '..'.")
    size: int = Field(ge=0, description="Size in bytes as stored.")
    checksum: str = Field(description="'xxh3_64:' and 16 hex digits, computed while writing.")
    codec: Literal["none", "zstd", "zstd+planes"] = Field(
        default="none",
        description="How items inside the file are compressed (DCP records each item's "
        "transform too): zstd frames, or float byte planes then zstd.",
    )

    _check_path = field_validator("path")(check_relative_path)

    @field_validator("checksum")
    @classmethod
    def _known_checksum(cls, value: str) -> str:
        if not _CHECKSUM.match(value):
            raise ValueError("checksum must be 'xxh3_64:' followed by 16 lowercase hex digits")
        return value


class ComponentRecord(_Record):
    """How one declared component was saved."""

    kind: Kind
    sharing: Sharing
    format: Format
    files: list[str] = Field(description="Paths (as in `files`) that hold this component.")
    tensors: int = Field(default=0, ge=0, description="Number of tensors stored.")
    bytes: int = Field(default=0, ge=0, description="Total bytes of this component's files.")
    meta: dict[str, Any] = Field(
        default_factory=dict,
        description="Adapter metadata, e.g. `aliases` of tied weights: {alias: stored name}.",
    )


class Manifest(_Record):
    """The committed description of one checkpoint."""

    format_version: str = Field(description="MAJOR.MINOR; a newer major cannot be read.")
    statereg_version: str
    torch_version: str
    created_at: str = Field(description="UTC time the checkpoint was committed (ISO 8601).")
    step: int = Field(ge=0)
    tokens_seen: int | None = Field(default=None, ge=0)
    extra: dict[str, Any] = Field(default_factory=dict)
    world_size: int = Field(ge=1)
    spec: dict[str, Any] = Field(description="The declaration used, storage options redacted.")
    components: dict[str, ComponentRecord]
    files: list[FileRecord]
    references: list[FileRecord] = Field(
        default_factory=list,
        description="Incremental saves: files of earlier checkpoints this one reads unchanged "
        "items from; paths relative to the root (e.g. 'step_00000100/model/__0_0.distcp').",
    )
    digests: dict[str, str] = Field(
        default_factory=dict,
        description="Incremental saves: '<dcp dir>/<item>' -> dtype, shape and xxh3_128 of "
        "each tensor item, so a later save can reference unchanged ones.",
    )

    @field_validator("references")
    @classmethod
    def _references_name_checkpoints(cls, value: list[FileRecord]) -> list[FileRecord]:
        for record in value:
            if not _CHECKPOINT_DIR.match(record.path.split("/", 1)[0]) or "/" not in record.path:
                raise ValueError(f"reference {record.path!r} must lie in a checkpoint directory "
                                 "of the same root (step_NNNNNNNN/...)")
        return value

    @field_validator("format_version")
    @classmethod
    def _readable_version(cls, value: str) -> str:
        major = value.split(".", 1)[0]
        if not major.isdigit():
            raise ValueError(f"format_version {value!r} is not MAJOR.MINOR")
        if int(major) > int(FORMAT_VERSION.split(".")[0]):
            raise ValueError(
                f"format_version {value} was written by a newer statereg (this one reads "
                f"{FORMAT_VERSION.split('.')[0]}.x): upgrade statereg"
            )
        return value

    def to_json(self) -> bytes:
        """Serialize deterministically (sorted keys) as UTF-8 JSON."""
        return json.dumps(self.model_dump(mode="json"), indent=1, sort_keys=True).encode()

    @property
    def total_bytes(self) -> int:
        """Bytes of all files of the checkpoint."""
        return sum(f.size for f in self.files)

    def root_files(self, name: str) -> list[FileRecord]:
        """Every file this checkpoint reads, with paths relative to the root."""
        own = [f.model_copy(update={"path": f"{name}/{f.path}"}) for f in self.files]
        return own + list(self.references)


def parse_manifest(data: bytes, source: str) -> Manifest:
    """Parse and validate manifest bytes read from `source`; any defect is a ManifestError."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(
            f"{source}: manifest is {len(data)} bytes, over the {MAX_MANIFEST_BYTES} byte bound; "
            "it was not written by statereg"
        )
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{source}: manifest is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ManifestError(f"{source}: manifest must be a JSON object")
    try:
        manifest = Manifest.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(root)"
        raise ManifestError(f"{source}: invalid manifest field {where}: {first['msg']}") from None
    listed = {f.path for f in manifest.files}
    for name, comp in manifest.components.items():
        for path in comp.files:
            if path not in listed:
                raise ManifestError(
                    f"{source}: component {name!r} names {path!r}, which is not in 'files'"
                )
    return manifest
