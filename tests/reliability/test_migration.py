"""Checkpoints written by earlier statereg versions, checked into tests/fixtures/, stay
loadable by every later version: bit for bit, next to checkpoints the current one writes.
tests/fixtures/README.md says how each was made."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

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
    def __init__(self) -> None:
        self.state: dict = {}

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def live_objects() -> dict:
    torch.manual_seed(123)  # other values than the fixture's everywhere
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler,
            "counters": Counters()}


def spec(root: Path) -> dict:
    return {"storage": {"url": str(root)},
            "components": {"model": {"kind": "model"}, "optimizer": {"kind": "optimizer"},
                           "scheduler": {"kind": "scheduler"},
                           "counters": {"kind": "custom"}}}


def hexes(tensor: torch.Tensor) -> list[str]:
    return [float(x).hex() for x in tensor.flatten().tolist()]


@pytest.fixture(params=VERSIONS)
def fixture(request, tmp_path) -> tuple[Path, dict]:
    source = FIXTURES / request.param
    root = tmp_path / "root"
    shutil.copytree(source / "root", root)  # never write into the checked-in files
    return root, json.loads((source / "expected.json").read_text())


def test_there_is_a_v1_fixture():
    assert "manifest-v1.0" in VERSIONS


def test_an_old_checkpoint_reads_verifies_and_loads_bit_for_bit(fixture, capsys):
    root, expected = fixture
    url = str(root / "step_00000003")
    manifest = statereg.read_manifest(url)
    assert manifest.format_version.startswith("1.")
    assert (manifest.step, manifest.tokens_seen, manifest.extra) == (
        expected["step"], expected["tokens_seen"], expected["extra"])
    statereg.verify(url)
    assert cli(["ls", str(root)]) == 0
    assert "step_00000003 (latest)" in capsys.readouterr().out
    assert cli(["inspect", url]) == 0
    assert "step:        3" in capsys.readouterr().out

    objects = live_objects()
    result = statereg.CheckpointManager(spec(root), **objects).load(verify="full")

    assert result.step == 3
    model, optimizer = objects["model"], objects["optimizer"]
    for key, value in model.state_dict().items():
        assert hexes(value) == expected["tensors"][f"model.{key}"], key
    for i, parameter in enumerate(model.parameters()):
        assert hexes(optimizer.state[parameter]["momentum_buffer"]) == \
            expected["tensors"][f"optimizer.{i}.momentum_buffer"]
    assert objects["scheduler"].state_dict() == expected["scheduler"]
    assert objects["counters"].state == expected["counters"]


def test_an_old_checkpoint_lives_next_to_new_ones(fixture):
    root, _ = fixture
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    mgr = statereg.CheckpointManager(spec(root), **live_objects())
    mgr.save(step=4)

    assert [u.rsplit("/", 1)[-1] for u in mgr.list()] == ["step_00000003", "step_00000004"]
    assert mgr.load().step == 4
    assert mgr.load(step=3).step == 3
    assert collect_garbage(open_backend(str(root)), delete=True, grace_s=0) == []
    for path, data in before.items():  # nothing about the old checkpoint was rewritten
        if path.name != "latest":
            assert path.read_bytes() == data, path
