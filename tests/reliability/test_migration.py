"""Checkpoints written by earlier statereg versions, checked into tests/fixtures/, stay
loadable by every later version: bit for bit, next to checkpoints the current one writes.
tests/fixtures/README.md says how each was made."""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import statereg
from statereg.backends.registry import open_backend
from statereg.cli import main as cli
from statereg.engine.gc import collect_garbage

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
VERSIONS = sorted(p.name for p in FIXTURES.glob("manifest-v*") if p.is_dir())


class Counters:
    """manifest-v1.0's custom component (global, json)."""

    def __init__(self) -> None:
        self.state: dict = {}

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


class Tally(Counters):
    """manifest-v1.1's custom component (per_rank, format torch): tensors and plain values."""


def live_v1_0() -> dict:
    torch.manual_seed(123)  # other values than the fixture's everywhere
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler,
            "counters": Counters()}


def live_v1_1() -> dict:
    torch.manual_seed(123)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    optimizer = torch.optim.AdamW(model[1].parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "tally": Tally()}


V1_0_COMPONENTS = {"model": {"kind": "model"}, "optimizer": {"kind": "optimizer"},
                   "scheduler": {"kind": "scheduler"}, "counters": {"kind": "custom"}}
# Per fixture: the live objects its checkpoints load into; per root: how it was saved.
LIVE = {"manifest-v1.0": live_v1_0, "manifest-v1.1": live_v1_1}
SAVED_WITH = {"root": ({}, {}),
              "root-zstd-incremental": ({"compression": "zstd"}, {"incremental": True})}


@dataclass
class Fixture:
    version: str
    root: Path
    expected: dict
    components: dict
    storage: dict
    save: dict

    def spec(self) -> dict:
        return {"storage": {"url": str(self.root), **self.storage},
                "components": self.components, "save": self.save}

    def live_objects(self) -> dict:
        return LIVE[self.version]()


def roots() -> list[tuple[str, str]]:
    return [(version, p.name) for version in VERSIONS
            for p in sorted((FIXTURES / version).glob("root*")) if p.is_dir()]


def hexes(tensor: torch.Tensor) -> list[str]:
    return [float(x).hex() for x in tensor.flatten().tolist()]


@pytest.fixture(params=roots(), ids=lambda r: "/".join(r))
def fixture(request, tmp_path) -> Fixture:
    version, name = request.param
    source = FIXTURES / version
    root = tmp_path / name
    shutil.copytree(source / name, root)  # never write into the checked-in files
    written = json.loads((source / "expected.json").read_text())
    expected = written["roots"][name] if "roots" in written else written
    storage, save = SAVED_WITH[name]
    return Fixture(version, root, expected, written.get("components", V1_0_COMPONENTS),
                   storage, save)


def test_there_are_v1_0_and_v1_1_fixtures():
    assert ("manifest-v1.0", "root") in roots()
    assert ("manifest-v1.1", "root") in roots()
    assert ("manifest-v1.1", "root-zstd-incremental") in roots()


def test_the_v1_1_fixture_holds_what_1_1_added():
    """Compressed files (files[].codec), references to an earlier checkpoint and digests."""
    root = FIXTURES / "manifest-v1.1" / "root-zstd-incremental"
    manifest = statereg.read_manifest(str(root / "step_00000003"))

    assert manifest.format_version == "1.1"
    assert [r.path for r in manifest.references] == [
        "step_00000002/model/__0_0.distcp", "step_00000002/model/__0_1.distcp"]
    assert {f.codec for f in manifest.files} == {"none", "zstd+planes"}
    assert "model/0.weight@[0, 0]" in manifest.digests
    assert manifest.components["tally"].format == "torch"
    assert manifest.components["rng"].sharing == "per_rank"


def test_an_old_checkpoint_reads_verifies_and_loads_bit_for_bit(fixture, capsys):
    expected = fixture.expected
    url = str(fixture.root / "step_00000003")
    manifest = statereg.read_manifest(url)
    assert manifest.format_version == fixture.version.removeprefix("manifest-v")
    assert (manifest.step, manifest.tokens_seen, manifest.extra) == (
        expected["step"], expected["tokens_seen"], expected["extra"])
    statereg.verify(url)
    assert cli(["ls", str(fixture.root)]) == 0
    assert "step_00000003 (latest)" in capsys.readouterr().out
    assert cli(["inspect", url]) == 0
    assert "step:        3" in capsys.readouterr().out

    objects = fixture.live_objects()
    result = statereg.CheckpointManager(fixture.spec(), **objects).load(verify="full")
    rng_next = {"python": random.random().hex(), "numpy": float(np.random.random()).hex(),
                "torch": hexes(torch.rand(3))}  # first, before anything draws

    assert result.step == 3
    model, optimizer = objects["model"], objects["optimizer"]
    parameters = optimizer.param_groups[0]["params"]
    tensors = dict(expected["tensors"])
    for key, value in model.state_dict().items():
        assert hexes(value) == tensors.pop(f"model.{key}"), key
    for key in [k for k in tensors if k.startswith("optimizer.")]:
        _, index, name = key.split(".")
        assert hexes(optimizer.state[parameters[int(index)]][name]) == tensors.pop(key), key
    assert objects["scheduler"].state_dict() == expected["scheduler"]
    if "counters" in objects:
        assert objects["counters"].state == expected["counters"]
    if "tally" in objects:
        state = dict(objects["tally"].state)
        assert (state.pop("seen").dtype, state.pop("ema").dtype) == (torch.int64, torch.float64)
        assert hexes(objects["tally"].state["seen"]) == tensors.pop("tally.seen")
        assert hexes(objects["tally"].state["ema"]) == tensors.pop("tally.ema")
        assert state == expected["tally"]
    assert tensors == {}  # every value the fixture recorded was compared
    if "rng" in fixture.components:
        assert rng_next == expected["rng_next"]


def test_an_old_checkpoint_lives_next_to_new_ones(fixture):
    before = {p: p.read_bytes() for p in fixture.root.rglob("*") if p.is_file()}
    old = sorted(p.name for p in fixture.root.glob("step_*"))
    mgr = statereg.CheckpointManager(fixture.spec(), **fixture.live_objects())
    mgr.save(step=4)

    assert [u.rsplit("/", 1)[-1] for u in mgr.list()] == [*old, "step_00000004"]
    assert mgr.load().step == 4
    assert mgr.load(step=3).step == 3
    assert collect_garbage(open_backend(str(fixture.root)), delete=True, grace_s=0) == []
    for path, data in before.items():  # nothing about the old checkpoints was rewritten
        if path.name != "latest":
            assert path.read_bytes() == data, path
