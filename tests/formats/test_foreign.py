"""Plain torch.distributed.checkpoint directories in, and statereg's DCP directories out."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

import statereg
from statereg.cli import main


def _trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


@pytest.fixture
def plain_dcp(tmp_path: Path) -> tuple[Path, nn.Module, torch.optim.Optimizer]:
    """A checkpoint the usual way: dcp.save of get_state_dict's model and optimizer state."""
    model, optimizer = _trained(0)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state},
             checkpoint_id=tmp_path / "plain")
    return tmp_path / "plain", model, optimizer


def _spec(root: Path) -> dict:
    return {"storage": {"url": str(root)},
            "components": {"model": {"kind": "model"}, "optimizer": {"kind": "optimizer"}}}


def test_inspect_reports_a_plain_dcp_checkpoint_as_foreign(plain_dcp, capsys):
    path, _, _ = plain_dcp
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "foreign, not verified" in out
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert lines["model"][1] == "4"  # 4 tensors
    assert lines["optimizer"][1] == "12" and lines["optimizer"][-1] == "12"  # + param_groups


def test_inspect_of_a_directory_that_is_no_checkpoint_fails(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["inspect", str(tmp_path / "empty")]) == 1
    assert "not a checkpoint" in capsys.readouterr().err


def test_named_components_load_from_a_plain_dcp_checkpoint(plain_dcp, tmp_path):
    path, saved_model, saved_optimizer = plain_dcp
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    mgr = statereg.CheckpointManager(_spec(tmp_path / "run"), model=model, optimizer=optimizer)

    with pytest.raises(statereg.SpecError, match="include="):
        mgr.load(path)
    result = mgr.load(path, include=["model", "optimizer"])

    assert (result.verified, result.components) == (False, ("model", "optimizer"))
    for key, value in saved_model.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    assert optimizer.param_groups[0]["lr"] == 0.01
    saved_state = list(saved_optimizer.state.values())
    for mine, theirs in zip(optimizer.state.values(), saved_state, strict=True):
        assert torch.equal(mine["exp_avg"], theirs["exp_avg"])
        assert torch.equal(mine["step"], theirs["step"])


def test_a_component_named_after_nothing_in_the_checkpoint_is_refused(plain_dcp, tmp_path):
    path, _, _ = plain_dcp
    spec = {"storage": {"url": str(tmp_path / "run")}, "components": {"net": {"kind": "model"}}}
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(statereg.CheckpointMismatchError, match="top-level names: model"):
        statereg.CheckpointManager(spec, net=model).load(path, include=["net"])


def test_load_model_from_reads_a_plain_dcp_checkpoint_with_a_prefix(plain_dcp):
    path, saved_model, _ = plain_dcp
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    report = statereg.load_model_from(path, model, prefix={"add": "model."}, strict=False)
    assert report.missing == () and len(report.loaded) == 4
    assert len(report.unexpected) == 12  # the optimizer's moments: reported, not loaded
    assert all(k.startswith("optimizer.state.") for k in report.unexpected)
    assert torch.equal(model[0].weight, saved_model[0].weight)


def test_statereg_dcp_directories_load_with_plain_dcp_without_statereg(tmp_path):
    model, optimizer = _trained(0)
    spec = _spec(tmp_path)
    statereg.CheckpointManager(spec, model=model, optimizer=optimizer).save(step=1)
    expected = tmp_path / "expected.pt"
    torch.save({"model": model.state_dict(),
                "exp_avg": optimizer.state[model[0].weight]["exp_avg"]}, expected)

    script = f"""
import sys
sys.modules["statereg"] = None  # `import statereg` now fails
import torch
import torch.distributed.checkpoint as dcp
expected = torch.load({str(expected)!r})
model = {{k: torch.zeros_like(v) for k, v in expected["model"].items()}}
dcp.load(model, checkpoint_id={str(tmp_path / "step_00000001" / "model")!r})
assert all(torch.equal(model[k], v) for k, v in expected["model"].items())
moments = {{"state.0.weight.exp_avg": torch.zeros_like(expected["exp_avg"])}}
dcp.load(moments, checkpoint_id={str(tmp_path / "step_00000001" / "optimizer")!r})
assert torch.equal(moments["state.0.weight.exp_avg"], expected["exp_avg"])
assert not [m for m, v in sys.modules.items() if m.startswith("statereg") and v is not None]
print("plain dcp ok")
"""
    done = subprocess.run([sys.executable, "-I", "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "plain dcp ok" in done.stdout
