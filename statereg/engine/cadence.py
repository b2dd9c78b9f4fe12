"""When to save: the cadence a declaration names (save.every_steps, every_seconds, every: auto).

`every: auto` sets the interval by Young and Daly's first-order rule: a save stalls the loop
for `stall` seconds, and a failure (one per MTBF on average) loses the work since the last
save, half an interval on average. The wasted fraction of the run is then about
stall / interval + interval / (2 x MTBF), which is smallest at interval = sqrt(2 x stall x MTBF).
The stall is measured, as the mean of the last saves' stalls, so the interval follows it: a
save that becomes cheaper (async staging) is taken more often, one that becomes dearer less.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from statereg.errors import SpecError
from statereg.schemas.spec import SaveSpec

DEFAULT_MTBF_S = 24 * 3600.0
# The stall assumed before any save was measured: the first save then comes after
# sqrt(2 x 1 s x MTBF) (about 7 minutes at the default MTBF), and sets the interval for real.
ASSUMED_STALL_S = 1.0
# How many of the last saves' stalls the interval averages.
STALL_WINDOW = 5


def young_daly_interval(stall_s: float, mtbf_s: float) -> float:
    """The save interval that wastes least: sqrt(2 x stall x MTBF) seconds."""
    return math.sqrt(2.0 * stall_s * mtbf_s)


def expected_goodput(interval_s: float, stall_s: float, mtbf_s: float) -> float:
    """The fraction of wall time spent on training that survives failures, to first order:
    1 - stall / interval - interval / (2 x MTBF), at least 0."""
    if interval_s <= 0:
        return 0.0
    return max(0.0, 1.0 - stall_s / interval_s - interval_s / (2.0 * mtbf_s))


@dataclass(frozen=True)
class CadenceReport:
    """What `every: auto` decided, for a log line or a tracker: the interval, the mean stall
    it was computed from (None before a save was measured), the MTBF, and the goodput."""

    interval_s: float
    stall_s: float | None
    mtbf_s: float
    goodput: float

    def __str__(self) -> str:
        stall = "assumed 1 s" if self.stall_s is None else f"{self.stall_s:.3g} s"
        return (f"save every {self.interval_s:.3g} s (stall {stall}, MTBF {self.mtbf_s:.3g} s): "
                f"expected goodput {self.goodput:.2%}")


class Cadence:
    """The declared save cadence of one run; `clock` gives seconds (monotonic)."""

    def __init__(self, save: SaveSpec, clock: Callable[[], float] = time.monotonic) -> None:
        self.save = save
        self.clock = clock
        self._started = clock()
        self._last_time: float | None = None
        self._last_step: int | None = None
        self._stalls: deque[float] = deque(maxlen=STALL_WINDOW)

    @property
    def declared(self) -> bool:
        return bool(self.save.every_steps or self.save.every_seconds or self.save.every)

    @property
    def by_time(self) -> bool:
        """Whether the answer depends on a clock (ranks must then agree on rank 0's)."""
        return bool(self.save.every_seconds or self.save.every)

    def due(self, step: int) -> bool:
        """Whether `step` should be saved, by this process's clock."""
        if not self.declared:
            raise SpecError(
                "should_save(): no save cadence is declared; add save.every_steps, "
                "save.every_seconds or 'save.every: auto' to the declaration"
            )
        if step == self._last_step:
            return False
        every = self.save.every_steps
        if every is not None and step % every == 0:
            return True
        interval = self.save.every_seconds
        if self.save.every == "auto":
            interval = self.report().interval_s
        if interval is None:
            return False
        since = self._last_time if self._last_time is not None else self._started
        return self.clock() - since >= interval

    def saved(self, step: int, stall_s: float) -> None:
        """Record a save of `step` that held the loop for `stall_s` seconds."""
        self._last_time = self.clock()
        self._last_step = step
        self._stalls.append(max(stall_s, 0.0))

    def report(self) -> CadenceReport:
        """The interval `every: auto` uses now, and what it expects of it."""
        mtbf = self.save.mtbf or DEFAULT_MTBF_S
        stall = sum(self._stalls) / len(self._stalls) if self._stalls else None
        interval = young_daly_interval(stall if stall is not None else ASSUMED_STALL_S, mtbf)
        return CadenceReport(interval, stall, mtbf,
                             expected_goodput(interval, stall or ASSUMED_STALL_S, mtbf))
