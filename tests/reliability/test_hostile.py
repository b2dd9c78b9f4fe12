"""Hostile checkpoints: files crafted to run code, paths that leave the checkpoint, manifests
that lie. Whoever can write a checkpoint can also rewrite manifest.json and its checksums,
so every case here rewrites them to match (checksums catch corruption, not attackers): what
stops the attack is the safe readers. Each payload really creates a file when unpickled the
ordinary way; the tests check that no statereg entry point ever lets it run."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from crash_driver import SINGLE_COMPONENTS, TinyState, declaration
from reliability_kit import assert_identical, rewrite_manifest, write_manifest
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata

import statereg
from statereg.backends.registry import open_backend
from statereg.cli import main as cli
from statereg.engine.gc import collect_garbage

BACKENDS = ["local", "s3"]


class RunsCode:
    """Unpickled the ordinary way, this creates `marker`: a real, if polite, payload."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return exec, (f"open({self.marker!r}, 'w').close()",)


def checkpoint_files(store, name: str, component: str) -> dict[str, bytes]:
    return {p.removeprefix(f"{name}/"): store.fs.cat_file(store.path(p))
            for p in store.files() if p.startswith(f"{name}/{component}/")}


def entry_points(store, url: str, tmp_path: Path) -> list[int | str]:
    """Run every command that takes a checkpoint URL or root; returns their exit codes (or
    the type of an exception that escaped: what matters here is that no code ran)."""
    options = ["--options", json.dumps(store.options)]
    commands = [
        ["ls", store.url],
        ["inspect", url],
        ["inspect", url, "--json"],
        ["verify", url],
        ["export-hf", url, str(tmp_path / "hf-out")],
        ["cp", url, str(tmp_path / "copy-plain")],
        ["cp", url, str(tmp_path / "copy-recompressed"), "--compression", "none"],
        ["gc", store.url, "--grace", "0"],
    ]
    codes: list[int | str] = []
    for command in commands:
        try:
            codes.append(cli([*command, *options]))
        except BaseException as exc:  # DCP's CheckpointException is not an Exception
            if isinstance(exc, KeyboardInterrupt):
                raise
            codes.append(type(exc).__name__)
    return codes


# -- DCP .metadata -------------------------------------------------------------------------


def payloads(marker: Path) -> dict[str, bytes]:
    inside = Metadata(state_dict_metadata={"0.weight": RunsCode(marker)})  # type: ignore[dict-item]
    return {"bare": pickle.dumps(RunsCode(marker)), "inside Metadata": pickle.dumps(inside)}


def test_the_metadata_payloads_run_code_when_unpickled_the_ordinary_way(tmp_path):
    for kind, payload in payloads(tmp_path / "ran").items():
        pickle.loads(payload)
        assert (tmp_path / "ran").exists(), kind
        os.remove(tmp_path / "ran")


@pytest.mark.parametrize("store", BACKENDS, indirect=True)
@pytest.mark.parametrize("kind", ["bare", "inside Metadata"])
def test_a_code_running_metadata_file_never_runs(store, kind, tmp_path, capsys):
    marker = tmp_path / "pwned"
    url = statereg.CheckpointManager(declaration(store.url, store.options, SINGLE_COMPONENTS),
                                     **TinyState.trained(1).objects()).save(step=1)
    rewrite_manifest(url, store.options, {"model/.metadata": payloads(marker)[kind]})
    state = TinyState.trained(5)
    before = state.snapshot()
    mgr = statereg.CheckpointManager(declaration(store.url, store.options, SINGLE_COMPONENTS),
                                     **state.objects())

    for verify in ("off", "fast", "full"):
        with pytest.raises(statereg.CorruptCheckpointError, match="cannot be read safely"):
            mgr.load(verify=verify)
        assert not marker.exists()
    assert_identical(state.snapshot(), before)
    codes = entry_points(store, url, tmp_path)
    capsys.readouterr()
    assert not marker.exists()
    assert codes[:4] == [0, 0, 0, 0]  # ls, inspect and verify read no pickle
    assert codes[4] != 0  # export-hf needs the model's metadata and refuses it


# -- DCP data files: pickled (non-tensor) items ----------------------------------------------


class Notes:
    """A custom component whose state mixes a tensor and plain Python values."""

    def __init__(self, scale: float = 1.0) -> None:
        self.state = {"w": torch.arange(6.0) * scale, "meta": {"epoch": 3, "name": "warmup"}}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


def plain_dcp_files(state: dict[str, Any]) -> dict[str, bytes]:
    """What plain DCP (its own writer, ordinary pickling) writes for `state`."""
    with tempfile.TemporaryDirectory() as directory:
        dcp.save(state, storage_writer=FileSystemWriter(directory, thread_count=1),
                 no_dist=True)
        return {name: (Path(directory) / name).read_bytes() for name in os.listdir(directory)}


def test_a_code_running_data_item_runs_with_dcps_default_load_planner(tmp_path):
    files = plain_dcp_files({"w": torch.zeros(6), "meta": {"epoch": RunsCode(tmp_path / "ran"),
                                                           "name": "x"}})
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    target = {"w": torch.zeros(6), "meta": {"epoch": 0, "name": ""}}
    dcp.load(target, storage_reader=FileSystemReader(str(tmp_path)), no_dist=True)
    assert (tmp_path / "ran").exists()


@pytest.mark.parametrize("store", BACKENDS, indirect=True)
def test_a_code_running_data_item_never_runs(store, tmp_path, capsys):
    marker = tmp_path / "pwned"
    decl = declaration(store.url, store.options,
                       {"notes": {"kind": "custom", "format": "dcp"}})
    url = statereg.CheckpointManager(decl, notes=Notes()).save(step=1)
    old = checkpoint_files(store, "step_00000001", "notes")
    hostile = plain_dcp_files({"w": torch.zeros(6), "meta": {"epoch": RunsCode(marker),
                                                             "name": "warmup"}})
    changed: dict[str, bytes | None] = {p: None for p in old}
    changed.update({f"notes/{name}": data for name, data in hostile.items()})
    rewrite_manifest(url, store.options, changed)
    statereg.verify(url, store.options)  # the manifest matches: checksums cannot tell

    for verify in ("off", "fast", "full"):
        with pytest.raises(statereg.CorruptCheckpointError, match="weights-only allow-list"):
            statereg.CheckpointManager(decl, notes=Notes(2.0)).load(verify=verify)
        assert not marker.exists()
    entry_points(store, url, tmp_path)
    capsys.readouterr()
    assert not marker.exists()


@pytest.mark.parametrize("store", BACKENDS, indirect=True)
def test_a_model_tensor_replaced_by_a_pickled_object_never_runs(store, tmp_path, capsys):
    marker = tmp_path / "pwned"
    state = TinyState.trained(1)
    url = statereg.CheckpointManager(declaration(store.url, store.options, SINGLE_COMPONENTS),
                                     **state.objects()).save(step=1)
    weights = {k: v.clone() for k, v in state.model.state_dict().items()}
    weights["0.weight"] = RunsCode(marker)
    old = checkpoint_files(store, "step_00000001", "model")
    changed: dict[str, bytes | None] = {p: None for p in old}
    changed.update({f"model/{n}": d for n, d in plain_dcp_files(weights).items()})
    rewrite_manifest(url, store.options, changed)

    fresh = TinyState.trained(4)
    before = fresh.snapshot()
    mgr = statereg.CheckpointManager(declaration(store.url, store.options, SINGLE_COMPONENTS),
                                     **fresh.objects())
    # DCP's metadata lists 0.weight as a pickled object, not a tensor: no tensor to load.
    with pytest.raises(statereg.CheckpointMismatchError, match=r"missing in checkpoint: 0\.weight"):
        mgr.load(verify="off")
    assert_identical(fresh.snapshot()["model"], before["model"])
    # strict=False loads the tensors that match and leaves 0.weight as it was.
    mgr.load(verify="off", strict=False)
    assert not marker.exists()
    assert_identical(fresh.model.state_dict()["0.weight"], before["model"]["0.weight"])
    assert_identical(fresh.model.state_dict()["0.bias"], state.model.state_dict()["0.bias"])
    entry_points(store, url, tmp_path)
    capsys.readouterr()
    assert not marker.exists()


# -- manifests that point outside the checkpoint, or lie ------------------------------------


OUTSIDE = {
    "dot-dot": "../outside.bin",
    "deep dot-dot": "model/../../outside.bin",
    "absolute": "/{root}/outside.bin",
    "url": "s3://another-bucket/outside.bin",
    "file url": "file:///{root}/outside.bin",
}


@pytest.mark.parametrize("store", BACKENDS, indirect=True)
@pytest.mark.parametrize("case", sorted(OUTSIDE))
def test_a_manifest_naming_paths_outside_the_checkpoint_is_rejected(store, case, tmp_path,
                                                                    capsys, caplog):
    state = TinyState.trained(1)
    decl = declaration(store.url, store.options, SINGLE_COMPONENTS, keep_last=1)
    statereg.CheckpointManager(decl, **state.objects()).save(step=1)
    backend = open_backend(store.url, store.options)
    backend.write_bytes("outside.bin", b"not part of any checkpoint")
    raw = json.loads(backend.read_bytes("step_00000001/manifest.json"))
    victim = OUTSIDE[case].format(root=backend.root)
    moved = raw["files"][0]["path"]
    raw["files"][0]["path"] = victim
    for comp in raw["components"].values():
        comp["files"] = [victim if p == moved else p for p in comp["files"]]
    write_manifest(backend, "step_00000001", json.dumps(raw, indent=1).encode())
    url = f"{store.url}/step_00000001"

    with pytest.raises(statereg.ManifestError, match="must"):
        statereg.verify(url, store.options)
    with pytest.raises(statereg.ManifestError, match="must"):
        statereg.CheckpointManager(decl, **TinyState.trained(3).objects()).load(url)
    with caplog.at_level(logging.WARNING, logger="statereg"):
        assert cli(["ls", store.url, "--options", json.dumps(store.options)]) == 0
    assert "no committed checkpoints" in capsys.readouterr().out
    assert "must" in caplog.text
    # Neither gc nor retention follows it: the directory is kept, the file outside too.
    found = collect_garbage(backend, delete=True, grace_s=0)
    assert [f.action.split(":")[0] for f in found] == ["keep"]
    statereg.CheckpointManager(decl, **TinyState.trained(2).objects()).save(step=2)
    assert backend.read_bytes("outside.bin") == b"not part of any checkpoint"
    assert "step_00000001/manifest.json" in store.files()


LIES = {
    "wrong type": (lambda m: m.update(step="one"), "invalid manifest field step"),
    "negative size": (lambda m: m["files"][0].update(size=-1), "files.0.size"),
    "newer major version": (lambda m: m.update(format_version="2.0"),
                            "written by a newer statereg"),
    "step of another directory": (lambda m: m.update(step=7), "the manifest says step 7"),
    "unknown field": (lambda m: m.update(run_this="rm -rf /"), "run_this"),
}


@pytest.mark.parametrize("case", sorted(LIES))
def test_a_lying_manifest_is_refused_and_resume_falls_back_to_the_last_good_one(
        tmp_path, case, caplog):
    decl = declaration(str(tmp_path), {}, SINGLE_COMPONENTS)
    for step in (1, 2):
        statereg.CheckpointManager(decl, **TinyState.trained(step).objects()).save(step=step)
    backend = open_backend(str(tmp_path))
    raw = json.loads(backend.read_bytes("step_00000002/manifest.json"))
    mutate, expected = LIES[case]
    mutate(raw)
    write_manifest(backend, "step_00000002", json.dumps(raw).encode())
    url = str(tmp_path / "step_00000002")

    with pytest.raises(statereg.ManifestError, match=expected):
        statereg.verify(url)
    state = TinyState.trained(5)
    mgr = statereg.CheckpointManager(decl, **state.objects())
    with pytest.raises(statereg.ManifestError, match=expected):
        mgr.load(url)
    with caplog.at_level(logging.WARNING, logger="statereg"):
        assert mgr.load().step == 1
    assert expected in caplog.text
    assert_identical(state.snapshot(), TinyState.trained(1).snapshot())


def test_a_manifest_over_the_size_bound_is_refused_without_reading_it_whole(tmp_path,
                                                                          monkeypatch):
    from statereg.backends.local import LocalBackend
    from statereg.schemas.manifest import MAX_MANIFEST_BYTES

    decl = declaration(str(tmp_path), {}, SINGLE_COMPONENTS)
    url = statereg.CheckpointManager(decl, **TinyState.trained(1).objects()).save(step=1)
    manifest = Path(url) / "manifest.json"
    with open(manifest, "wb") as f:  # sparse: 1 GiB that costs nothing on disk
        f.truncate(1 << 30)
    os.remove(Path(url) / "manifest.sum")
    largest: list[int] = []
    read = LocalBackend.read_bytes

    def spy(self, path, limit=None):
        data = read(self, path, limit)
        largest.append(len(data))
        return data

    monkeypatch.setattr(LocalBackend, "read_bytes", spy)
    with pytest.raises(statereg.ManifestError, match=r"over the .* byte bound"):
        statereg.read_manifest(url)
    assert max(largest) == MAX_MANIFEST_BYTES + 1


# -- secrets ---------------------------------------------------------------------------------


SECRET = "do-not-leak-4f1c2a9e7b"


def test_secrets_never_reach_plan_output_or_declaration_errors(tmp_path, capsys):
    spec = tmp_path / "statereg.yaml"
    spec.write_text(f"storage:\n  url: s3://bucket/run\n  options: {{key: AKIA-{SECRET}, "
                    f"secret: {SECRET}, token: {SECRET}}}\ncomponents:\n  model: {{kind: model}}\n")
    assert cli(["plan", str(spec)]) == 0
    assert SECRET not in capsys.readouterr().out

    wrong = [
        {"storage": [{"url": "s3://b/r", "options": {"secret": SECRET}}]},
        {"storage": {"url": "s3://b/r", "options": SECRET}},
        {"storage": {"url": "s3://b/r", "options": [SECRET]}},
        {"storage": {"url": "s3://b/r", "options": {"secret": SECRET}, "io_threads": "many"}},
        {"storage": {"url": "s3://b/r", "options": {"secret": SECRET}, "typo": 1}},
    ]
    for data in wrong:
        with pytest.raises(statereg.SpecError) as info:
            statereg.load_spec({**data, "components": {"model": {"kind": "model"}}}, environ={})
        assert SECRET not in str(info.value), str(info.value)
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text(f"storage: [{{url: s3://b/r, options: {{secret: {SECRET}}}}}]\n"
                        "components: {model: {kind: model}}\n")
    assert cli(["plan", str(bad_yaml)]) == 2
    captured = capsys.readouterr()
    assert SECRET not in captured.out + captured.err


@pytest.mark.parametrize("store", ["s3"], indirect=True)
def test_secrets_never_reach_gc_output_logs_or_files(store, tmp_path, capsys, caplog):
    caplog.set_level(logging.DEBUG)
    options = {**store.options, "secret": SECRET}
    statereg.CheckpointManager(declaration(store.url, options, SINGLE_COMPONENTS),
                               **TinyState.trained(1).objects()).save(step=1)
    open_backend(store.url, options).write_bytes("step_00000002/model/x.distcp", b"x")
    assert cli(["gc", store.url, "--grace", "0", "--delete", "--options",
                json.dumps(options)]) == 0
    dead = {**options, "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"},
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}}
    assert cli(["gc", store.url, "--options", json.dumps(dead)]) == 1
    captured = capsys.readouterr()
    assert "list failed" in captured.err
    stored = b"".join(store.fs.cat_file(store.path(p)) for p in store.files())
    for text in (captured.out, captured.err, caplog.text, stored.decode("latin-1")):
        assert SECRET not in text


# -- every file of a checkpoint, damaged every way: only statereg errors (issue 25, case 6) --

DAMAGES = ["missing", "truncated", "flipped", "garbage", "fifo", "symlink", "directory"]
MODEL_FORMATS = ["dcp", "safetensors", "torch"]


def damage_file(path: Path, how: str, outside: Path) -> None:
    data = path.read_bytes()
    path.unlink()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "flipped":
        flipped = bytearray(data)
        flipped[len(data) // 3] ^= 0x10
        path.write_bytes(bytes(flipped))
    elif how == "garbage":
        path.write_bytes(b"\x00not what statereg wrote{" * 9)
    elif how == "fifo":
        os.mkfifo(path)
    elif how == "symlink":
        outside.write_bytes(data)  # the same bytes, outside the root: still refused
        path.symlink_to(outside)
    elif how == "directory":
        path.mkdir()


def one_line_cli(argv: list[str], capsys) -> int:
    """Run the CLI: it returns an exit code (never raises) and, on failure, prints exactly one
    line to stderr that names no Python exception type."""
    code = cli(argv)
    err = capsys.readouterr().err
    assert code in (0, 1, 2), (argv, code)
    if code:
        lines = [line for line in err.splitlines() if line.startswith("statereg ")]
        assert len(lines) == 1 and "Traceback" not in err, (argv, err)
    return code


@pytest.mark.parametrize("fmt", MODEL_FORMATS)
@pytest.mark.parametrize("how", DAMAGES)
def test_every_damaged_file_gives_a_statereg_error_and_resume_falls_back(tmp_path, fmt, how,
                                                                        capsys, caplog):
    """Each file a checkpoint holds (model in every format, optimizer DCP + sidecar,
    scheduler and rng JSON, manifest and manifest.sum) x each damage: load(verify="off")
    resumes from the intact older checkpoint or raises a StateregError; a load by URL,
    inspect (the checkpoint and its model directory), verify, export-hf and gc raise nothing
    else, and the CLI prints one line and exits non-zero on failure."""
    caplog.set_level(logging.CRITICAL, logger="statereg")
    components = {**SINGLE_COMPONENTS, "model": {"kind": "model", "format": fmt}}
    template = tmp_path / "template"
    for step in (1, 2):
        statereg.CheckpointManager(declaration(str(template), {}, components),
                                   **TinyState.trained(step).objects()).save(step=step)
    victim = template / "step_00000002"
    files = sorted(str(p.relative_to(victim)) for p in victim.rglob("*") if p.is_file())
    assert len(files) >= 8
    for rel in files:
        root = tmp_path / f"root-{len(os.listdir(tmp_path))}"
        shutil.copytree(template, root, symlinks=True)
        url = str(root / "step_00000002")
        damage_file(root / "step_00000002" / rel, how, tmp_path / f"outside-{root.name}")
        decl = declaration(str(root), {}, components)
        for verify in ("off", "fast"):
            state = TinyState.trained(5)
            result = statereg.CheckpointManager(decl, **state.objects()).load(verify=verify)
            assert result is not None, (rel, verify)
            if how == "missing" and verify == "off" and result.step == 2:
                # Unchecked, a load that never needs the file (a safetensors index beside
                # its one shard) reads the rest, exactly.
                assert rel.endswith((".index.json", "manifest.sum")), rel
                assert_identical(state.snapshot(), TinyState.trained(2).snapshot())
            elif how == "missing" or verify == "fast":
                # The damaged checkpoint is passed over for the intact older one.
                assert result.step == 1 or (rel, how) == ("manifest.sum", "missing"), (
                    rel, verify, result.step)
                if result.step == 1:
                    assert_identical(state.snapshot(), TinyState.trained(1).snapshot())
            with contextlib.suppress(statereg.StateregError):
                statereg.CheckpointManager(decl, **TinyState.trained(6).objects()).load(
                    url, verify=verify)
        out = str(tmp_path / f"hf-{root.name}")
        for argv in (["inspect", url], ["inspect", url, "--json"], ["inspect", f"{url}/model"],
                     ["verify", url], ["export-hf", url, out], ["gc", str(root)],
                     ["ls", str(root)]):
            code = one_line_cli(argv, capsys)
            if argv[0] == "verify":
                assert code != 0 or (rel == "manifest.sum" and how == "missing"), (rel, code)
            if argv[0] in ("gc", "ls"):  # one damaged checkpoint never fails the whole root
                assert code == 0, (rel, argv)
        assert (root / "step_00000001" / "manifest.json").exists()
