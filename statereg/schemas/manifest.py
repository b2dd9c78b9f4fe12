"""The manifest: the JSON document whose presence commits a checkpoint (see docs/manifest.md)."""

from __future__ import annotations

import json
import re
from typing import Any, Literal, get_args, get_origin

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from statereg.errors import ManifestError, SpecError
from statereg.schemas.spec import Format, Kind, Sharing

MANIFEST_NAME = "manifest.json"
# 1.1: FileRecord.codec, references, digests. 1.2: `writer`, written only by saves on a
# store that does not enforce exclusive creates; every other manifest is still written as
# 1.1, byte for byte what a 1.1 reader accepts.
FORMAT_VERSION = "1.2"
PLAIN_FORMAT_VERSION = "1.1"
# A save with a writer token keeps every file of its checkpoint under this directory.
WRITER_DIR_PREFIX = "writer-"
# A manifest lists files and small metadata; anything larger is not one we wrote. Its size
# grows with the tensor items of incremental saves (one digest each, ~95 bytes): 128 MiB is
# ~1.4M items, which parse in ~1.6 us each (benchmarks/bench_manifest.py,
# docs/performance.md). save() refuses to write a larger one, so no reader ever meets it.
MAX_MANIFEST_BYTES = 128 * 1024 * 1024
# What statereg writes is a few levels deep (`extra` and `meta` hold the user's JSON, so
# allow far more); deeper is hostile and would recurse through the JSON decoder, pydantic
# and every printer.
MAX_MANIFEST_DEPTH = 256
# Python's default bound on int() digits (quadratic past it), applied even where a process
# lifted that bound: statereg's own integers have at most 20 digits, and save() cannot
# write a longer one under the default bound either.
MAX_INT_DIGITS = 4300
# orjson, which reads manifests first, returns an integer outside [-2**63, 2**64) as a float
# (2**64 reads back as 1.8446744073709552e+19, which no integer field accepts): statereg
# writes only integers inside this range, so every reader gets them back exactly.
MIN_EXACT_INT = -(2**63)
MAX_EXACT_INT = 2**64 - 1

# \Z, not $: `$` also matches before a trailing newline.
_CHECKSUM = re.compile(r"^xxh3_64:[0-9a-f]{16}\Z")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*:")
_CHECKPOINT_DIR = re.compile(r"^step_\d{8,}\Z")


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

    writer: str | None = Field(
        default=None, pattern=r"^[0-9a-f]{32}$",
        description="Saves on a store without exclusive creates: the save attempt's random "
        "token. Every file of the checkpoint lies under 'writer-<token>/' (its `files` paths "
        "say so), so two savers racing one step never write the same file. Absent otherwise.",
    )

    @model_validator(mode="after")
    def _files_under_the_writer(self) -> Manifest:
        prefix = self.data_prefix
        if prefix:
            stray = [f.path for f in self.files if not f.path.startswith(prefix)]
            if stray:
                raise ValueError(f"file {stray[0]!r} is not under {prefix!r}, the directory "
                                 "of this manifest's writer")
        return self

    @property
    def data_prefix(self) -> str:
        """'writer-<token>/' for a checkpoint saved under a writer token, else ''."""
        return f"{WRITER_DIR_PREFIX}{self.writer}/" if self.writer else ""

    def data_dir(self, name: str) -> str:
        """Where the component directories of checkpoint `name` lie, relative to the root."""
        return f"{name}/{WRITER_DIR_PREFIX}{self.writer}" if self.writer else name

    def without_writer(self) -> Manifest:
        """This manifest with paths relative to data_dir() (as a manifest without a writer
        has them): what the layouts read components by."""
        prefix = self.data_prefix
        if not prefix:
            return self
        files = [f.model_copy(update={"path": f.path.removeprefix(prefix)}) for f in self.files]
        components = {name: record.model_copy(update={
                          "files": [p.removeprefix(prefix) for p in record.files]})
                      for name, record in self.components.items()}
        return self.model_copy(update={"writer": None, "files": files,
                                       "components": components})

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
        """Serialize deterministically (sorted keys, indented) as UTF-8 JSON."""
        data = self.model_dump(mode="json")
        if data.get("writer") is None:  # a 1.1 manifest, as a 1.1 reader expects it
            data.pop("writer", None)
        try:
            return orjson.dumps(data, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2)
        except TypeError:  # nesting past orjson's 254 levels, which the reader still accepts
            return json.dumps(data, indent=2, sort_keys=True).encode()

    @property
    def total_bytes(self) -> int:
        """Bytes of all files of the checkpoint."""
        return sum(f.size for f in self.files)

    def root_files(self, name: str) -> list[FileRecord]:
        """Every file this checkpoint reads, with paths relative to the root."""
        own = [f.model_copy(update={"path": f"{name}/{f.path}"}) for f in self.files]
        return own + list(self.references)


def int_text(value: int) -> str:
    """`value` for an error message: its digits, or its size where printing it would take
    quadratic time or raise (Python refuses str() of integers past 4300 digits)."""
    if value.bit_length() <= 10_000:  # about 3,000 digits
        return str(value)
    return f"<about {int(value.bit_length() * 0.30103) + 1} digits>"


def exact_int(value: Any) -> bool:
    """Whether `value` is an int (not a bool) that every manifest reader keeps exactly."""
    return isinstance(value, int) and not isinstance(value, bool) \
        and MIN_EXACT_INT <= value <= MAX_EXACT_INT


def committable_json(manifest: Manifest, source: str) -> bytes:
    """The bytes to commit for `manifest`, once the reader's own check (`parse_manifest`, the
    function every load, listing and retention runs) accepts them and reads back the very
    values that were meant. A writer can therefore never commit a manifest that no reader
    accepts, or one a reader would understand differently: the two agree by construction.

    SpecError (nothing is committed) names the field the reader would refuse or change.
    """
    try:
        data = manifest.to_json()
    except ValueError as exc:  # pydantic's own bound on nesting, past the reader's
        raise SpecError(f"{source} cannot be written ({exc}); nothing was committed. Store "
                        "a flatter save(extra=...)") from None
    if len(data) > MAX_MANIFEST_BYTES:
        raise SpecError(
            f"{source} would be {len(data)} bytes, over the {MAX_MANIFEST_BYTES} byte bound "
            "every reader enforces; nothing was committed. Make save(extra=...) smaller, or "
            "save fewer tensor items per checkpoint"
        )
    try:
        back = parse_manifest(data, source)
    except ManifestError as exc:
        raise SpecError(
            f"{exc}: a reader would refuse this manifest, so it was not committed. Pass "
            "save() a step and tokens_seen from 0 to 2**64-1 and an extra of plain JSON"
        ) from None
    written, read = manifest.model_dump(), back.model_dump()
    if not _same(written, read):
        field = next((k for k in written if not _same(written[k], read.get(k))), "(root)")
        raise SpecError(
            f"{source}: the manifest field {field!r} would read back differently from what "
            "was saved, so it was not committed; store that value as a string (extra: only "
            "string keys, integers from -2**63 to 2**64-1, finite floats)"
        )
    return data


def _same(a: Any, b: Any) -> bool:
    """Equal values of equal types, all the way down: 2**64 and float(2**64), or NaN and
    None (what JSON writers make of NaN), differ here; a tuple reads back as a list."""
    if isinstance(a, tuple):
        a = list(a)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text.lstrip('-'))} digits (at most "
                         f"{MAX_INT_DIGITS})")
    return int(text)


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON (statereg writes no NaN or Infinity)")


def nesting_depth(value: Any) -> int:
    """How deeply lists and objects nest in `value` (iterative: hostile depth cannot recurse)."""
    deepest, level = 0, [value] if isinstance(value, (dict, list)) else []
    while level and deepest <= MAX_MANIFEST_DEPTH:
        deepest += 1
        level = [child for item in level
                 for child in (item.values() if isinstance(item, dict) else item)
                 if isinstance(child, (dict, list))]
    return deepest


def _decode(data: bytes, source: str) -> dict[str, Any]:
    """The JSON object in `data`; any defect, hostile ones included, is a ManifestError."""
    try:
        # orjson (a maintained Rust parser) reads a 1M-item manifest in a third of the
        # stdlib's time; it refuses NaN, nesting past 1024 and integers past a float's
        # range itself. Anything it refuses is parsed again by the stdlib parser with
        # statereg's bounds, so a damaged manifest gets the same precise error either way.
        raw = orjson.loads(data)
    except orjson.JSONDecodeError:
        raw = None
    try:
        if raw is None:
            raw = json.loads(data.decode("utf-8"), parse_int=_bounded_int,
                             parse_constant=_refuse_constant)
    except RecursionError:
        raise ManifestError(
            f"{source}: manifest nests lists or objects too deeply to be one statereg wrote; "
            "this checkpoint is damaged: load an earlier one"
        ) from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError and the bounds above
        raise ManifestError(
            f"{source}: manifest is not valid JSON ({exc}); this checkpoint is damaged: "
            "load an earlier one"
        ) from None
    if not isinstance(raw, dict):
        raise ManifestError(f"{source}: manifest must be a JSON object")
    if nesting_depth(raw) > MAX_MANIFEST_DEPTH:
        raise ManifestError(
            f"{source}: manifest nests lists or objects more than {MAX_MANIFEST_DEPTH} deep; "
            "this checkpoint is damaged: load an earlier one"
        )
    return raw


def _newer_minor(raw: dict[str, Any]) -> bool:
    """Whether `raw` is from a newer minor version of the format major this reader reads."""
    version = str(raw.get("format_version", "")).split(".")
    ours = FORMAT_VERSION.split(".")
    return len(version) == 2 and version[0] == ours[0] and version[1].isdigit() \
        and int(version[1]) > int(ours[1])


def _known_fields(value: Any, annotation: Any) -> Any:
    """`value` without the object keys that `annotation` (a record, or lists/dicts of them)
    does not declare: the fields a newer minor version added."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        if not isinstance(value, dict):
            return value
        fields = annotation.model_fields
        return {key: _known_fields(item, fields[key].annotation)
                for key, item in value.items() if key in fields}
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is list and isinstance(value, list):
        return [_known_fields(item, args[0]) for item in value]
    if origin is dict and isinstance(value, dict):
        return {key: _known_fields(item, args[1]) for key, item in value.items()}
    return value


def parse_manifest(data: bytes, source: str) -> Manifest:
    """Parse and validate manifest bytes read from `source`; any defect is a ManifestError.

    Bounded in size, nesting depth and integer length, so a hostile manifest is one damaged
    checkpoint (listings skip it, a load falls back past it), never a broken root.
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(
            f"{source}: manifest is {len(data)} bytes, over the {MAX_MANIFEST_BYTES} byte bound; "
            "it was not written by statereg"
        )
    raw = _decode(data, source)
    if _newer_minor(raw):
        # A newer 1.x adds only optional fields (docs/manifest.md): ignore what this reader
        # does not know. Its own and older versions stay strict: an unknown field there
        # is damage.
        raw = _known_fields(raw, Manifest)
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
