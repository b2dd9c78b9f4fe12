"""benchmarks/suite.py: a quick run of three sections writes the result the docs describe.

Only the shape of the result is checked (sections, rows, targets, the markdown table), never
a timing: the machines that run the tests are shared and noisy.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

ROW_FIELDS = {"label", "seconds", "median_s", "min_s", "max_s", "bytes", "gb_per_s",
              "peak_rss_gb"}
EXPECTED_ROWS = {
    "floor": {"write_buffered", "write_direct", "read_cold", "memcpy", "memcpy_1thread"},
    "statereg": {"save", "load", "async_thread_stall", "async_thread_total",
                 "async_thread_first_stall", "async_thread_early_stall",
                 "async_thread_early_total"},
    "compression": {f"{what}_{dtype}" for dtype in ("fp32", "bf16") for what in (
        "statereg_save", "statereg_load", "dcp_zstd_save", "dcp_zstd_load")},
}


def test_quick_suite_writes_json_and_markdown(tmp_path: Path) -> None:
    out = tmp_path / "results"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "suite.py"), "--quick",
         "--only", "floor,statereg,compression", "--out", str(out), "--dir", str(tmp_path),
         "--zipnn-python", "none", "--keep-page-cache"],
        capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]

    result = json.loads((out / "suite.json").read_text())
    assert {"command", "config", "machine", "page_cache_dropped", "states", "sections",
            "targets", "elapsed_s"} <= set(result)
    assert set(result["states"]) == {"fp32", "bf16"}
    assert list(result["sections"]) == ["floor", "statereg", "compression"]
    for name, expected in EXPECTED_ROWS.items():
        rows = result["sections"][name]["rows"]
        assert expected <= set(rows), f"{name}: missing {expected - set(rows)}"
        for row in rows.values():
            assert set(row) >= ROW_FIELDS
            assert len(row["seconds"]) == 1  # --quick: one repetition
    ratios = result["sections"]["compression"]["data"]["ratios"]
    for dtype in ("fp32", "bf16"):
        for kind in ("weights", "exp_avg", "exp_avg_sq", "all"):
            assert ratios[dtype][kind]["statereg"] > 1.0
            assert ratios[dtype][kind]["dcp_zstd"] > 1.0
    assert "skipped" in result["sections"]["compression"]["data"]["zipnn"]

    targets = {t["target"]: t for t in result["targets"]}
    assert len(targets) == len(result["targets"])
    assert targets["load ≥ 1.0x cold raw read"]["met"] in (True, False)
    unmeasured = [t for t in result["targets"] if t["met"] is None]
    assert unmeasured and all(t["note"].startswith("not measured") for t in unmeasured)

    table = (out / "suite.md").read_text()
    assert "### Targets" in table and "### compression" in table
