"""The stateful zoo as a differential test: every cell of tests/state/zoo.py's table resumes
bit for bit (training losses, eval losses and the final state digest, on every rank) or is
refused by statereg with an error naming the offending key, before anything is committed.

CI runs a sample (every row once in the bare loop, and a few distributed cells); the whole
table runs with STATEREG_ZOO=full (scripts/zoo_full.sh). Cells whose outcome is wrong on
today's statereg are strict xfails that name the defect (issue 40).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zoo

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from harness import run_ranks

FULL = os.environ.get("STATEREG_ZOO", "").lower() == "full"


def _param(cell: tuple[str, str, str]) -> Any:
    name, loop, kill = cell
    defect = zoo.BY_NAME[name].defect(loop, kill)
    marks = [pytest.mark.xfail(strict=True, reason=defect)] if defect else []
    if loop != "bare":  # ranks with loader workers on a busy machine take minutes
        marks.append(pytest.mark.timeout(900))
    return pytest.param(name, loop, kill, marks=marks, id=f"{name}-{loop}-{kill}")


CELLS = [_param(cell) for cell in (zoo.all_cells() if FULL else zoo.ci_cells())]


def _restored_step(kill: zoo.Kill) -> int | None:
    """The step of the last save before B died (None: it died before the first)."""
    done = kill.at - 1 if kill.mid_accumulation else kill.at
    return done // kill.every * kill.every or None


def _differences(a: dict[str, str], b: dict[str, str]) -> list[str]:
    keys = sorted(set(a) | set(b))
    return [f"{k}: {a.get(k, '<absent>')} != {b.get(k, '<absent>')}" for k in keys
            if a.get(k) != b.get(k)]


def judge(row: zoo.Row, loop: str, kill: zoo.Kill, results: list[dict[str, Any]]) -> None:
    """Every rank's resume is exact, or every rank got the expected statereg refusal."""
    refusal = row.expected(loop)
    for rank, result in enumerate(results):
        error = result["error"]
        where = f"rank {rank}"
        if refusal is None:
            assert error is None, (f"{where}: {error['phase']} raised {error['type']}: "
                                   f"{error['message']}\n{error['traceback']}")
            assert result["restored"] == _restored_step(kill), where
            a, b = result["a"], result["b"]
            for part in ("losses", "evals", "digest"):
                differing = _differences(a[part], b[part])
                assert not differing, (f"{where}: {len(differing)} {part} differ from the "
                                       "uninterrupted run's:\n" + "\n".join(differing[:12]))
        else:
            assert error is not None, (f"{where}: expected a statereg refusal naming "
                                       f"{refusal}, but the save and the resume went through")
            assert error["statereg"], (f"{where}: {error['phase']} raised {error['type']}, not "
                                       f"a statereg error: {error['message']}\n"
                                       f"{error['traceback']}")
            assert refusal in error["message"], f"{where}: {error['message']}"
            assert error["phase"] in ("construct", "train-and-save", "resume-and-save"), (
                f"{where}: refused only at {error['phase']}: {error['message']}")
            committed = [f for f in result["files"] if f.endswith("manifest.json")]
            assert not committed, f"{where}: the refused declaration committed {committed}"


def _compile_runs() -> bool:
    try:
        return bool(torch.compile(lambda t: t + 1, backend="aot_eager")(torch.ones(1)) == 2)
    except Exception:
        return False


@pytest.fixture
def root(tmp_path: Path) -> Iterator[str]:
    """The checkpoint root: in memory-backed /dev/shm where there is one. Each cell commits
    up to five checkpoints, and a local commit fsyncs every file and directory (a second per
    cell on a busy disk); the zoo tests what state comes back, not durability, which
    tests/reliability covers."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield str(tmp_path / "ckpt")
        return
    folder = tempfile.mkdtemp(prefix="statereg-zoo-", dir=shm)
    try:
        yield f"{folder}/ckpt"
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize(("name", "loop", "kill"), CELLS)
def test_zoo_cell(name: str, loop: str, kill: str, root: str, tmp_path: Path) -> None:
    row = zoo.BY_NAME[name]
    if row.trainee is zoo.Compiled and not _compile_runs():
        pytest.skip("torch.compile cannot run on this machine")
    if loop == "bare":
        results = [zoo.run_cell(name, kill, zoo.Place("bare"), root)]
    else:
        out = tmp_path / "out"
        out.mkdir()
        world = zoo.LOOP_WORLD[loop]
        run_ranks(world, zoo.run_ranks_cell, tmp_path, name, kill, loop, root, str(out))
        results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    judge(row, loop, zoo.KILLS[kill], results)


def test_the_table_is_the_zoo_issue_40_asks_for() -> None:
    """At least 30 kinds, every loop and kill point present, and the CI sample covers every
    row that runs in the bare loop."""
    assert len(zoo.ROWS) >= 30
    cells = zoo.all_cells()
    assert {loop for _, loop, _ in cells} == set(zoo.LOOP_WORLD)
    assert {kill for _, _, kill in cells} == set(zoo.KILLS)
    sampled = {name for name, loop, _ in zoo.ci_cells() if loop == "bare"}
    assert sampled == {row.name for row in zoo.ROWS if "bare" in row.loops}
    assert set(zoo.SAMPLED_DISTRIBUTED) <= set(cells)
