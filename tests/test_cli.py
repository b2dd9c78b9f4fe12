"""The `statereg` command: each subcommand on a real checkpoint, errors without tracebacks."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import statereg
from statereg.cli import main
from statereg.schemas import SCHEMA_FILES, json_schema

# This user's folder of memory roots under the shared-memory folder (backends/shm.py).
PRIVATE = f"statereg-{os.geteuid()}"

REPO = Path(__file__).resolve().parents[1]


def _spec(root: Path) -> dict:
    return {
        "storage": {"url": str(root)},
        "components": {"model": {"kind": "model"}, "rng": {"kind": "rng"}},
    }


@pytest.fixture
def committed(tmp_path: Path) -> Path:
    root = tmp_path / "ckpts"
    mgr = statereg.CheckpointManager(_spec(root), model=nn.Linear(4, 3))
    mgr.save(step=5, tokens_seen=640, extra={"loss": 1.5})
    mgr.save(step=10, tokens_seen=1280, extra={"loss": 1.25})
    return root


@pytest.mark.parametrize("which", sorted(SCHEMA_FILES))
def test_the_shipped_json_schemas_are_current_and_schema_path_names_them(
    which: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["schema", which, "--path"]) == 0
    shipped = Path(capsys.readouterr().out.strip())
    assert shipped == REPO / "statereg" / "schemas" / SCHEMA_FILES[which]
    assert json.loads(shipped.read_text()) == json_schema(which), (
        f"statereg/schemas/{SCHEMA_FILES[which]} is stale: regenerate it with "
        f"`statereg schema {which} > statereg/schemas/{SCHEMA_FILES[which]}`"
    )


def test_a_wheel_carries_the_schemas_and_py_typed(tmp_path: Path) -> None:
    """What a non-editable install has: docs/yaml-reference.md points editors at these."""
    import zipfile

    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(REPO)],
        capture_output=True, text=True, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("statereg-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"statereg/py.typed", "statereg/__main__.py",
            *(f"statereg/schemas/{name}" for name in SCHEMA_FILES.values())} <= names


def _statereg(*args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run the installed console script; stdout and stderr are captured unless given."""
    streams = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **kwargs}
    return subprocess.run([str(Path(sys.executable).with_name("statereg")), *args],
                          text=True, **streams)


def test_version_and_python_dash_m() -> None:
    by_script = _statereg("--version")
    assert by_script.returncode == 0
    assert by_script.stdout.strip() == f"statereg {statereg.__version__}"
    by_module = subprocess.run([sys.executable, "-m", "statereg", "--version"],
                               capture_output=True, text=True)
    assert by_module.returncode == 0
    assert by_module.stdout == by_script.stdout


def test_a_reader_that_goes_away_ends_the_output_without_a_traceback() -> None:
    """`statereg schema | head -1`: the pipe is closed before statereg writes a byte."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = _statereg("schema", stdout=write_end)
    finally:
        os.close(write_end)
    assert done.returncode == 141
    assert done.stderr == ""


def test_dir_lists_the_lazy_public_names() -> None:
    names = dir(statereg)
    assert {"CheckpointManager", "load_spec", "verify", "CorruptCheckpointError",
            "__version__"} <= set(names)
    assert set(statereg.__all__) <= set(names)


def test_schema_prints_the_declaration_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert set(schema["properties"]) == {"version", "storage", "components", "save", "profiles",
                                         "tiers", "restore", "on_signal"}


def test_plan_shows_each_component_writer_and_format(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    yaml_file = tmp_path / "statereg.yaml"
    yaml_file.write_text(
        "storage: {url: s3://bucket/run}\n"
        "components:\n"
        "  model: {kind: model}\n"
        "  sched: {kind: scheduler}\n"
        "  rng: {kind: rng}\n"
    )
    assert main(["plan", str(yaml_file), "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "s3://bucket/run" in out
    assert "world size: 4" in out
    # The plan of every rank, one block each; each line: component, layout, sharing,
    # collective, role, bytes, files.
    blocks = re.split(r"^rank ", out, flags=re.MULTILINE)[1:]
    assert [b.split()[0:3] for b in blocks] == [[str(r), "of", "4"] for r in range(4)]
    rows = [{line.split()[0]: line.split() for line in b.splitlines()[1:] if line.strip()}
            for b in blocks]
    assert [r["model"][1:5] for r in rows] == [["dcp/dcp", "sharded", "world", "leader"]] + \
        [["dcp/dcp", "sharded", "world", "member"]] * 3
    assert rows[0]["model"][6:] == ["model/__0_*.distcp", "model/.metadata"]
    assert rows[3]["model"][6:] == ["model/__3_*.distcp"]
    assert rows[0]["sched"][1:] == ["object_file/json", "global", "alone", "leader", "-",
                                    "sched/state.json"]
    assert rows[1]["sched"][4:] == ["-", "-", "(writes", "nothing)"]
    assert [r["rng"][-1] for r in rows] == [f"rng/rank_0000{i}.json" for i in range(4)]
    assert main(["plan", str(yaml_file), "--world-size", "4", "--rank", "2"]) == 0
    only = capsys.readouterr().out
    assert "rank 2 of 4" in only and "rank 0 of 4" not in only


def test_plan_runs_without_torch(tmp_path: Path) -> None:
    yaml_file = tmp_path / "statereg.yaml"
    yaml_file.write_text("storage: {url: ./c}\ncomponents: {model: {kind: model}}\n")
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from statereg.cli import main\n"
        f"sys.exit(main(['plan', {str(yaml_file)!r}]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "model" in done.stdout


@pytest.mark.parametrize("command", ["inspect", "verify", "ls"])
def test_inspect_verify_and_ls_run_without_torch(committed: Path, command: str) -> None:
    """They read manifests and check bytes: importing torch (seconds) would be most of
    their time on a small checkpoint."""
    target = committed if command == "ls" else committed / "step_00000010"
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from statereg.cli import main\n"
        f"sys.exit(main([{command!r}, {str(target)!r}]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "step_00000010" in done.stdout or "step:        10" in done.stdout, done.stdout


def test_invalid_yaml_is_one_clear_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    yaml_file = tmp_path / "statereg.yaml"
    yaml_file.write_text(
        "storage: {url: ./c}\ncomponents: {model: {kind: model, sharing: shard}}\n")
    assert main(["plan", str(yaml_file)]) == 2
    err = capsys.readouterr().err
    assert str(yaml_file) in err
    assert "components.model.sharing" in err and "'sharded'" in err
    assert "Traceback" not in err


def test_ls_lists_committed_checkpoints_and_marks_latest(
    committed: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (committed / "step_00000015").mkdir()  # an interrupted save: no manifest
    assert main(["ls", str(committed)]) == 0
    out = capsys.readouterr().out
    assert "step_00000005" in out
    assert "step_00000010 (latest)" in out
    assert "step_00000015" not in out


def test_inspect_reports_components_tensors_step_and_versions(
    committed: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(committed / "step_00000010")]) == 0
    out = capsys.readouterr().out
    assert "step:        10" in out
    assert "tokens_seen: 1280" in out
    assert 'extra:       {"loss": 1.25}' in out  # JSON, as `ls` prints it
    assert f"torch {torch.__version__}" in out
    model_line = next(line for line in out.splitlines() if line.startswith("model "))
    assert model_line.split()[:5] == ["model", "model", "sharded", "dcp", "2"]


def test_verify_passes_then_names_a_damaged_file(
    committed: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = str(committed / "step_00000010")
    assert main(["verify", url]) == 0
    assert "every size and checksum matches" in capsys.readouterr().out
    victim = next((committed / "step_00000010" / "model").glob("*.distcp"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert main(["verify", url]) == 1
    err = capsys.readouterr().err
    assert f"model/{victim.name}" in err and "checksum" in err


def test_console_script_is_installed() -> None:
    done = subprocess.run(
        [str(Path(sys.executable).with_name("statereg")), "--help"], capture_output=True, text=True
    )
    assert done.returncode == 0
    for command in ("plan", "schema", "ls", "inspect", "verify"):
        assert command in done.stdout


def test_plan_with_a_model_shows_bytes_each_rank_writes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "plan_models.py").write_text(
        "from torch import nn\n\ndef build():\n    return nn.Linear(1000, 1000)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yaml_file = tmp_path / "statereg.yaml"
    yaml_file.write_text("storage: {url: ./c}\ncomponents: {model: {kind: model}, "
                         "sched: {kind: scheduler}}\n")
    assert main(["plan", str(yaml_file), "--world-size", "4", "--model",
                 "plan_models:build"]) == 0
    out = capsys.readouterr().out
    model = [line for line in out.splitlines() if line.startswith("model")]
    # (1000*1000 + 1000) fp32 bytes, sharded over 4 ranks: each writes a quarter.
    assert len(model) == 4 and all("1.00 MB" in line for line in model)
    assert all(" - " in line for line in out.splitlines() if line.startswith("sched"))
    assert main(["plan", str(yaml_file), "--model", "no_such_module:build"]) == 2
    assert "no_such_module:build" in capsys.readouterr().err


def test_hostile_manifests_are_damaged_checkpoints_not_a_broken_root(
    committed: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """7 KB of nested `[` or a 5,000-digit integer once broke load, ls and gc for the root."""
    (committed / "step_00000010" / "manifest.json").write_bytes(b"[" * 3000 + b"]" * 3000)
    (committed / "step_00000020").mkdir()
    (committed / "step_00000020" / "manifest.json").write_bytes(
        b'{"step": ' + b"9" * 5000 + b"}")
    assert main(["ls", str(committed)]) == 0
    out = capsys.readouterr().out
    assert "step_00000005" in out and "step_00000010" not in out
    assert main(["gc", str(committed)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "step_000000" in line]
    assert len(rows) == 2 and all("does not parse" in row for row in rows)
    assert main(["inspect", str(committed / "step_00000020")]) == 1
    err = capsys.readouterr().err
    assert "step_00000020/manifest.json" in err and "5000 digits" in err
    assert "Traceback" not in err
    mgr = statereg.CheckpointManager(_spec(committed), model=nn.Linear(4, 3))
    assert mgr.load().step == 5


@pytest.mark.parametrize("grace", ["nan", "NaN", "inf", "-infm", "-5", "-1h"])
def test_gc_refuses_a_grace_that_is_not_a_finite_non_negative_duration(
    tmp_path: Path, grace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A NaN grace once read as 0: every leftover, even one a save was writing, looked old."""
    leftover = tmp_path / "step_00000007"
    leftover.mkdir()
    (leftover / "data.bin").write_bytes(b"x")
    assert main(["gc", str(tmp_path), f"--grace={grace}", "--delete"]) == 2
    err = capsys.readouterr().err
    assert f"--grace {grace!r} must be a finite, non-negative duration" in err
    assert (leftover / "data.bin").exists()


@contextlib.contextmanager
def _undeletable(path: Path) -> Iterator[None]:
    """Make `path` (a file) impossible to delete: read-only parent, or immutable as root."""
    if os.geteuid() != 0:
        path.parent.chmod(0o555)
        try:
            yield
        finally:
            path.parent.chmod(0o755)
        return
    chattr = shutil.which("chattr")
    if chattr is None or subprocess.run([chattr, "+i", str(path)]).returncode != 0:
        pytest.skip("running as root on a file system without chattr +i: nothing refuses a delete")
    try:
        yield
    finally:
        subprocess.run([chattr, "-i", str(path)], check=True)


def test_gc_delete_exits_non_zero_when_a_deletion_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stuck = tmp_path / "step_00000007"
    stuck.mkdir()
    (stuck / "data.bin").write_bytes(b"x" * 10)
    gone = tmp_path / "step_00000008"
    gone.mkdir()
    (gone / "data.bin").write_bytes(b"y" * 10)
    with _undeletable(stuck / "data.bin"):
        assert main(["gc", str(tmp_path), "--grace", "0", "--delete"]) == 1
    captured = capsys.readouterr()
    row = next(line for line in captured.out.splitlines() if "step_00000007" in line)
    assert "failed:" in row
    assert "1 deletions failed (step_00000007)" in captured.err
    assert not gone.exists() and (stuck / "data.bin").exists()
    assert main(["gc", str(tmp_path), "--grace", "0", "--delete"]) == 0  # now it can
    assert not stuck.exists()


@pytest.mark.parametrize("command", ["verify", "inspect", "export-hf", "cp"])
@pytest.mark.parametrize("url", ["/", "s3://", "memory://"])
def test_a_url_naming_no_checkpoint_is_refused_not_read_from_the_current_directory(
    committed: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    command: str, url: str,
) -> None:
    """`verify /` once read ./manifest.json: here the current directory is a checkpoint."""
    monkeypatch.chdir(committed / "step_00000010")
    extra = {"export-hf": ["out"], "cp": ["elsewhere"]}.get(command, [])
    with pytest.raises(SystemExit) as info:
        main([command, url, *extra])
    assert info.value.code == 2
    assert f"{url!r} names no checkpoint directory" in capsys.readouterr().err
    assert main(["verify", "."]) == 0  # '.' is the checkpoint directory it stands in
    assert f"ok: {committed / 'step_00000010'}: " in capsys.readouterr().out


@pytest.mark.parametrize("url", ["shm://run7", "s3://bucket/", "gs://bucket"])
def test_a_root_at_the_top_of_a_store_is_refused_as_no_checkpoint(
        url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`inspect shm://run7` once opened 'shm://' and said a shm:// url needs a NAME. (`verify`
    takes a root too: there a store's top is one, see the verify ROOT tests.)"""
    with pytest.raises(SystemExit) as info:
        main(["inspect", url])
    assert info.value.code == 2
    trimmed = url.rstrip("/")
    assert (f"{url!r} is a root, not a checkpoint directory in it; give one, e.g. "
            f"{trimmed}/step_00000100 (`statereg ls {trimmed}` lists them)"
            ) in capsys.readouterr().err


def test_ls_without_root_lists_the_spec_storage_url(
    committed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    yaml_file = tmp_path / "statereg.yaml"
    yaml_file.write_text(json.dumps(_spec(committed)))  # JSON is YAML
    assert main(["ls", "--spec", str(yaml_file)]) == 0
    out = capsys.readouterr().out
    assert "step_00000005" in out and "step_00000010 (latest)" in out
    assert main(["ls"]) == 2
    assert "give ROOT, or --spec statereg.yaml" in capsys.readouterr().err


@pytest.fixture
def no_aws_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default AWS credential chain finds nothing, fast (no metadata service probe)."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                 "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))


def test_an_s3_failure_without_options_points_at_spec_and_aws_endpoint_url(
    no_aws_credentials: None, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("s3fs")
    assert main(["ls", "s3://statereg-no-such-bucket/run"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("statereg ls: error: ") and "s3://statereg-no-such-bucket/run" in err
    assert "no --spec or --options was given" in err and "AWS_ENDPOINT_URL" in err
    assert main(["ls", "s3://statereg-no-such-bucket/run", "--options", '{"anon": false}']) == 1
    assert "no --spec or --options was given" not in capsys.readouterr().err


def test_plan_model_imports_from_the_current_directory_like_python_dash_m(
    tmp_path: Path,
) -> None:
    (tmp_path / "my_models.py").write_text(
        "from torch import nn\n\ndef build():\n    return nn.Linear(10, 10)\n")
    (tmp_path / "statereg.yaml").write_text(
        "storage: {url: ./c}\ncomponents: {model: {kind: model}}\n")
    done = _statereg("plan", "statereg.yaml", "--model", "my_models:build", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    missing = _statereg("plan", "statereg.yaml", "--model", "not_here:build", cwd=tmp_path)
    assert missing.returncode == 2
    assert "No module named 'not_here'" in missing.stderr
    assert f"the module in the current directory ({tmp_path})" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_cp_into_a_root_that_has_the_checkpoint_says_cp_never_overwrites(
    committed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = str(committed / "step_00000010")
    other = tmp_path / "copies"
    assert main(["cp", src, str(other)]) == 0
    before = (other / "step_00000010" / "manifest.json").read_bytes()
    capsys.readouterr()
    assert main(["cp", src, str(other)]) == 1
    err = capsys.readouterr().err
    assert f"{other / 'step_00000010'} already exists: cp never overwrites a checkpoint" in err
    assert "save a different step" not in err
    assert (other / "step_00000010" / "manifest.json").read_bytes() == before


_TIERS_YAML = (
    "storage: {{url: {durable}}}\n"
    "components: {{model: {{kind: model}}, optimizer: {{kind: optimizer}}, rng: {{kind: rng}}}}\n"
    "tiers:\n"
    "  memory: {{every: 5, keep_last: 2, drain: skip}}\n"
    "  durable: {{every: 10, keep_last: 3, keep_every: 100}}\n"
)


def test_plan_with_tiers_shows_each_tier_and_the_memory_math(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STATEREG_SHM_DIR", str(tmp_path))
    monkeypatch.setenv("STATEREG_RUN_ID", "run7")
    yaml_file = tmp_path / "statereg.yaml"
    yaml_file.write_text(_TIERS_YAML.format(durable="s3://bucket/run7"))
    assert main(["plan", str(yaml_file), "--world-size", "4", "--nodes", "2",
                 "--state-bytes", "1GB"]) == 0
    out = capsys.readouterr().out
    assert ("  memory:   shm://{run_id} = shm://run7  every 5 steps, keep_last 2, drain: skip"
            in out)
    assert "  durable:  s3://bucket/run7  every 10 steps, keep_last 3, keep_every 100" in out
    # 1 GB over 2 nodes: 500 MB each, plus 16 MiB (16.78 MB) of small files; 3 copies.
    assert "memory per node (2 nodes; the fullest):" in out
    assert "  one checkpoint:  516.78 MB = 500.00 MB (--state-bytes) + 16.78 MB" in out
    assert "  memory tier:     (keep_last 2 + 1) x 516.78 MB = 1.55 GB" in out
    assert "  peer replica:    not declared" in out
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    tmpfs = next(line for line in out.splitlines() if line.startswith("  tmpfs here:"))
    assert tmpfs.startswith(f"  tmpfs here:      {tmp_path} has ") and tmpfs.endswith(": fits")
    assert float(tmpfs.split(" has ")[1].split()[0]) == pytest.approx(free / 1e9, rel=0.05)

    assert main(["plan", str(yaml_file), "--state-bytes", "1PB"]) == 2
    assert "--state-bytes: size '1PB' is not a size" in capsys.readouterr().err
    assert main(["plan", str(yaml_file), "--state-bytes", "900000GB"]) == 0
    assert "does NOT fit (short by " in capsys.readouterr().out
    assert main(["plan", str(yaml_file), "--world-size", "3", "--nodes", "2"]) == 2
    assert "--nodes 2: give a divisor of --world-size 3" in capsys.readouterr().err


def test_plan_with_tiers_and_a_model_counts_what_it_measured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STATEREG_SHM_DIR", str(tmp_path / "no-such-tmpfs"))
    (tmp_path / "tier_models.py").write_text(
        "from torch import nn\n\ndef build():\n    return nn.Linear(1000, 1000)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yaml_file = tmp_path / "statereg.yaml"
    yaml_file.write_text(_TIERS_YAML.format(durable="./c"))
    assert main(["plan", str(yaml_file), "--world-size", "2", "--rank", "1",
                 "--model", "tier_models:build"]) == 0
    out = capsys.readouterr().out
    assert "rank 0 of 2" not in out  # --rank shows one plan; the math still counts every rank
    # (1000*1000 + 1000) fp32 = 4.00 MB over both ranks, plus 16 MiB of small files.
    assert "  one checkpoint:  20.78 MB = 4.00 MB (measured: model) + 16.78 MB" in out
    assert "not counted: optimizer (not measured; --state-bytes gives the whole state)" in out
    assert "  memory tier:     (keep_last 2 + 1) x 20.78 MB = 62.34 MB" in out
    assert f"{tmp_path / 'no-such-tmpfs'} does not exist on this machine" in out
    assert main(["plan", str(yaml_file)]) == 0
    assert "one checkpoint:  not measured: give --model" in capsys.readouterr().out


def test_the_cli_run_id_is_the_tier_engine_run_id(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's report (torch-free) and the tier engine (which imports torch) name the same
    run folder, or `statereg ls` would look in another run's memory folder."""
    from statereg.tiers import engine as tiers
    from statereg.tiers import identity as tier_report

    spec = statereg.load_spec(_spec(Path("/tmp/some-run")) | {"tiers": {}})
    monkeypatch.delenv("STATEREG_RUN_ID", raising=False)
    assert tier_report.run_id(spec) == tiers.run_id(spec)
    assert tier_report.run_id(spec).startswith("run-")
    monkeypatch.setenv("STATEREG_RUN_ID", "job 7/a")
    assert tier_report.run_id(spec) == tiers.run_id(spec) == "job_7_a"


def test_ls_with_tiers_shows_where_each_step_lives_without_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("STATEREG_SHM_DIR", str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    monkeypatch.setenv("STATEREG_RUN_ID", "lsrun")
    durable = tmp_path / "durable"
    yaml_file = tmp_path / "statereg.yaml"
    yaml_file.write_text(_TIERS_YAML.format(durable=durable).replace("skip", "wait"))
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    with statereg.CheckpointManager(statereg.load_spec(yaml_file), model=model,
                                    optimizer=optimizer) as mgr:
        for step in range(1, 26):
            mgr.save(step)  # memory keeps 20, 25; durable has 10, 20
    memory = next((tmp_path / "shm" / PRIVATE).glob("*/lsrun/ws1-*"))
    (memory / "step_00000030").mkdir()  # a memory save that was killed before its manifest
    (durable / "step_00000040").mkdir()  # a drain that was killed before its manifest
    victim = next((memory / "step_00000025" / "model").glob("*.distcp"))
    victim.write_bytes(victim.read_bytes()[:-1])  # one byte short: restore would skip it

    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from statereg.cli import main\n"
        f"sys.exit(main(['ls', '--spec', {str(yaml_file)!r}]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"memory (this node): shm://lsrun/{memory.name} ({memory})"
    assert lines[1] == f"durable:            {durable}"
    rows = {line.split()[0]: line.split()[1:3] for line in lines[4:]}
    assert lines[3].split() == ["step", "memory", "durable", "size"]
    assert rows == {"10": ["absent", "committed"], "20": ["committed", "committed"],
                    "25": ["damaged", "absent"], "30": ["incomplete", "absent"],
                    "40": ["absent", "incomplete"]}

    assert main(["ls", str(durable), "--memory", "shm://lsrun"]) == 0
    assert capsys.readouterr().out.splitlines()[4:] == lines[4:]
    assert main(["ls", str(durable), "--memory", "shm://lsrun", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["memory"]["roots"] == [f"shm://lsrun/{memory.name}"]
    assert {s["step"]: [*s["memory"], s["durable"]] for s in document["memory"]["steps"]} == {
        10: ["absent", "committed"], 20: ["committed", "committed"],
        25: ["damaged", "absent"], 30: ["incomplete", "absent"], 40: ["absent", "incomplete"]}
    assert [c["step"] for c in document["checkpoints"]] == [10, 20]
    assert main(["ls", str(durable), "--memory", str(memory)]) == 2
    assert f"--memory {str(memory)!r}: give a shm://NAME URL" in capsys.readouterr().err
    assert main(["ls", str(durable)]) == 0  # no tiers named: the listing of before tiers
    assert "step_00000020 (latest)" in capsys.readouterr().out
    # The run's folder holds identity folders, not checkpoints: ls says which to list.
    assert main(["ls", "shm://lsrun"]) == 0
    assert capsys.readouterr().out == (
        "no committed checkpoints in shm://lsrun; it holds the memory checkpoints of 1 job "
        f"identity: list one with `statereg ls shm://lsrun/{memory.name}`, or every tier "
        "with `statereg ls --spec SPEC ROOT`\n")
    assert main(["ls", f"shm://lsrun/{memory.name}"]) == 0
    assert "step_00000020 " in capsys.readouterr().out
    assert main(["verify", f"shm://lsrun/{memory.name}/step_00000020"]) == 0
    assert "ok: shm://lsrun/" in capsys.readouterr().out


def test_plan_counts_the_peer_replica_when_one_is_declared(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STATEREG_SHM_DIR", str(tmp_path))
    yaml_file = tmp_path / "statereg.yaml"
    yaml_file.write_text(_TIERS_YAML.format(durable="./c").replace(
        "drain: skip", "drain: skip, replicate: {to: next_node}"))
    assert main(["plan", str(yaml_file), "--world-size", "4", "--nodes", "2",
                 "--state-bytes", "1GB"]) == 0
    out = capsys.readouterr().out
    # Each node holds its own 3 copies and 3 of its peer's: 2 x 1.55 GB.
    assert "  memory tier:     (keep_last 2 + 1) x 516.78 MB = 1.55 GB" in out
    assert "  peer replica:    (keep_last 2 + 1) x 516.78 MB = 1.55 GB (to: next_node)" in out
    assert "  total per node:  3.10 GB" in out
    assert main(["plan", str(yaml_file), "--state-bytes", "1GB"]) == 0
    assert "peer replica:    to: next_node (one node: no peer to hold it; give --nodes)" in \
        capsys.readouterr().out


@pytest.mark.parametrize("config", ["missing.json", "a-directory", "a-fifo"])
def test_export_hf_refuses_a_bad_config_before_writing_any_shard(
        committed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], config: str) -> None:
    """Issue 25, case 6(e): a missing or non-file --config once raised a traceback after the
    shards were written."""
    (tmp_path / "a-directory").mkdir()
    os.mkfifo(tmp_path / "a-fifo")
    out = tmp_path / "hf-out"
    code = main(["export-hf", str(committed / "step_00000010"), str(out), "--config",
                 str(tmp_path / config)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("statereg export-hf: error: --config ")
    assert str(tmp_path / config) in err
    assert not out.exists() or not any(out.iterdir())
