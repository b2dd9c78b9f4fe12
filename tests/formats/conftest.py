"""Builders for the format tests; tests/distributed's process harness is importable here."""

from __future__ import annotations

import sys
from pathlib import Path

# run_ranks pickles its function by reference; spawned ranks inherit this sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
