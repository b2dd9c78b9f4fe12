"""The declared save cadence: save.every_steps, every_seconds and every: auto (Young/Daly),
and what save() reports about each save."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import statereg
from statereg.engine.cadence import (
    ASSUMED_STALL_S,
    Cadence,
    expected_goodput,
    young_daly_interval,
)
from statereg.schemas.spec import SaveSpec


class Clock:
    """A clock the test moves: a training step and a save each take the time they are told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_young_daly_interval_and_goodput_follow_the_formula() -> None:
    assert young_daly_interval(2.0, 3600.0) == pytest.approx(math.sqrt(2 * 2 * 3600))  # 120 s
    assert young_daly_interval(0.5, 86400.0) == pytest.approx(293.938769, rel=1e-6)
    # At the optimum the two wastes are equal: stall/interval == interval/(2 MTBF).
    interval = young_daly_interval(2.0, 3600.0)
    assert expected_goodput(interval, 2.0, 3600.0) == pytest.approx(1 - 2 * 2.0 / 120.0)
    # Any other interval wastes more.
    for other in (interval / 2, interval * 2):
        assert expected_goodput(other, 2.0, 3600.0) < expected_goodput(interval, 2.0, 3600.0)
    assert expected_goodput(10.0, 20.0, 3600.0) == 0.0  # a stall longer than the interval


def test_every_steps_and_every_seconds_whichever_comes_first() -> None:
    clock = Clock()
    cadence = Cadence(SaveSpec(every_steps=10, every_seconds=30), clock)
    due = []
    for step in range(1, 41):
        clock.now += 4.0  # 4 s a step: 30 s pass 8 steps after the last save
        if cadence.due(step):
            due.append(step)
            cadence.saved(step, 0.1)
    assert due == [8, 10, 18, 20, 28, 30, 38, 40]


def test_auto_uses_the_mean_measured_stall_and_the_declared_mtbf() -> None:
    clock = Clock()
    cadence = Cadence(SaveSpec(every="auto", mtbf=800), clock)
    assert cadence.report().stall_s is None
    assert cadence.report().interval_s == pytest.approx(math.sqrt(2 * ASSUMED_STALL_S * 800))
    cadence.saved(1, 2.0)
    cadence.saved(2, 4.0)
    report = cadence.report()
    assert report.stall_s == pytest.approx(3.0)
    assert report.interval_s == pytest.approx(math.sqrt(2 * 3.0 * 800))
    assert report.goodput == pytest.approx(expected_goodput(report.interval_s, 3.0, 800))
    assert "expected goodput" in str(report)


def test_should_save_without_a_declared_cadence_says_what_to_declare(tmp_path: Path) -> None:
    spec = {"storage": {"url": str(tmp_path)}, "components": {"model": {"kind": "model"}}}
    with statereg.CheckpointManager(spec, model=torch.nn.Linear(2, 2)) as mgr, \
            pytest.raises(statereg.SpecError, match=r"save\.every_steps"):
        mgr.should_save(1)


@pytest.mark.parametrize("bad", [{"every": "auto", "every_steps": 5},
                                 {"mtbf": "6h"}, {"every": "auto", "mtbf": "soon"}])
def test_contradictory_cadences_are_refused_at_load_spec(tmp_path: Path,
                                                         bad: dict[str, Any]) -> None:
    with pytest.raises(statereg.SpecError, match="save"):
        statereg.load_spec({"storage": {"url": str(tmp_path)},
                            "components": {"model": {"kind": "model"}}, "save": bad})


class SlowState:
    """A custom component whose state_dict() takes `cost` seconds of the test's clock: the
    stall of every save that captures it."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.cost = 0.0

    def state_dict(self) -> dict[str, Any]:
        self.clock.now += self.cost
        return {"n": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def test_auto_interval_adapts_when_the_measured_stall_changes(tmp_path: Path) -> None:
    """A loop of 1 s steps saving when should_save() says: with a 0.5 s stall and an MTBF of
    400 s the interval is sqrt(2 x 0.5 x 400) = 20 s; once the stall becomes 2 s it grows to
    40 s, as the saves' spacing shows."""
    spec = {"storage": {"url": str(tmp_path)},
            "components": {"model": {"kind": "model"}, "slow": {"kind": "custom"}},
            "save": {"every": "auto", "mtbf": 400}}
    clock = Clock()
    slow = SlowState(clock)
    saved: list[int] = []
    with statereg.CheckpointManager(spec, model=torch.nn.Linear(2, 2), slow=slow) as mgr:
        mgr._cadence.clock = clock
        mgr._cadence._started = clock.now
        slow.cost = 0.5
        for step in range(1, 700):
            clock.now += 1.0
            if step == 200:
                slow.cost = 2.0
            if mgr.should_save(step):
                mgr.save(step)
                saved.append(step)
        report = mgr.cadence
    gaps = [b - a for a, b in itertools.pairwise(saved)]
    early = [g for a, g in zip(saved, gaps, strict=False) if 60 < a < 180]
    late = [g for a, g in zip(saved, gaps, strict=False) if a > 450]
    assert early and late
    # Steps are 1 s and the interval counts from the end of the last save; the mean stall
    # moves from 0.5 to 2 s over the 5 saves after step 200, and the gaps with it.
    assert set(early) == {20}, gaps
    assert set(late) == {40}, gaps
    assert gaps == sorted(gaps), gaps
    assert report.stall_s == pytest.approx(2.0, abs=0.01)
    assert report.interval_s == pytest.approx(40.0, abs=0.1)


def test_save_reports_step_stall_commit_time_and_bytes(tmp_path: Path) -> None:
    spec = {"storage": {"url": str(tmp_path)}, "components": {"model": {"kind": "model"}},
            "save": {"async": "thread"}}
    model = torch.nn.Linear(8, 4)  # 36 float32 values
    seen: list[statereg.SaveInfo] = []
    with statereg.CheckpointManager(spec, model=model) as mgr:
        mgr.on_saved(seen.append)
        handle = mgr.save(step=3)
        info = handle.info()
        mgr.wait()
        assert mgr.last_saved == info
    assert seen == [info]
    assert (info.step, info.url, info.bytes) == (3, str(tmp_path / "step_00000003"), 36 * 4)
    assert 0 < info.stall_s <= info.committed_s
