"""Every complete Python example in README.md and docs/ runs as written.

A block counts as complete when it imports statereg; shorter fragments are illustrations.
A block whose first line says `run with: torchrun --nproc-per-node N` runs on N real ranks.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def _examples() -> list[tuple[str, str]]:
    found = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("**/*.md"))]:
        if not doc.exists():
            continue
        for i, code in enumerate(_BLOCK.findall(doc.read_text())):
            if "import statereg" in code:
                found.append((f"{doc.relative_to(REPO)}#{i}", code))
    return found


EXAMPLES = _examples()


def test_docs_have_runnable_examples() -> None:
    assert len(EXAMPLES) >= 5


SHM = Path("/dev/shm")


def _shm_folders() -> set[str]:
    """The folders in /dev/shm (files there are other programs' semaphores and segments)."""
    return {e.name for e in SHM.iterdir() if e.is_dir()} if SHM.is_dir() else set()


@pytest.mark.parametrize(("where", "code"), EXAMPLES, ids=[w for w, _ in EXAMPLES])
def test_example_runs(where: str, code: str, tmp_path: Path) -> None:
    """Each example runs, and leaves no folder in /dev/shm: tmpfs is RAM until deleted, so
    an example that forgot its memory tier would teach readers to leak it. Its other
    temporary folders land under tmp_path ($TMPDIR), which pytest removes."""
    before = _shm_folders()
    launch = re.search(r"run with: torchrun --nproc-per-node (\d+)", code.splitlines()[0])
    if launch:
        script = tmp_path / "example.py"
        script.write_text(code)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", launch.group(1), str(script)]
    else:
        command = [sys.executable, "-c", code]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, f"{where} failed:\n{done.stderr[-3000:]}"
    left = sorted(_shm_folders() - before)
    assert not left, f"{where} left {', '.join(str(SHM / n) for n in left)} in shared memory"


def test_the_sharing_table_in_the_docs_is_the_one_the_schema_enforces() -> None:
    from statereg.schemas.sharing import render_table

    assert render_table() in (REPO / "docs" / "distributed.md").read_text()
