"""Timing, peak memory and page-cache control shared by every section of the suite.

A `Timing` is one row of the results: the seconds of each repetition, the bytes moved, and the
peak resident memory of this process while the operation ran. Peak RSS is the kernel's own
high-water mark (VmHWM), reset before each repetition by writing 5 to /proc/self/clear_refs,
so a buffer allocated and freed inside the operation is still counted.
"""

from __future__ import annotations

import gc
import os
import platform
import re
import shutil
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

GB = 1e9


def _status_kb(field_name: str) -> int:
    text = Path("/proc/self/status").read_text()
    found = re.search(rf"^{field_name}:\s+(\d+) kB", text, re.MULTILINE)
    return int(found.group(1)) if found else 0


def rss_gb() -> float:
    return _status_kb("VmRSS") * 1024 / GB


def drop_caches() -> bool:
    """Empty the page cache (sync, then /proc/sys/vm/drop_caches); False where not permitted."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5\n")
        return True
    except OSError:
        return False


PEAK_RESETS = _reset_peak()  # False: each peak is since process start (no clear_refs)


@dataclass
class PeakRSS:
    """Resident memory when the block started and its highest point inside the block."""

    start_gb: float = 0.0
    peak_gb: float = 0.0


@contextmanager
def peak_rss() -> Iterator[PeakRSS]:
    gc.collect()
    _reset_peak()
    found = PeakRSS(start_gb=rss_gb())
    try:
        yield found
    finally:
        found.peak_gb = _status_kb("VmHWM") * 1024 / GB


@dataclass
class Timing:
    """One measured operation: seconds per repetition, bytes moved, peak memory."""

    label: str
    seconds: list[float]
    nbytes: int | None = None
    peak: PeakRSS = field(default_factory=PeakRSS)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "label": self.label,
            "seconds": [round(s, 6) for s in self.seconds],
            "median_s": round(self.median, 6),
            "min_s": round(min(self.seconds), 6),
            "max_s": round(max(self.seconds), 6),
            "bytes": self.nbytes,
            "gb_per_s": round(self.nbytes / self.median / GB, 4)
            if self.nbytes and self.median > 0 else None,
            "peak_rss_gb": round(self.peak.peak_gb, 3),
            "rss_at_start_gb": round(self.peak.start_gb, 3),
        }
        return out | self.extra


def measure(label: str, operation: Callable[[], Any], reps: int, nbytes: int | None = None,
            before: Callable[[], Any] | None = None) -> Timing:
    """Run `before` (untimed) then `operation` (timed) `reps` times."""
    seconds = []
    peak = PeakRSS()
    for _ in range(reps):
        if before is not None:
            before()
        with peak_rss() as rep_peak:
            start = time.perf_counter()
            operation()
            seconds.append(time.perf_counter() - start)
        if rep_peak.peak_gb >= peak.peak_gb:
            peak = rep_peak
    return Timing(label, seconds, nbytes, peak)


class PageCache:
    """Drops the page cache where permitted (root); remembers whether it could.

    Where it is not (a container may refuse /proc/sys/vm/drop_caches even to root), the files
    under `roots` are evicted instead: a sync, then posix_fadvise(POSIX_FADV_DONTNEED) on
    each, which drops their clean pages for any user.
    """

    def __init__(self, allowed: bool = True, roots: list[Path] | None = None,
                 evict_only: bool = False) -> None:
        # evict_only: evict `roots` even where dropping everything is permitted (kinder to
        # other jobs on a shared machine; the loads under test are just as cold).
        self.droppable = allowed and not evict_only and drop_caches()
        self.roots = list(roots or []) if allowed else []

    @property
    def how(self) -> str:
        """How loads are made cold, for the report."""
        if self.droppable:
            return "page cache dropped (/proc/sys/vm/drop_caches)"
        if self.roots:
            return "files evicted with posix_fadvise(DONTNEED) (not drop_caches)"
        return "page cache NOT dropped"

    def drop(self) -> None:
        if self.droppable:
            drop_caches()
            return
        os.sync()
        for root in self.roots:
            for path in root.rglob("*"):
                if path.is_file() and not path.is_symlink():
                    evict(path)


def evict(path: Path) -> None:
    """Drop a file's clean pages from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def fresh_dir(path: Path) -> Path:
    """An empty directory at `path` (removed first if it exists)."""
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def _mount_of(path: Path) -> dict[str, str]:
    best = {"device": "?", "mount": "/", "fstype": "?"}
    resolved = str(path.resolve())
    for line in Path("/proc/mounts").read_text().splitlines():
        device, mount, fstype = line.split()[:3]
        inside = resolved == mount or resolved.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best["mount"]):
            best = {"device": device, "mount": mount, "fstype": fstype}
    return best


def machine_info(data_dir: Path) -> dict[str, Any]:
    """What the numbers were measured on: CPU, memory, the disk under test, versions."""
    import statereg

    cpu = "?"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB, 1),
        "disk": _mount_of(data_dir) | {"path": str(data_dir)},
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "statereg": statereg.__version__,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
