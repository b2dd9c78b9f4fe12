"""The layering of docs/design.md holds: `lint-imports` keeps every contract of
pyproject.toml's [tool.importlinter] (each layer imports only the layers below it; the
declaration, schemas and errors import without torch; the engine never imports the memory
tier; storage's own modules import one way, with no circle). A new upward import fails here."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def test_every_import_linter_contract_is_kept():
    done = subprocess.run(
        [str(LINT_IMPORTS), "--config", str(REPO / "pyproject.toml"), "--no-cache"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )

    assert done.returncode == 0, done.stdout + done.stderr
    assert "Contracts: 4 kept, 0 broken." in done.stdout, done.stdout
    assert "The engine never imports the memory tier" in done.stdout, done.stdout


# Raw kernel calls statereg's storage makes beyond open/read/write/fsync: kernel.py's alone.
_KERNEL_CALLS = re.compile(r"\bctypes\b|\bfcntl\b|posix_fadvise\(|sync_file_range\(|"
                           r"\bmincore\(|/proc/")


def test_storage_files_stay_small_and_the_kernel_calls_have_one_home():
    backends = sorted((REPO / "statereg" / "backends").glob("*.py"))
    assert [p.name for p in backends if len(p.read_text().splitlines()) > 700] == []
    callers = [p.name for p in backends
               if _KERNEL_CALLS.search(re.sub(r'"""[\s\S]*?"""|#.*', "", p.read_text()))]
    assert callers == ["kernel.py"]
