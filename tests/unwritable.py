"""Make a real folder refuse writes, for tests of what a failed write does: by its mode for
a normal user; for root, which ignores modes, by the immutable attribute (chattr +i), or
the test is skipped where the filesystem has no such attribute."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def unwritable(folder: Path) -> Iterator[None]:
    """`folder` refuses new entries inside the block (EACCES or EPERM), and is writable again
    after it."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
    else:
        done = subprocess.run(["chattr", "+i", str(folder)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"root ignores modes, and chattr +i failed: {done.stderr.strip()}")
    try:
        yield
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
        else:
            folder.chmod(0o755)
