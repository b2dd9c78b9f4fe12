"""What users see: progress bars on a terminal (silent when piped), sizes, rates and tables."""

from __future__ import annotations

import sys
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


def format_table(rows: list[tuple[str, ...]]) -> list[str]:
    """Left-aligned columns separated by two spaces; the first row is the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


class Progress:
    """A byte-counting progress bar shown only when stderr is a terminal."""

    def __init__(self, total: int, description: str) -> None:
        self._bar = tqdm(total=total, desc=description, unit="B", unit_scale=True,
                         disable=not sys.stderr.isatty(), leave=False)

    def update(self, nbytes: int) -> None:
        self._bar.update(nbytes)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._bar.close()
