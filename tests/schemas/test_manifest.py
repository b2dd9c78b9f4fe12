"""parse_manifest: a manifest.json is trusted only if every field and every path checks out."""

from __future__ import annotations

import copy
import json
import sys

import pytest

import statereg
from statereg.schemas import FORMAT_VERSION, MANIFEST_NAME, Manifest, parse_manifest
from statereg.schemas.manifest import (
    MAX_INT_DIGITS,
    MAX_MANIFEST_BYTES,
    MAX_MANIFEST_DEPTH,
    nesting_depth,
)

SOURCE = "memory://run/step_00000010/manifest.json"
CHECKSUM = "xxh3_64:0123456789abcdef"


def valid_manifest_data() -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "statereg_version": "0.1.0",
        "torch_version": "2.13.0",
        "created_at": "2025-01-01T00:00:00+00:00",
        "step": 10,
        "tokens_seen": 40960,
        "extra": {"loss": 2.5, "note": "warmup done"},
        "world_size": 1,
        "spec": {"storage": {"url": "memory://run", "options": {}}},
        "components": {
            "model": {
                "kind": "model",
                "sharing": "sharded",
                "format": "dcp",
                "files": ["model/.metadata", "model/__0_0.distcp"],
                "tensors": 2,
                "bytes": 300,
                "meta": {"aliases": {"head.weight": "emb.weight"}},
            },
            "rng": {
                "kind": "rng",
                "sharing": "per_rank",
                "format": "json",
                "files": ["rng/rank_00000.json"],
            },
        },
        "files": [
            {"path": "model/.metadata", "size": 100, "checksum": CHECKSUM},
            {"path": "model/__0_0.distcp", "size": 200, "checksum": CHECKSUM},
            {"path": "rng/rank_00000.json", "size": 50, "checksum": CHECKSUM},
        ],
    }


def encoded(data: dict) -> bytes:
    return json.dumps(data).encode()


def manifest_error(data: bytes) -> str:
    with pytest.raises(statereg.ManifestError) as info:
        parse_manifest(data, SOURCE)
    message = str(info.value)
    assert message.startswith(f"{SOURCE}: ")
    return message


def with_file_path(path: str) -> bytes:
    data = valid_manifest_data()
    data["files"][0]["path"] = path
    data["components"]["model"]["files"][0] = path
    return encoded(data)


def test_manifest_name_is_manifest_json():
    assert MANIFEST_NAME == "manifest.json"


def test_valid_manifest_round_trips_through_to_json():
    manifest = Manifest.model_validate(valid_manifest_data())
    parsed = parse_manifest(manifest.to_json(), SOURCE)

    assert parsed == manifest
    assert parsed.step == 10
    assert parsed.tokens_seen == 40960
    assert parsed.extra == {"loss": 2.5, "note": "warmup done"}
    assert parsed.components["model"].meta == {"aliases": {"head.weight": "emb.weight"}}
    assert parsed.total_bytes == 350


def test_to_json_is_deterministic():
    data = valid_manifest_data()
    reordered = dict(reversed(list(data.items())))
    first = Manifest.model_validate(data).to_json()

    assert first == Manifest.model_validate(reordered).to_json()
    assert json.loads(first) == json.loads(parse_manifest(first, SOURCE).to_json())


def test_an_older_minor_version_of_the_same_major_is_read():
    data = valid_manifest_data()
    data["format_version"] = "1.7"
    assert parse_manifest(encoded(data), SOURCE).format_version == "1.7"


@pytest.mark.parametrize(
    "path",
    ["../outside.bin", "model/../../etc/passwd", "model/..", "./model/x", "model//x"],
)
def test_paths_that_can_leave_the_checkpoint_are_rejected(path):
    message = manifest_error(with_file_path(path))

    assert "files.0.path" in message
    assert repr(path) in message
    assert "'..'" in message


@pytest.mark.parametrize("path", ["/etc/passwd", "\\\\server\\share\\x", "C:\\x\\y"])
def test_absolute_paths_are_rejected(path):
    message = manifest_error(with_file_path(path))

    assert "files.0.path" in message
    assert "must be relative to the checkpoint directory" in message


@pytest.mark.parametrize(
    "path", ["s3://bucket/key", "file:///etc/passwd", "http://example.com/x", "memory://x"]
)
def test_urls_are_rejected(path):
    message = manifest_error(with_file_path(path))

    assert "files.0.path" in message
    assert "must be relative to the checkpoint directory" in message


def test_a_manifest_over_the_size_bound_is_rejected_before_parsing():
    oversized = b" " * (MAX_MANIFEST_BYTES + 1)
    message = manifest_error(oversized)

    assert str(MAX_MANIFEST_BYTES + 1) in message
    assert "over the" in message
    assert "not written by statereg" in message


FIELD_DEFECTS = [
    (lambda d: d.update(step="ten"), "step"),
    (lambda d: d.update(step=-1), "step"),
    (lambda d: d.update(world_size=0), "world_size"),
    (lambda d: d.update(files="model/.metadata"), "files"),
    (lambda d: d["files"][1].update(size="large"), "files.1.size"),
    (lambda d: d["files"][2].update(checksum="md5:abc"), "files.2.checksum"),
    (lambda d: d["files"][2].update(checksum=CHECKSUM + "\n"), "files.2.checksum"),
    (lambda d: d.update(references=[
        {"path": "step_00000005\n/model/x.distcp", "size": 1, "checksum": CHECKSUM}]),
     "references"),
    (lambda d: d["components"]["model"].update(kind="module"), "components.model.kind"),
    (lambda d: d["components"]["rng"].update(files="rng/rank_00000.json"),
     "components.rng.files"),
    (lambda d: d.update(extra=[1, 2]), "extra"),
    (lambda d: d.pop("torch_version"), "torch_version"),
    (lambda d: d.update(unexpected=True), "unexpected"),
]


@pytest.mark.parametrize(("mutate", "field"), FIELD_DEFECTS, ids=[f for _, f in FIELD_DEFECTS])
def test_wrong_type_or_missing_fields_name_the_field(mutate, field):
    data = copy.deepcopy(valid_manifest_data())
    mutate(data)
    message = manifest_error(encoded(data))

    assert f"invalid manifest field {field}:" in message


def test_a_newer_major_format_version_says_upgrade():
    data = valid_manifest_data()
    data["format_version"] = "2.0"
    message = manifest_error(encoded(data))

    assert "format_version" in message
    assert "2.0" in message
    assert "newer statereg" in message
    assert "upgrade statereg" in message


def test_a_malformed_format_version_is_rejected():
    data = valid_manifest_data()
    data["format_version"] = "one"
    assert "is not MAJOR.MINOR" in manifest_error(encoded(data))


def test_a_component_naming_a_file_not_in_files_is_rejected():
    data = valid_manifest_data()
    data["components"]["rng"]["files"].append("rng/rank_00001.json")
    message = manifest_error(encoded(data))

    assert "component 'rng'" in message
    assert "'rng/rank_00001.json'" in message
    assert "not in 'files'" in message


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe\x00", "not valid JSON"),
        (b"[1, 2, 3]", "must be a JSON object"),
    ],
)
def test_bytes_that_are_not_a_json_object_are_rejected(data, expected):
    assert expected in manifest_error(data)


def _nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"[" * 3000 + b"]" * 3000, "nests lists or objects too deeply"),
        (b'{"a":' * 3000 + b"1" + b"}" * 3000, "nests lists or objects too deeply"),
        (b'{"step": ' + b"9" * 5000 + b"}", "an integer of 5000 digits (at most 4300)"),
        (b'{"step": -' + b"9" * 5000 + b"}", "an integer of 5000 digits (at most 4300)"),
        (b'{"step": NaN}', "NaN is not JSON"),
        (b'{"step": -Infinity}', "-Infinity is not JSON"),
        (b'{"note": "\xc3\x28"}', "not valid JSON ('utf-8' codec can't decode"),
        (b'"a string"', "must be a JSON object"),
        (b"null", "must be a JSON object"),
        (b"", "not valid JSON"),
    ],
    ids=["3000-nested-lists", "3000-nested-objects", "5000-digit-int", "negative-5000-digit-int",
         "nan", "infinity", "invalid-utf8", "string", "null", "empty"],
)
def test_hostile_manifest_bytes_are_a_manifest_error_naming_the_file(data, expected):
    """Each of these once escaped as RecursionError / ValueError and bricked the whole root."""
    message = manifest_error(data)
    assert expected in message
    assert "load an earlier one" in message or "JSON object" in message


def test_nesting_under_the_recursion_limit_but_over_the_bound_is_refused():
    data = valid_manifest_data()
    data["extra"] = {"deep": _nested(MAX_MANIFEST_DEPTH)}
    assert f"more than {MAX_MANIFEST_DEPTH} deep" in manifest_error(encoded(data))


def test_user_extra_as_deep_and_long_as_the_bounds_allow_still_reads():
    data = valid_manifest_data()
    data["extra"] = {"deep": _nested(MAX_MANIFEST_DEPTH - 2), "seed": 10 ** (MAX_INT_DIGITS - 1)}
    manifest = parse_manifest(encoded(data), SOURCE)
    assert manifest.extra["seed"] == 10 ** (MAX_INT_DIGITS - 1)
    assert nesting_depth(manifest.model_dump()) == MAX_MANIFEST_DEPTH


def test_the_integer_bound_holds_even_where_the_process_lifted_pythons_limit():
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        message = manifest_error(b'{"step": ' + b"7" * 100_000 + b"}")
    finally:
        sys.set_int_max_str_digits(old)
    assert "an integer of 100000 digits" in message


def test_a_newer_minor_version_with_unknown_fields_still_reads():
    """A 1.x reader reads 1.(x+1): minor versions only add optional fields, which it ignores."""
    major = FORMAT_VERSION.split(".")[0]
    data = valid_manifest_data()
    data["format_version"] = f"{major}.99"
    data["retention_hint"] = {"keep": True}
    data["files"][0]["storage_class"] = "cold"
    data["components"]["model"]["layout"] = "v2"
    manifest = parse_manifest(encoded(data), SOURCE)
    assert manifest.format_version == f"{major}.99"
    assert manifest.files[0].path == "model/.metadata"
    assert manifest.components["model"].tensors == 2
    assert "retention_hint" not in json.loads(manifest.to_json())



# -- the writer commits only what the reader accepts (issue 25, case 5) ------------------------

# Each of these a Manifest model accepts; every one was once committed, and then no reader
# accepted it (or read back something else): a checkpoint nobody loads, whose unreadable
# manifest protects every lower step from retention for good.
UNREADABLE = {
    "step 2**64": (lambda d: d.update(step=2**64), "step"),
    "tokens_seen 2**64+1": (lambda d: d.update(tokens_seen=2**64 + 1), "tokens_seen"),
    "extra integer 2**64": (lambda d: d["extra"].update(n=2**64), "extra"),
    "extra integer below -2**63": (lambda d: d["extra"].update(n=-(2**63) - 1), "extra"),
    "extra NaN": (lambda d: d["extra"].update(loss=float("nan")), "extra"),
    "extra infinity": (lambda d: d["extra"].update(loss=float("inf")), "extra"),
    "extra integer dict key": (lambda d: d["extra"].update(ids={1: "a"}), "extra"),
    "extra nested past the depth bound": (
        lambda d: d["extra"].update(deep=_nested(MAX_MANIFEST_DEPTH)), "extra"),
    "component meta integer 2**64": (
        lambda d: d["components"]["model"]["meta"].update(n=2**64), "components"),
}


@pytest.mark.parametrize("case", sorted(UNREADABLE))
def test_commit_refuses_every_manifest_the_reader_would_refuse_or_misread(tmp_path, case):
    from statereg.backends.local import LocalBackend
    from statereg.engine.checkpoints import read_manifest_at
    from statereg.engine.publish import commit

    backend = LocalBackend(str(tmp_path))
    data = valid_manifest_data()
    mutate, named = UNREADABLE[case]
    mutate(data)
    manifest = Manifest.model_validate(data)  # the writer's model takes it
    with pytest.raises(statereg.SpecError, match="committed") as info:
        commit(backend, "step_00000010", manifest, None)
    assert named in str(info.value)
    assert not (tmp_path / "step_00000010" / MANIFEST_NAME).exists()
    assert not (tmp_path / "latest").exists()
    # The same manifest without the defect commits, and the reader reads back what was meant.
    good = Manifest.model_validate(valid_manifest_data())
    commit(backend, "step_00000010", good, None)
    assert read_manifest_at(backend, "step_00000010") == good


def test_the_largest_values_the_writer_accepts_are_read_back_exactly(tmp_path):
    from statereg.backends.local import LocalBackend
    from statereg.engine.checkpoints import read_manifest_at
    from statereg.engine.publish import commit
    from statereg.schemas.manifest import MAX_EXACT_INT, MIN_EXACT_INT

    data = valid_manifest_data()
    data.update(step=MAX_EXACT_INT, tokens_seen=MAX_EXACT_INT)
    data["extra"].update(lo=MIN_EXACT_INT, hi=MAX_EXACT_INT, tiny=5e-324,
                         big=1.7976931348623157e308)
    manifest = Manifest.model_validate(data)
    name = f"step_{MAX_EXACT_INT:08d}"
    commit(LocalBackend(str(tmp_path)), name, manifest, None)
    assert read_manifest_at(LocalBackend(str(tmp_path)), name) == manifest
