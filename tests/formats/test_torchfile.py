"""format: torch — one torch.save file per copy, loaded with weights_only=True only."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from torch import nn

import statereg


class Cursor:
    """Custom state: a position and a tensor."""

    def __init__(self, position: int = 0) -> None:
        self.position = position
        self.seen = torch.zeros(3)

    def state_dict(self) -> dict:
        return {"position": self.position, "seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.position, self.seen = state["position"], state["seen"]


class Opaque:
    """A custom object whose state holds an arbitrary class instance."""

    def state_dict(self) -> dict:
        return {"thing": Cursor()}

    def load_state_dict(self, state: dict) -> None:
        raise AssertionError("never loaded")


def _objects(seed: int) -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler,
            "cursor": Cursor(seed)}


MIXED = {
    "model": {"kind": "model", "format": "torch"},
    "optimizer": {"kind": "optimizer"},                       # dcp
    "scheduler": {"kind": "scheduler", "format": "torch"},
    "cursor": {"kind": "custom", "format": "torch", "sharing": "per_rank"},
    "rng": {"kind": "rng"},                                   # json
}


def test_mixed_formats_round_trip_and_the_manifest_names_each(tmp_path: Path):
    live = _objects(0)
    live["model"](torch.randn(2, 4)).sum().backward()
    live["optimizer"].step()
    live["scheduler"].step()
    live["cursor"].seen += 2
    url = statereg.CheckpointManager({"storage": {"url": str(tmp_path)}, "components": MIXED},
                                     **live).save(step=5)

    manifest = statereg.read_manifest(url)
    assert {n: c.format for n, c in manifest.components.items()} == {
        "model": "torch", "optimizer": "dcp", "scheduler": "torch", "cursor": "torch",
        "rng": "json"}
    assert manifest.components["model"].files == ["model/model.pt"]
    assert manifest.components["cursor"].files == ["cursor/rank_00000.pt"]
    plain = torch.load(tmp_path / "step_00000005/model/model.pt", weights_only=True)
    assert plain.keys() == live["model"].state_dict().keys()  # any torch.load reads it

    # Loading needs no declaration of the formats: the manifest says how each was written.
    fresh = _objects(1)
    declared_default = {n: {k: v for k, v in c.items() if k != "format"}
                        for n, c in MIXED.items()}
    statereg.CheckpointManager({"storage": {"url": str(tmp_path)},
                                "components": declared_default}, **fresh).load()
    for key, value in live["model"].state_dict().items():
        assert torch.equal(fresh["model"].state_dict()[key], value)
    assert fresh["scheduler"].state_dict() == live["scheduler"].state_dict()
    assert fresh["optimizer"].param_groups[0]["lr"] == 0.5
    assert fresh["cursor"].position == 0 and torch.equal(fresh["cursor"].seen, torch.full((3,), 2.))


def test_state_that_weights_only_refuses_fails_the_save_not_the_resume(tmp_path: Path):
    spec = {"storage": {"url": str(tmp_path)},
            "components": {"opaque": {"kind": "custom", "format": "torch"}}}
    with pytest.raises(statereg.SpecError, match="weights_only"):
        statereg.CheckpointManager(spec, opaque=Opaque()).save(step=1)
    assert statereg.CheckpointManager(spec, opaque=Opaque()).list() == []


def test_a_pickled_object_in_a_torch_file_is_refused_on_load(tmp_path: Path):
    spec = {"storage": {"url": str(tmp_path)},
            "components": {"cursor": {"kind": "custom", "format": "torch"}}}
    statereg.CheckpointManager(spec, cursor=Cursor(3)).save(step=1)
    path = tmp_path / "step_00000001/cursor/state.pt"
    buffer = io.BytesIO()
    torch.save({"position": Cursor(9), "seen": torch.zeros(3)}, buffer)  # smuggled class
    path.write_bytes(buffer.getvalue())

    target = Cursor(0)
    with pytest.raises(statereg.CorruptCheckpointError, match="weights-only"):
        # By step: a resume skips a checkpoint whose file has another size than recorded.
        statereg.CheckpointManager(spec, cursor=target).load(step=1, verify="off")
    assert target.position == 0


@pytest.mark.parametrize(("component", "message"), [
    ({"kind": "optimizer", "format": "torch"}, "format 'torch' cannot hold optimizer tensors"),
    ({"kind": "rng", "format": "safetensors"}, "cannot hold rng state"),
    ({"kind": "model", "format": "safetensors", "sharing": "per_rank"}, "one full copy"),
    ({"kind": "model", "max_shard_size": "1GB"}, "format 'safetensors' only"),
    ({"kind": "model", "format": "safetensors", "max_shard_size": "lots"}, "not a size"),
    ({"kind": "scheduler", "trainable_only": True}, "model components only"),
])
def test_declarations_that_do_not_fit_a_format_are_refused(component, message):
    spec = {"storage": {"url": "x"}, "components": {"c": component}}
    if component["kind"] == "optimizer":
        spec["components"]["m"] = {"kind": "model"}
    with pytest.raises(statereg.SpecError, match=message):
        statereg.load_spec(spec)
