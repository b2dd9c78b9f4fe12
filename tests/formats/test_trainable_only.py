"""trainable_only: an adapter fine-tune saves its adapter, never the frozen base under it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import statereg


class LoRALinear(nn.Module):
    """A frozen base weight plus a trainable low-rank update (A: rank x in, B: out x rank)."""

    def __init__(self, features: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(features, features)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, features) * 0.01)
        self.lora_b = nn.Parameter(torch.zeros(features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_a.T @ self.lora_b.T


def _model(base_seed: int, adapter_seed: int) -> LoRALinear:
    torch.manual_seed(base_seed)
    model = LoRALinear(features=400, rank=1)
    torch.manual_seed(adapter_seed)
    with torch.no_grad():
        model.lora_a.normal_()
        model.lora_b.normal_()
    return model


def _spec(root: Path, fmt: str, trainable_only: bool) -> dict:
    return {"storage": {"url": str(root)},
            "components": {"model": {"kind": "model", "format": fmt,
                                     "trainable_only": trainable_only}}}


@pytest.mark.parametrize("fmt", ["dcp", "safetensors"])
def test_only_the_adapter_is_saved_and_loading_leaves_the_base_untouched(tmp_path, fmt):
    model = _model(base_seed=0, adapter_seed=1)
    adapter_bytes = model.lora_a.nbytes + model.lora_b.nbytes
    base_bytes = model.base.weight.nbytes + model.base.bias.nbytes
    assert base_bytes > 100 * adapter_bytes

    full = statereg.CheckpointManager(_spec(tmp_path / "full", fmt, False), model=model)
    adapter = statereg.CheckpointManager(_spec(tmp_path / "adapter", fmt, True), model=model)
    full_record = statereg.read_manifest(full.save(step=1)).components["model"]
    record = statereg.read_manifest(adapter.save(step=1)).components["model"]

    assert record.tensors == 2  # lora_a, lora_b: nothing of the frozen base
    assert record.bytes < adapter_bytes + 8192  # the adapter and the format's own framing
    assert full_record.bytes > 50 * record.bytes

    other = _model(base_seed=7, adapter_seed=8)  # another base: the fine-tune's own
    base_before = {k: v.clone() for k, v in other.base.state_dict().items()}
    statereg.CheckpointManager(_spec(tmp_path / "adapter", fmt, True), model=other).load()
    assert torch.equal(other.lora_a, model.lora_a) and torch.equal(other.lora_b, model.lora_b)
    for key, value in base_before.items():
        assert torch.equal(other.base.state_dict()[key], value), key


def test_an_adapter_checkpoint_into_a_full_declaration_names_the_missing_base(tmp_path):
    model = _model(0, 1)
    statereg.CheckpointManager(_spec(tmp_path, "dcp", True), model=model).save(step=1)
    with pytest.raises(statereg.CheckpointMismatchError, match=r"base\.weight"):
        statereg.CheckpointManager(_spec(tmp_path, "dcp", False), model=_model(2, 3)).load()


def test_buffers_left_out_are_named_once_at_construction(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """BatchNorm's running statistics change in train mode even under a frozen base; an
    adapter checkpoint leaves them out, so the manager says so (and nothing when there are
    none)."""
    model = nn.Sequential(_model(0, 1), nn.BatchNorm1d(400))
    with caplog.at_level("WARNING", logger="statereg"):
        mgr = statereg.CheckpointManager(_spec(tmp_path, "dcp", True), model=model)
        mgr.save(step=1)
    warned = [r.getMessage() for r in caplog.records if "trainable_only" in r.getMessage()]
    assert warned == [
        "component 'model' (trainable_only): its 3 buffer(s) (1.running_mean, 1.running_var, "
        "1.num_batches_tracked) are not saved, and a load leaves them as the model holds them. "
        "If training changes them (BatchNorm's running statistics in train mode), a resume is "
        "not exact: keep those layers in eval mode, or declare trainable_only: false"]
    stored = statereg.read_manifest(f"{tmp_path}/step_00000001").components["model"]
    assert stored.tensors == 4  # lora_a, lora_b and BatchNorm's weight and bias
    caplog.clear()
    with caplog.at_level("WARNING", logger="statereg"):
        statereg.CheckpointManager(_spec(tmp_path / "plain", "dcp", True), model=_model(0, 1))
    assert not [r for r in caplog.records if "trainable_only" in r.getMessage()]
    # A model given later with attach() is named when it arrives, not before.
    later = _spec(tmp_path / "later", "dcp", True)
    later["components"]["model"]["required"] = False
    with caplog.at_level("WARNING", logger="statereg"):
        mgr = statereg.CheckpointManager(later)
        assert not [r for r in caplog.records if "trainable_only" in r.getMessage()]
        mgr.attach(model=model)
    assert [r.getMessage() for r in caplog.records
            if "trainable_only" in r.getMessage()] == warned
