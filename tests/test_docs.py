"""Every complete Python example in README.md and docs/ runs as written.

A block counts as complete when it imports statereg; shorter fragments are illustrations.
A block whose first line says `run with: torchrun --nproc-per-node N` runs on N real ranks.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
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


def _left_in(folder: Path) -> list[str]:
    """Everything under `folder`, files and folders, as paths relative to it."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize(("where", "code"), EXAMPLES, ids=[w for w, _ in EXAMPLES])
def test_example_runs(where: str, code: str, tmp_path: Path) -> None:
    """Each example runs, and leaves nothing in shared memory: tmpfs is RAM until deleted,
    so an example that forgot its memory tier would teach readers to leak it.

    Each example gets a fresh folder of its own under /dev/shm as $STATEREG_SHM_DIR (the
    folder statereg's memory tier uses, and the examples' own scratch folders there), which
    must be empty when it ends: other processes' folders in /dev/shm meanwhile do not count.
    Its other temporary folders land under tmp_path ($TMPDIR), which pytest removes."""
    shm = Path(tempfile.mkdtemp(prefix="statereg-docs-", dir=SHM if SHM.is_dir() else tmp_path))
    launch = re.search(r"run with: torchrun --nproc-per-node (\d+)", code.splitlines()[0])
    if launch:
        script = tmp_path / "example.py"
        script.write_text(code)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", launch.group(1), str(script)]
    else:
        command = [sys.executable, "-c", code]
    try:
        done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True,
                              timeout=180, env={**os.environ, "TMPDIR": str(tmp_path),
                                                "STATEREG_SHM_DIR": str(shm)})
        assert done.returncode == 0, f"{where} failed:\n{done.stderr[-3000:]}"
        left = _left_in(shm)
        assert not left, f"{where} left {', '.join(left)} in shared memory ({shm})"
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_the_sharing_table_in_the_docs_is_the_one_the_schema_enforces() -> None:
    from statereg.schemas.sharing import render_table

    assert render_table() in (REPO / "docs" / "distributed.md").read_text()


def test_the_quickstart_shows_what_statereg_plan_prints(tmp_path: Path) -> None:
    """quickstart.md's `statereg plan` samples are the tool's output for its declaration (and
    for that declaration with the typo the text describes), line for line."""
    text = (REPO / "docs" / "quickstart.md").read_text()
    declaration = re.search(r"```yaml\n(# statereg\.yaml\n.*?)```", text, re.DOTALL)
    samples = re.findall(r"```console\n\$ statereg plan statereg\.yaml\n(.*?)```", text,
                         re.DOTALL)
    assert declaration and len(samples) == 2, "quickstart.md lost its declaration or samples"

    def plan(yaml: str) -> subprocess.CompletedProcess[str]:
        (tmp_path / "statereg.yaml").write_text(yaml)
        return subprocess.run([sys.executable, "-m", "statereg", "plan", "statereg.yaml"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)

    def lines(out: str) -> list[str]:
        return [line.rstrip() for line in out.strip("\n").splitlines()]

    good = plan(declaration.group(1))
    assert good.returncode == 0, good.stderr
    assert lines(good.stdout) == lines(samples[0])
    typo = plan(declaration.group(1).replace("{kind: model}", "{kind: model, sharing: shardd}"))
    assert typo.returncode == 2 and lines(typo.stderr) == lines(samples[1])
