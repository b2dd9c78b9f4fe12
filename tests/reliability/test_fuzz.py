"""Fuzz the two parsers that read untrusted text: statereg.yaml and manifest.json.

Whatever the input, nothing escapes but SpecError (declarations) and ManifestError
(manifests): no KeyError, TypeError, RecursionError or pydantic internals. CI runs a few
thousand cases; STATEREG_FUZZ_EXAMPLES=100000 runs more by hand.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import statereg
from statereg.schemas.manifest import FORMAT_VERSION, Manifest, parse_manifest

EXAMPLES = int(os.environ.get("STATEREG_FUZZ_EXAMPLES", "600"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

VALID_SPEC: dict[str, Any] = {
    "version": 1,
    "storage": {"url": "s3://bucket/run", "options": {"anon": True}, "io_threads": 2},
    "components": {
        "model": {"kind": "model", "prefix": {"drop": "module."}},
        "optimizer": {"kind": "optimizer"},
        "loader": {"kind": "dataloader", "on_world_size_change": "reset"},
        "stage": {"kind": "custom", "sharing": "per_group", "group": "pp"},
    },
    "save": {"async": "thread", "keep_last": 3, "keep_best": {"metric": "loss"}},
    "profiles": {"finetune": {"exclude": ["optimizer", "loader"]}},
}

VALID_MANIFEST: dict[str, Any] = {
    "format_version": FORMAT_VERSION,
    "statereg_version": "0.1.0",
    "torch_version": "2.13.0",
    "created_at": "2026-01-01T00:00:00+00:00",
    "step": 10,
    "tokens_seen": 4096,
    "extra": {"loss": 2.5},
    "world_size": 2,
    "spec": {"storage": {"url": "memory://run", "options": {}}},
    "components": {
        "model": {"kind": "model", "sharing": "sharded", "format": "dcp",
                  "files": ["model/.metadata", "model/__0_0.distcp"], "tensors": 2,
                  "bytes": 300, "meta": {"aliases": {"head.weight": "emb.weight"}}},
        "rng": {"kind": "rng", "sharing": "per_rank", "format": "json",
                "files": ["rng/rank_00000.json"]},
    },
    "files": [
        {"path": "model/.metadata", "size": 100, "checksum": "xxh3_64:0123456789abcdef"},
        {"path": "model/__0_0.distcp", "size": 200, "checksum": "xxh3_64:0123456789abcdef"},
        {"path": "rng/rank_00000.json", "size": 50, "checksum": "xxh3_64:fedcba9876543210"},
    ],
}

scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=12)
           | st.floats(allow_nan=True, allow_infinity=True)
           | st.sampled_from(["model", "sharded", "dcp", "json", "s3://b/r", "../x", "/abs",
                              "1.0", "2.0", "999.1", "per_group", "thread", "-1", "1e400"]))
json_like = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=10) | st.sampled_from(list(VALID_SPEC)
                                                             + list(VALID_MANIFEST)),
                      inner, max_size=4),
    max_leaves=12,
)


@st.composite
def mutated(draw: Any, base: dict[str, Any]) -> Any:
    """`base` with a few random edits: a value replaced, a key removed or added."""
    data = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 4))):
        node: Any = data
        path = []
        while isinstance(node, (dict, list)) and node and draw(st.booleans()):
            key = draw(st.sampled_from(sorted(node) if isinstance(node, dict)
                                       else list(range(len(node)))))
            path.append(key)
            parent, node = node, node[key]
        if not path:
            if isinstance(data, dict):
                data[draw(st.text(max_size=8))] = draw(json_like)
            continue
        action = draw(st.sampled_from(["replace", "remove", "add"]))
        if action == "remove" and isinstance(parent, dict):
            del parent[path[-1]]
        elif action == "add" and isinstance(node, dict):
            node[draw(st.text(max_size=8))] = draw(json_like)
        else:
            parent[path[-1]] = draw(json_like)
    return data


def only_spec_errors(load: Any) -> None:
    with contextlib.suppress(statereg.SpecError):
        load()


@FUZZ
@given(text=st.text(max_size=300) | st.sampled_from([
    "storage: {url: x}\ncomponents: {m: {kind: model}}\n",
    "a: &a [*a]\n", "!!python/object/apply:os.system ['touch /tmp/x']", "{", "- - -", "\t",
    "storage: !!binary aGVsbG8=", "? [a, b]\n: c", "x: 1\nx: 2", "%YAML 9.9\n---\n",
]))
def test_yaml_text_raises_only_spec_errors(tmp_path_factory, text):
    path = tmp_path_factory.getbasetemp() / "fuzz.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    only_spec_errors(lambda: statereg.load_spec(path, environ={}))


@FUZZ
@given(data=mutated(VALID_SPEC) | json_like)
def test_declarations_raise_only_spec_errors(tmp_path_factory, data):
    only_spec_errors(lambda: statereg.load_spec(data, environ={}) if isinstance(data, dict)
                     else statereg.load_spec({"storage": data, "components": data}, environ={}))
    # The same data as YAML text, and as STATEREG_* variables on a valid declaration.
    path = tmp_path_factory.getbasetemp() / "fuzz-structured.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8",
                    errors="surrogatepass")
    only_spec_errors(lambda: statereg.load_spec(path, environ={}))
    environ = {f"STATEREG_{k.upper()}": json.dumps(v, default=str)[:100]
               for k, v in (data.items() if isinstance(data, dict) else [])
               if isinstance(k, str)}
    only_spec_errors(lambda: statereg.load_spec(VALID_SPEC, environ=environ))


def only_manifest_errors(data: bytes) -> Manifest | None:
    try:
        return parse_manifest(data, "fuzz/manifest.json")
    except statereg.ManifestError:
        return None


@FUZZ
@given(data=st.binary(max_size=400))
def test_manifest_bytes_raise_only_manifest_errors(data):
    only_manifest_errors(data)


@FUZZ
@given(data=mutated(VALID_MANIFEST) | json_like)
def test_manifest_structures_raise_only_manifest_errors(data):
    text = json.dumps(data, default=str)
    parsed = only_manifest_errors(text.encode())
    if parsed is not None:  # whatever got through is safe to use
        for record in parsed.files:
            assert not record.path.startswith("/") and ".." not in record.path.split("/")
        assert int(parsed.format_version.split(".")[0]) <= int(FORMAT_VERSION.split(".")[0])
    for cut in (len(text) // 2, len(text) - 1):
        only_manifest_errors(text[:cut].encode())


def test_the_valid_documents_parse():
    statereg.load_spec(VALID_SPEC, environ={})
    assert parse_manifest(json.dumps(VALID_MANIFEST).encode(), "m").step == 10
