"""What users see: progress bars on a terminal (rank 0 only, silent when piped or with
TQDM_DISABLE=1), sizes, rates and tables."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from types import TracebackType

from tqdm import tqdm


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def describe_rate(nbytes: int, seconds: float) -> str:
    """'1.23 GB in 0.52 s (2.37 GB/s)'."""
    rate = nbytes / seconds if seconds > 0 else 0.0
    return f"{format_bytes(nbytes)} in {seconds:.2f} s ({format_bytes(rate)}/s)"


def format_table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    """Left-aligned columns separated by two spaces; the first row is the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _rank() -> int:
    """This process's global rank: torch.distributed's when a process group is up, else
    what a launcher (torchrun, SLURM via torchrun) exported, else 0. Never imports torch."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def progress_enabled() -> bool:
    """Whether progress bars are drawn: on rank 0 only (under torchrun every rank shares one
    terminal), when stderr is a terminal, and unless TQDM_DISABLE is set to a true value
    (tqdm's own off switch, which a bar given `disable=` explicitly would ignore)."""
    off = os.environ.get("TQDM_DISABLE", "").strip().lower() not in ("", "0", "false", "no")
    return not off and _rank() == 0 and sys.stderr.isatty()


class Progress:
    """A byte-counting progress bar, drawn only where `progress_enabled()` says."""

    def __init__(self, total: int, description: str) -> None:
        self._bar = tqdm(total=total, desc=description, unit="B", unit_scale=True,
                         disable=not progress_enabled(), leave=False)

    def update(self, nbytes: int) -> None:
        self._bar.update(nbytes)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._bar.close()
