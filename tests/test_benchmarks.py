"""Every benchmark under benchmarks/ runs at its smallest size, so that a rename or a changed
signature in statereg fails here, not at the next measurement (benchmarks/README.md lists them).

Each test runs one script as `python benchmarks/<script> --quick ...` would, and checks what it
writes: the JSON fields, the rows it promises and the figures that are not timings (bytes
read, collective counts, ratios above 1). Never a timing: the machines are shared and noisy.
No test drops the machine's page cache (--keep-page-cache, --evict-only).

The single-process scripts run inside this process (runpy), one after another: importing torch
and torch.distributed.checkpoint costs about 5 s of CPU, which a subprocess per script would
pay a dozen times. The scripts that start gloo ranks run as subprocesses; their ranks fork from
one forkserver that imported torch once.
"""

from __future__ import annotations

import gc
import json
import os
import re
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"

ROW_FIELDS = {"label", "seconds", "median_s", "min_s", "max_s", "bytes", "gb_per_s",
              "peak_rss_gb"}
SUITE_ROWS = {
    "floor": {"write_buffered", "write_direct", "read_cold", "memcpy", "memcpy_1thread"},
    "peers": {"torch_save", "torch_load", "safetensors_save", "safetensors_load",
              "dcp_save_t1", "dcp_save_t2", "dcp_load"},
    "statereg": {"save", "load", "async_thread_stall", "async_thread_total",
                 "async_thread_first_stall", "async_thread_early_stall",
                 "async_thread_early_first_stall", "async_thread_early_total"},
    "compression": {f"{what}_{dtype}" for dtype in ("fp32", "bf16") for what in (
        "statereg_save", "statereg_load", "dcp_zstd_save", "dcp_zstd_load")},
    "backends": {f"{store}_{what}" for store in ("local", "memory", "s3", "gcs")
                 for what in ("raw_put", "raw_get", "save", "load")}
    | {"s3_save_zstd", "s3_load_zstd"},
    "scale": {"save_100", "save_1000", "load_100", "load_1000"},
    "ranks": {"save_w1", "load_w1"},
    "save_load": {"dcp_save_t1", "dcp_save_t2", "statereg_save", "dcp_load", "statereg_load"},
    "ratios": set(),
}


def run_here(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], cwd: Path,
             script: str, *argv: str) -> str:
    """Run `python benchmarks/<script> argv` (a module: `-m name`) in this process, from `cwd`;
    its stdout. Fails on a non-zero exit; environment variables, torch's thread count and
    whether the cyclic collector runs are restored after it (scripts set them for themselves:
    bench_scale.py turns the collector off, which left it off for every later test of this
    process, e.g. test_save_load's check that a save turns it back on)."""
    monkeypatch.chdir(cwd)
    monkeypatch.syspath_prepend(str(BENCH))  # as `python script.py` puts its folder first
    environ, threads, collecting = dict(os.environ), torch.get_num_threads(), gc.isenabled()
    capsys.readouterr()
    try:
        if script == "-m":
            monkeypatch.setattr(sys, "argv", [argv[0], *argv[1:]])
            runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
        else:
            monkeypatch.setattr(sys, "argv", [str(BENCH / script), *argv])
            runpy.run_path(str(BENCH / script), run_name="__main__")
    except SystemExit as exit_:
        assert exit_.code in (0, None), f"{script} exited {exit_.code}: " \
                                        f"{capsys.readouterr().err[-3000:]}"
    finally:
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(threads)
        if collecting:
            gc.enable()
    return capsys.readouterr().out


def run_apart(script: str, *argv: str, timeout: float = 240) -> str:
    """Run `python benchmarks/<script> argv` as a subprocess; its stdout."""
    done = subprocess.run([sys.executable, str(BENCH / script), *argv], capture_output=True,
                          text=True, timeout=timeout, cwd=BENCH)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_suite_quick_runs_every_scenario_and_writes_json_and_markdown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """benchmarks/suite.py --quick with every section and named scenario (the S3 and GCS
    servers are started by the suite; ranks at world size 1 through torch.distributed.run)."""
    out = tmp_path / "results"
    scenarios = ",".join(SUITE_ROWS)
    run_here(monkeypatch, capsys, tmp_path, "suite.py", "--quick", "--only", scenarios,
             "--out", str(out), "--dir", str(tmp_path), "--zipnn-python", "none",
             "--keep-page-cache", "--world-sizes", "1")

    result = json.loads((out / "suite.json").read_text())
    assert {"command", "config", "machine", "page_cache_dropped", "states", "sections",
            "targets", "elapsed_s"} <= set(result)
    assert result["page_cache_dropped"] is False
    assert set(result["states"]) == {"fp32", "bf16", "object-store"}
    sections = result["sections"]
    assert list(sections) == list(SUITE_ROWS)
    for name, expected in SUITE_ROWS.items():
        assert "error" not in sections[name], (name, sections[name].get("error"))
        rows = sections[name]["rows"]
        assert set(rows) == expected, f"{name}: {set(rows) ^ expected}"
        for row in rows.values():
            assert set(row) >= ROW_FIELDS
            assert len(row["seconds"]) == 1  # --quick: one repetition
    ratios = sections["compression"]["data"]["ratios"]
    for dtype in ("fp32", "bf16"):
        for kind in ("weights", "exp_avg", "exp_avg_sq", "all"):
            assert ratios[dtype][kind]["statereg"] > 1.0
            assert ratios[dtype][kind]["dcp_zstd"] > 1.0
    assert "skipped" in sections["compression"]["data"]["zipnn"]
    for count in ("100", "1000"):  # every timed library function was called by the saves
        spent = sections["scale"]["data"]["breakdown"][count]["per_save_s"]
        assert set(spent) == {"plan", "manifest", "checksums"}
    save_load = sections["save_load"]["data"]
    # A weight, its AdamW step and two moments per layer.
    assert save_load["state"]["tensors"] == 4 * save_load["state"]["layers"]
    assert save_load["save_ratio"] > 0 and save_load["load_ratio"] > 0
    stand_ins = sections["ratios"]["data"]["ratios"]
    assert len(stand_ins) == 6 and sections["ratios"]["data"]["zipnn"] == "not installed"
    for entry in stand_ins.values():
        assert entry["statereg"] > entry["zstd"] > 1.0 and entry["zipnn"] is None

    targets = {t["target"]: t for t in result["targets"]}
    assert len(targets) == len(result["targets"])
    # The target is evaluated on this run's medians: read_cold's time over statereg's load's.
    load = targets["load ≥ 1.0x cold raw read"]
    times_faster = (sections["floor"]["rows"]["read_cold"]["median_s"]
                    / sections["statereg"]["rows"]["load"]["median_s"])
    assert (load["value"], load["bar"], load["op"]) == (round(times_faster, 3), 1.0, ">=")
    assert load["met"] is (times_faster >= 1.0)
    unmeasured = [t for t in result["targets"] if t["met"] is None]
    assert unmeasured and all(t["note"].startswith("not measured") for t in unmeasured)

    table = (out / "suite.md").read_text()
    for name in SUITE_ROWS:
        assert f"\n### {name} (" in table
    assert "### Targets" in table
    assert "statereg save speed / best plain DCP save: " in table
    assert "| fp32 Adam exp_avg_sq | " in table


def test_suite_refuses_an_unknown_scenario(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(AssertionError, match="exited 2"):
        run_here(monkeypatch, capsys, tmp_path, "suite.py", "--quick", "--only", "nope")
    assert not (tmp_path / "suite-results").exists()


def test_bench_tiers_measures_every_row_and_restores_from_memory_reading_no_durable_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """benchmarks/bench_tiers.py --quick: a tiny state, one repetition, no S3 server (the S3
    rows run the same code against another root); the memory restore must read 0 bytes from
    storage.url whatever the timings."""
    out = tmp_path / "tiers.json"
    shm = tmp_path / "shm"
    shm.mkdir()
    stdout = run_here(monkeypatch, capsys, tmp_path, "bench_tiers.py", "--quick",
                      "--shm", str(shm), "--dir", str(tmp_path), "--out", str(out))
    result = json.loads(out.read_text())
    assert set(result["rows"]) == {
        "memory_copy", "memory_save", "memory_save_async_stall", "memory_save_async_committed",
        "disk_save", "restore_memory", "restore_floor", "restore_disk_cold",
        "drain_local", "cp_local", "memory_save_draining_local", "train_no_checkpoint",
        "train_memory_every", "train_memory_every_async"}
    assert all(len(row["seconds"]) == 1 for row in result["rows"].values())
    summary = result["summary"]
    assert summary["durable_bytes_read_in_memory_restore"] == 0
    assert summary["durable_reads_in_memory_restore"] == 0
    # steps lost = every / 2 + restore seconds / seconds per step (benchmarks/bench_tiers.py)
    step_s = result["rows"]["train_no_checkpoint"]["median_s"] / 2
    assert summary["steps_lost_memory"] == pytest.approx(
        0.5 + result["rows"]["restore_memory"]["median_s"] / step_s, rel=0.01)
    assert summary["steps_lost_durable_restores_from"] == "disk_cold"
    assert list(shm.iterdir()) == []  # the bench leaves nothing in the tmpfs
    assert "| restore_memory |" in stdout


def test_bench_scale_quick_prints_growth_exponents_and_the_100k_tensor_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """benchmarks/bench_scale.py --quick (8..64 simulated ranks, real planner and commit code):
    the first save, the later save and the load each carry every figure's growth exponent;
    the collectives per rank are constant and those the engine calls (12 for a first save of
    two DCP components, 4 for a later one: tests/distributed/test_save_coordination.py counts
    the real calls); a later save's storage requests and what a rank other than 0 receives
    grow no faster than the rank count; the manifest of a 4,096-rank, 100k-tensor checkpoint
    is built and parsed."""
    stdout = run_here(monkeypatch, capsys, tmp_path, "bench_scale.py", "--quick")
    lines = stdout.splitlines()
    headers = [line for line in lines if line.startswith("| figure |")]
    assert headers == ["| figure | 8 | 16 | 32 | 64 | exponent | c |"] * 3

    def row(label: str) -> list[list[str]]:
        return [line.strip("| ").split(" | ") for line in lines
                if line.startswith(f"| {label} |")]

    per_rank = row("collectives per rank")
    assert [cells[1:5] for cells in per_rank] == [["12"] * 4, ["4"] * 4, ["26"] * 4]
    assert all(cells[5] == "0.00" for cells in per_rank)
    for label in ("storage requests (job)", "coordination bytes into another rank"):
        assert all(float(cells[5]) <= 1.1 for cells in row(label)), (label, row(label))
    manifest = re.search(r"manifest of a 4096-rank, 100000-tensor checkpoint \((\d+) files\): "
                         r"(\d+) bytes, parsed in ([\d.]+) s; with 100000 incremental digests: "
                         r"(\d+) bytes, parsed in ([\d.]+) s", stdout)
    assert manifest, stdout[-2000:]
    # Four files per rank (two DCP data files, dataloader, rng) and four written once.
    assert int(manifest.group(1)) == 4 * 4096 + 4
    assert int(manifest.group(4)) > int(manifest.group(2)) + 100_000 * 50


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="with CUDA the script runs its whole benchmark (by hand only)")
def test_gpu_benchmark_imports_and_skips_without_cuda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    # Its measurements never run here, but it imports statereg's CUDA paths (landing slices,
    # staging): a rename there must fail this test, not the next run on a GPU machine.
    stdout = run_here(monkeypatch, capsys, tmp_path, "bench_gpu.py")
    assert stdout.splitlines() == ["no GPU: skipped (no CUDA device; run this on a GPU machine)"]


def test_auto_cadence_benchmark_runs_and_reports_each_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    stdout = run_here(monkeypatch, capsys, tmp_path, "bench_auto_cadence.py", "--quick")
    results = json.loads(stdout.strip().splitlines()[-1])["results"]
    assert set(results) == {"off", "thread"}
    for row in results.values():
        assert row["steps"] > 0 and row["interval_s"] > 0 and 0 <= row["goodput"] <= 1


def test_bench_async_quick_reports_the_stall_of_each_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    stdout = run_here(monkeypatch, capsys, tmp_path, "bench_async.py", "--quick",
                      "--dir", str(tmp_path))
    lines = stdout.splitlines()
    assert lines[0].startswith("state: 0.00 GB; memory copy into preallocated buffers: median ")
    assert [line.split()[0] for line in lines[1:]] == ["off", "thread", "thread+early_return"]
    assert all("RSS after save 1 / 2 / 2: " in line for line in lines[1:])
    assert not list(tmp_path.glob("statereg-async-*"))  # each mode removes its root


def test_bench_first_save_quick_reports_the_first_and_later_stalls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    stdout = run_here(monkeypatch, capsys, tmp_path, "bench_first_save.py", "--quick")
    assert re.fullmatch(r"THP_MEM_ALLOC_ENABLE=unset; state 0\.00 GB; stall of the first save "
                        r"[\d.]+ s \(allocates the buffers\), later saves [\d.]+ s\n", stdout)


def test_bench_manifest_sizes_and_parses_a_manifest_per_item_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "manifest.json"
    run_here(monkeypatch, capsys, tmp_path, "bench_manifest.py", "--items", "1000", "2000",
             "--json", str(out))
    results = json.loads(out.read_text())
    assert [r["items"] for r in results] == [1000, 2000]
    for r in results:
        assert r["bytes"] > 50 * r["items"] and r["parse_s"] is not None
        assert r["items_at_bound"] > 100_000


def test_cold_load_quick_loads_through_every_reader_evicting_only_its_own_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    stdout = run_here(monkeypatch, capsys, tmp_path, "-m", "perfsuite.cold_load", "--quick",
                      "--dir", str(tmp_path))
    result = json.loads(stdout)
    assert result["page_cache"] == "files evicted with posix_fadvise(DONTNEED) (not drop_caches)"
    readers = {"statereg", "statereg_bypass", "torch_mmap", "safetensors", "raw_buffered",
               "raw_direct"}
    assert readers | {f"{r}_warm" for r in readers} >= set(result["median_s"]) >= readers
    assert all(len(times) == 1 for times in result["seconds"].values())
    assert len(result["ratios"]) == 6
    assert list(tmp_path.iterdir()) == []


def test_bench_coordination_quick_counts_collectives_and_bytes_read_per_rank() -> None:
    """2 gloo ranks, FSDP2: statereg's first save calls 12 collectives, a later one 4 and a
    load 19 (as bench_scale.py's ledger and docs/performance.md say); both libraries' rows."""
    stdout = run_apart("bench_coordination.py", "--quick")
    rows = {cells[1]: cells for cells in (line.strip("| ").split(" | ")
                                          for line in stdout.splitlines())
            if cells[0] == "2"}
    assert set(rows) == {"statereg", "dcp"}
    assert (rows["statereg"][6], rows["statereg"][9]) == ("12 / 4", "19")
    assert all(float(cells[12].rstrip("x")) > 0 for cells in rows.values())  # bytes were read


def test_bench_save_coordination_quick_prints_the_first_and_a_later_save() -> None:
    stdout = run_apart("bench_save_coordination.py", "--quick")
    rows = [line.strip("| ").split(" | ") for line in stdout.splitlines()
            if line.startswith("| 2 | 10 |")]
    assert [cells[2] for cells in rows] == ["first", "later"]
    assert all(int(cells[5]) > 0 and int(cells[6]) > 0 for cells in rows)


def test_bench_replica_quick_restores_from_a_peer_replica_reading_nothing_durable() -> None:
    """4 ranks as 2 nodes, moto's S3 server started by the script: the restores from the own
    node, from the peer node's replica and from S3 all happen; no durable byte is read."""
    result = json.loads(run_apart("bench_replica.py", "--quick"))
    assert result["ranks"] == 4 and result["nodes"] == 2 and result["reps"] == 1
    assert set(result["seconds"]) == {"own node", "peer replica", "S3 server"}
    assert result["bytes read from storage.url during memory restores"] == 0
    assert set(result["transport GB/s"]) == {"tmpfs", "peer over HTTP"}


def test_scale_breakdown_times_functions_a_save_calls(tmp_path: Path) -> None:
    """benchmarks/perfsuite/scale.py wraps library functions by name to split a save's time;
    each must exist where the save looks it up, and be called by one real save (a renamed or
    moved function would fail the suite's scale section, or time nothing)."""
    sys.path.insert(0, str(BENCH))
    try:
        from perfsuite.scale import Clock, instrumented

        import statereg
    finally:
        sys.path.remove(str(BENCH))
    spec = {"storage": {"url": str(tmp_path / "root")},
            "components": {"model": {"kind": "model"}}}
    mgr = statereg.CheckpointManager(spec, model=torch.nn.Linear(4, 4))
    clock = Clock()
    with instrumented(clock):
        mgr.save(step=1)
    calls = {name: len(spent) for (_, name), spent in clock.spent.items()}
    assert calls and not [name for name, count in calls.items() if count == 0], calls


def forbid_installs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail any subprocess that would run pip or make a venv (a scenario's --quick installs
    nothing)."""
    real_run = subprocess.run

    def no_install(command: list[str], *args: object, **kwargs: object) -> object:
        assert not {"pip", "venv"} & set(map(str, command)), f"tried to install: {command}"
        return real_run(command, *args, **kwargs)

    monkeypatch.setattr(subprocess, "run", no_install)


def test_field_quick_measures_the_in_process_contenders_and_reports_peers_not_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """perfsuite/field.py --quick without a peer venv: statereg, torch.save, safetensors and
    plain DCP measure every operation (loads checked bit for bit by the scenario itself); the
    peers that live in the venv, and zipnn, say how to install them; nothing is installed or
    downloaded (no pip, no venv); every target is listed, evaluated where it was measured."""
    forbid_installs(monkeypatch)
    out, venv = tmp_path / "out", tmp_path / "no-venv"
    run_here(monkeypatch, capsys, tmp_path, "-m", "perfsuite.field", "--quick", "--dir",
             str(tmp_path), "--out", str(out), "--peer-venv", str(venv))
    assert not venv.exists()
    result = json.loads((out / "field.json").read_text())
    assert {"command", "config", "machine", "page_cache", "states", "peer_venv",
            "contenders", "compression", "targets", "elapsed_s"} <= set(result)
    assert result["page_cache"].startswith("files evicted with posix_fadvise")
    contenders = result["contenders"]
    sync_loads = {"cold_load", "warm_load"}
    expected = {
        "statereg": {"save", "async_first_stall", "async_stall", "async_durable"} | sync_loads,
        "torch_save": {"save"} | sync_loads,
        "safetensors": {"save"} | sync_loads,
        "dcp": {"save_t1", "save_t2", "async_first_stall", "async_stall", "async_durable"}
        | sync_loads,
    }
    for name, ops in expected.items():
        entry = contenders[name]
        assert entry["status"] == "ok", (name, entry["status"])
        assert set(entry["rows"]) == ops, (name, set(entry["rows"]) ^ ops)
        for row in entry["rows"].values():
            assert set(row) >= ROW_FIELDS and len(row["seconds"]) == 1
        # The async checkpoint was loaded back after the loop rewrote every byte.
        assert entry["async_consistent"] is (True if "async_stall" in ops else None)
    for name in ("torch_checkpointing", "torchsnapshot", "megatron_core"):
        assert contenders[name]["status"] == "not installed: run with --install"
        assert contenders[name]["rows"] == {}
    assert result["peer_venv"]["installed_now"] is False
    assert "not installed: run with --install" in result["compression"]["zipnn"]
    for dtype in ("fp32", "bf16"):
        assert set(result["compression"]["rows"]) >= {f"statereg_save_{dtype}",
                                                       f"dcp_zstd_save_{dtype}"}
        for kind in ("weights", "exp_avg", "exp_avg_sq"):
            ratio = result["compression"]["ratios"][dtype][kind]
            assert ratio["statereg"] > 1.0 and ratio["dcp_zstd"] > 1.0
            assert ratio["zipnn"] is None

    targets = result["targets"]
    assert len(targets) == 8
    measured, unmeasured = targets[:6], targets[6:]
    assert all(t["value"] is not None and t["met"] is (
        t["value"] <= t["bar"] if t["op"] == "<=" else t["value"] >= t["bar"])
        for t in measured)
    assert all(t["met"] is None and "zipnn" in t["note"] for t in unmeasured)
    # Evaluated on this run's medians: statereg's warm load over torch.load(mmap)'s.
    warm = contenders["statereg"]["rows"]["warm_load"]["median_s"] / contenders[
        "torch_save"]["rows"]["warm_load"]["median_s"]
    assert targets[0]["value"] == round(warm, 3) and targets[0]["bar"] == 1.0

    # The floors under the loads, on statereg's own files in the same repetition.
    assert set(result["floors"]) == {"cold_direct", "cold_buffered", "warm_copy", "warm_copy_hash"}
    assert all(row["median_s"] > 0 for row in result["floors"].values())
    assert [b["value"] is not None for b in result["bounds"]] == [True] * 4
    # A cold load is held to the faster of the two raw reads of the same files.
    raw = min((result["floors"]["cold_direct"]["median_s"], "O_DIRECT"),
              (result["floors"]["cold_buffered"]["median_s"], "buffered"))
    assert result["bounds"][1]["target"].endswith(f"faster raw read ({raw[1]})")

    table = (out / "field.md").read_text()
    assert "| statereg | sync save (durable) | " in table
    assert "| torchsnapshot | torchsnapshot | " in table and "### Targets" in table
    assert not list(tmp_path.glob("statereg-field-*"))  # the work folder is removed


def test_s3_quick_measures_statereg_dcp_on_s3fs_and_boto3_on_seaweedfs_and_names_missing_peers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """perfsuite/s3.py --quick without the benchmark venv: SeaweedFS started on 127.0.0.1 and
    stopped, both shapes, statereg (sync save, cold load, async stall and commit), DCP on s3fs
    and the boto3 floor measured, every load checked bit for bit by the scenario; the peers of
    the benchmark venv (s3torchconnector, obstore) say how to install them; issue 43's bars
    are listed, evaluated where both sides were measured; nothing is installed."""
    forbid_installs(monkeypatch)
    out, venv = tmp_path / "out", tmp_path / "no-venv"
    # A --dir whose path is too long for SeaweedFS's unix sockets (107 bytes at most): the
    # scenario keeps them in a short folder of their own, removed with the server.
    work = tmp_path / ("d" * (110 - len(str(tmp_path))))
    work.mkdir()
    sockets = set(Path(tempfile.gettempdir()).glob("statereg-weed-*"))
    run_here(monkeypatch, capsys, tmp_path, "-m", "perfsuite.s3", "--quick", "--dir",
             str(work), "--out", str(out), "--bench-venv", str(venv))
    assert set(Path(tempfile.gettempdir()).glob("statereg-weed-*")) <= sockets
    assert not venv.exists()
    result = json.loads((out / "s3.json").read_text())
    assert {"command", "machine", "versions", "shapes", "load_average", "elapsed_s"} <= set(result)
    assert list(result["shapes"]) == ["large", "small"]
    for shape, found in result["shapes"].items():
        assert found["verified"] is True and found["bytes"] > 0
        contenders = found["contenders"]
        expected = {"statereg": {"save", "load", "async_stall", "async_commit",
                                 "async_first_stall"},
                    "dcp_fsspec": {"save", "load"}, "boto3": {"put", "get"}}
        for name, ops in expected.items():
            assert contenders[name]["status"] == "ok", (shape, name)
            assert set(contenders[name]["rows"]) == ops, (shape, name)
            for row in contenders[name]["rows"].values():
                assert row["median_s"] > 0 and len(row["seconds"]) == 1
        for name in ("s3torchconnector", "obstore"):
            if result["versions"][name] == "not installed: run with --install":
                assert contenders[name] == {"status": "not installed: run with --install",
                                            "rows": {}}
        assert len(found["bars"]) == 6
        windows = {b["bar"].split(":")[0]: b for b in found["bars"] if "RSS" in b["bar"]}
        assert set(windows) == {"statereg load", "statereg save"}
        for op, window in windows.items():
            row = contenders["statereg"]["rows"][op.split()[1]]
            assert window["value"] == round(row["rss_growth_gb"], 3)
        assert all(b["met"] is None if b["value"] is None else isinstance(b["met"], bool)
                   for b in found["bars"])
        save_floor = found["bars"][0]
        floor = contenders["boto3"]["rows"]["put"]["median_s"]
        if contenders.get("obstore", {}).get("rows"):
            floor = min(floor, contenders["obstore"]["rows"]["put"]["median_s"])
        assert save_floor["value"] == round(floor / contenders["statereg"]["rows"]["save"][
            "median_s"], 3)
    assert "| statereg | sync save |" in (out / "s3.md").read_text()
    assert not list(work.glob("statereg-s3-*"))  # the server's data is removed


def test_before_after_times_two_trees_in_one_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    repo = BENCH.parent
    stdout = run_here(monkeypatch, capsys, tmp_path, "before_after.py", "--before", str(repo),
                      "--after", str(repo), "--mb", "1", "--reps", "1", "--rounds", "1",
                      "--dir", str(tmp_path))
    rows = [line.split("|")[1].strip() for line in stdout.splitlines()[2:]]
    assert rows == [f"{store} {what}" for store in ("local", "local zstd", "memory://")
                    for what in ("save", "load")]


def test_bench_small_tensors_quick_reports_cpu_seconds_per_save_and_load_of_each_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    # 200 tensors into a memory:// root and a directory, each load checked bit for bit by
    # the script (a mismatch exits non-zero), one save and one load profiled.
    stdout = run_here(monkeypatch, capsys, tmp_path, "bench_small_tensors.py", "--quick",
                      "--profile", "5")
    lines = stdout.splitlines()
    assert lines[0].startswith("200 tensors, 4-64 KB")
    assert sum("profile of one save" in line for line in lines) == 2
    results = [line for line in lines if "save CPU-s median" in line]
    assert len(results) == 2 and results[0].startswith("memory://")
    assert results[1].startswith("/")  # the temporary directory
    assert all(re.search(r"load CPU-s median \d+\.\d\d", r) for r in results)
