"""`--json` on every reporting command, `verify ROOT`, and what a new user meets first: clear
errors for missing paths, warnings on the terminal, INFO lines and progress on rank 0."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from torch import nn

import statereg
from statereg.cli import main
from statereg.engine.report import progress_enabled
from statereg.schemas import json_schema


def _spec(root: Path) -> dict[str, Any]:
    return {"storage": {"url": str(root)},
            "components": {"model": {"kind": "model"}, "rng": {"kind": "rng"}}}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "ckpts"
    with statereg.CheckpointManager(_spec(root), model=nn.Linear(4, 3)) as mgr:
        for step in (5, 10, 15):
            mgr.save(step=step, tokens_seen=step * 128, extra={"loss": 10 / step})
    return root


def _damage(checkpoint: Path) -> str:
    """Flip one byte in the middle of a tensor file (its size stays): only a full read
    finds it. Returns the file's path under the checkpoint."""
    victim = next((checkpoint / "model").glob("*.distcp"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    return f"model/{victim.name}"


def _document(command: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """The one JSON document a command printed, checked against `statereg schema cli`."""
    schema = json_schema("cli")
    document = json.loads(capsys.readouterr().out)
    ref = schema["x-statereg-commands"][command]
    jsonschema.validate(document, {**schema, "anyOf": [{"$ref": ref}]})
    return document


def test_every_reporting_command_prints_one_document_its_schema_describes(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["ls", str(root), "--json"]) == 0
    ls = _document("ls", capsys)
    assert [c["step"] for c in ls["checkpoints"]] == [5, 10, 15]
    assert ls["latest"] == "step_00000015" and ls["checkpoints"][2]["latest"]
    assert ls["checkpoints"][0]["extra"] == {"loss": 2.0}
    assert ls["checkpoints"][0]["url"] == str(root / "step_00000005")

    assert main(["inspect", str(root / "step_00000010"), "--json"]) == 0
    assert _document("inspect", capsys)["step"] == 10

    assert main(["verify", str(root / "step_00000010"), "--json"]) == 0
    one = _document("verify", capsys)
    assert (one["ok"], [c["name"] for c in one["checkpoints"]]) == (True, ["step_00000010"])

    yaml_file = tmp_path / "statereg.yaml"
    yaml_file.write_text(json.dumps(_spec(root)))
    assert main(["plan", str(yaml_file), "--world-size", "2", "--json"]) == 0
    plan = _document("plan", capsys)
    assert [r["rank"] for r in plan["ranks"]] == [0, 1]
    assert {t["component"] for t in plan["ranks"][0]["tasks"]} == {"model", "rng"}

    (root / "step_00000020").mkdir()  # an interrupted save
    assert main(["gc", str(root), "--grace", "0", "--json"]) == 0
    gc = _document("gc", capsys)
    assert [(x["path"], x["action"]) for x in gc["leftovers"]] == [("step_00000020", "delete")]
    assert gc["delete"] is False and gc["failed"] == []

    assert main(["cp", str(root / "step_00000010"), str(tmp_path / "copy"), "--json"]) == 0
    cp = _document("cp", capsys)
    assert cp["destination"] == str(tmp_path / "copy" / "step_00000010")
    assert cp["compression"] == "keep" and cp["files"] > 0


def test_ls_json_pipes_into_a_json_reader(root: Path) -> None:
    """The acceptance line: `statereg ls --json ROOT | python -c 'json.load(sys.stdin)'`."""
    statereg_bin = str(Path(sys.executable).with_name("statereg"))
    ls = subprocess.Popen([statereg_bin, "ls", "--json", str(root)], stdout=subprocess.PIPE)
    reader = subprocess.run(
        [sys.executable, "-c", "import json,sys; print(len(json.load(sys.stdin)['checkpoints']))"],
        stdin=ls.stdout, capture_output=True, text=True)
    assert ls.wait() == 0 and reader.returncode == 0, reader.stderr
    assert reader.stdout.strip() == "3"


def test_schema_cli_names_every_command_and_the_exit_codes(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema", "cli"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert set(schema["x-statereg-commands"]) == {"ls", "inspect", "verify", "plan", "gc", "cp"}
    assert "0 ok, 1 damaged or failed" in schema["description"]
    assert "2 usage" in schema["description"]


def test_verify_root_checks_every_checkpoint_and_names_the_damaged_one(
    root: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["verify", str(root)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in out[:3]] == [
        ["ok:", f"{root / name}:"] for name in ("step_00000005", "step_00000010",
                                                "step_00000015")]
    assert out[3] == "3 checkpoint(s) verified: every size and checksum matches"

    damaged = _damage(root / "step_00000010")
    assert main(["verify", str(root)]) == 1
    captured = capsys.readouterr()
    line = next(x for x in captured.out.splitlines() if "step_00000010" in x)
    assert line.startswith(f"DAMAGED: {root / 'step_00000010'}: ") and damaged in line
    assert "1 of 3 checkpoints damaged: step_00000010" in captured.err

    assert main(["verify", str(root), "--json"]) == 1
    document = _document("verify", capsys)
    assert (document["ok"], document["damaged"]) == (False, ["step_00000010"])
    # --latest reads only the newest, which is intact; the checkpoint URL form still works.
    assert main(["verify", str(root), "--latest"]) == 0
    assert "step_00000010" not in capsys.readouterr().out
    assert main(["verify", str(root / "step_00000010")]) == 1
    assert damaged in capsys.readouterr().err


def test_verify_root_counts_a_damaged_manifest_and_refuses_an_empty_root(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    manifest = root / "step_00000015" / "manifest.json"
    manifest.write_bytes(manifest.read_bytes().replace(b'"step"', b'"stop"'))
    assert main(["verify", str(root), "--latest"]) == 1
    assert "DAMAGED: " in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    assert main(["verify", str(tmp_path / "empty")]) == 1
    assert "no committed checkpoint in" in capsys.readouterr().err


def test_ls_of_a_misspelled_root_fails_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls", str(tmp_path / "chekpoints")]) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path / 'chekpoints'} does not exist" in err and "check the path" in err
    (tmp_path / "fresh").mkdir()
    assert main(["ls", str(tmp_path / "fresh")]) == 0  # an existing empty root is fine
    assert "no committed checkpoints" in capsys.readouterr().out


def test_gc_of_a_misspelled_root_fails_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gc", str(tmp_path / "chekpoints")]) == 1
    assert f"{tmp_path / 'chekpoints'} does not exist" in capsys.readouterr().err
    assert not (tmp_path / "chekpoints").exists()


def test_inspect_of_a_missing_path_says_it_does_not_exist_not_an_interrupted_save(
    root: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["inspect", str(root / "step_00000011")]) == 1
    err = capsys.readouterr().err
    assert "does not exist: check the path" in err and f"statereg ls {root}" in err
    assert "interrupted" not in err
    (root / "step_00000011").mkdir()  # a directory without a manifest: that one was
    assert main(["inspect", str(root / "step_00000011")]) == 1
    assert "interrupted save" in capsys.readouterr().err


def test_the_command_shows_warnings_the_library_leaves_to_the_application(root: Path) -> None:
    """The package logger has only a NullHandler: a script that configured no logging sees
    nothing; the `statereg` command prints the warning (which checkpoint it skipped)."""
    victim = next((root / "step_00000015" / "model").glob("*.distcp"))
    victim.write_bytes(victim.read_bytes()[:-1])
    code = (f"import statereg; print(statereg.latest({str(root)!r}).step); "
            "import logging; print(type(logging.getLogger('statereg').handlers[0]).__name__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["10", "NullHandler"] and done.stderr == ""
    ls = subprocess.run([str(Path(sys.executable).with_name("statereg")), "ls", str(root)],
                        capture_output=True, text=True)
    assert ls.returncode == 0
    assert f"skipping {root / 'step_00000015'}" in ls.stderr


def test_export_load_and_copy_log_an_info_line_from_their_own_module(
    root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="statereg"):
        statereg.export_hf(str(root / "step_00000010"), tmp_path / "hf")
        statereg.load_model_from(tmp_path / "hf", nn.Linear(4, 3))
        main(["cp", str(root / "step_00000010"), str(tmp_path / "copy")])
    lines = {(r.name, r.getMessage().split(" ", 1)[0]) for r in caplog.records
             if r.levelno == logging.INFO}
    assert {("statereg.interop", "exporting"), ("statereg.interop", "exported"),
            ("statereg.interop", "loading"), ("statereg.interop", "loaded"),
            ("statereg.engine.transfer", "copying"),
            ("statereg.engine.transfer", "copied")} <= lines


class _Terminal:
    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize(("env", "drawn"), [
    ({}, True), ({"RANK": "0"}, True), ({"RANK": "1"}, False), ({"TQDM_DISABLE": "1"}, False),
    ({"TQDM_DISABLE": "0"}, True), ({"TQDM_DISABLE": "true", "RANK": "0"}, False),
])
def test_progress_bars_are_drawn_on_rank_0_only_and_tqdm_disable_turns_them_off(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], drawn: bool,
) -> None:
    for name in ("RANK", "TQDM_DISABLE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "stderr", _Terminal())
    assert progress_enabled() is drawn
