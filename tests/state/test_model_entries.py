"""Every entry of a model's state_dict() comes back exactly, or the save is refused up front.

Generated from a table: each row is a module whose state dict holds something other than
plain dense parameters and buffers (extra state, quantized modules and tensors, sparse
tensors, tensor subclasses, computed entries), with the outcome it must have: "exact" (a
fresh module of another seed, loaded strictly, equals the saved one entry for entry and
output for output) or a statereg error naming the entry, raised before any file exists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import statereg
from statereg.errors import SpecError

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


class Calibrated(nn.Module):
    """Extra state beside a parameter: counters and a calibration dict with a tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0
        self.calib = {"scale": 1.0, "hist": torch.zeros(3)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.calib["scale"] + self.calls

    def get_extra_state(self) -> dict[str, Any]:
        return {"calls": self.calls, "calib": self.calib}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.calls, self.calib = state["calls"], state["calib"]


class Opaque:
    """Extra state of a type torch.load(weights_only=True) does not allow."""


class OpaqueExtra(nn.Linear):
    def get_extra_state(self) -> Opaque:
        return Opaque()

    def set_extra_state(self, state: Any) -> None:
        pass


class WithBuffer(nn.Module):
    def __init__(self, buffer: torch.Tensor) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("extra", buffer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class Marked(torch.Tensor):
    """A tensor subclass torch's weights-only loader does not know."""


def _calibrated(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    module = nn.Sequential(Calibrated(), nn.ReLU(), Calibrated())
    module[0].calls, module[2].calib = 5 * seed + 1, {"scale": 0.5 + seed,
                                                       "hist": torch.rand(3)}
    return module


def _dynamic(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    float_model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    return torch.ao.quantization.quantize_dynamic(float_model, {nn.Linear}, dtype=torch.qint8)


class _Static(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = torch.ao.quantization.QuantStub()
        self.lin = nn.Linear(8, 4)
        self.dequant = torch.ao.quantization.DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.lin(self.quant(x)))


def _static(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    module = _Static().eval()
    module.qconfig = torch.ao.quantization.get_default_qconfig("fbgemm")
    prepared = torch.ao.quantization.prepare(module)
    prepared(torch.randn(16, 8))
    return torch.ao.quantization.convert(prepared)


def _buffer(make: Callable[[int], torch.Tensor]) -> Callable[[int], nn.Module]:
    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return WithBuffer(make(seed))
    return build


@dataclass(frozen=True)
class Row:
    build: Callable[[int], nn.Module]
    outcome: str  # "exact", or the start of the refusal's message
    fmt: str = "dcp"


ROWS: dict[str, Row] = {
    "get_extra_state": Row(_calibrated, "exact"),
    "dynamic quantization": Row(_dynamic, "exact"),
    "static quantization": Row(_static, "exact"),
    "quantized buffer": Row(_buffer(lambda s: torch.quantize_per_tensor(
        torch.rand(4) + s, 0.1, 0, torch.qint8)), "exact"),
    "sparse COO buffer": Row(_buffer(lambda s: torch.sparse_coo_tensor(
        [[0, 2]], [1.0 + s, 2.0], (4,))), "exact"),
    "sparse CSR buffer": Row(_buffer(lambda s: torch.tensor(
        [[0.0, 1.0 + s], [2.0, 0.0]]).to_sparse_csr()), "exact"),
    "nested buffer": Row(_buffer(lambda s: torch.nested.nested_tensor(
        [torch.ones(2) * s, torch.ones(3)])), "component 'model' (model): entry 'extra' is a "
        "nested tensor"),
    "subclass buffer": Row(_buffer(lambda s: torch.rand(3).as_subclass(Marked)),
                           "component 'model' (model): state_dict() entry 'extra' (a tensor "
                           "subclass Marked) would not load back"),
    "opaque extra state": Row(lambda s: OpaqueExtra(2, 2), "component 'model' (model): "
                              "state_dict() entry '_extra_state' (a Opaque) would not load back"),
    "extra state as safetensors": Row(_calibrated, "component 'model': format 'safetensors' "
                                      "holds plain tensors only", fmt="safetensors"),
}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.layout != b.layout or a.dtype != b.dtype:
            return False
        if a.is_quantized:
            return (a.qscheme() == b.qscheme() and torch.equal(a.int_repr(), b.int_repr())
                    and torch.equal(a.dequantize(), b.dequantize()))
        if a.layout != torch.strided:
            return torch.equal(a.to_dense(), b.to_dense())
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _spec(root: Path, fmt: str) -> dict[str, Any]:
    return {"storage": {"url": str(root)}, "components": {"model": {"kind": "model",
                                                                     "format": fmt}}}


@pytest.mark.parametrize("name", sorted(ROWS))
def test_every_state_dict_entry_round_trips_or_the_save_is_refused(tmp_path: Path,
                                                                    name: str) -> None:
    row = ROWS[name]
    saved = row.build(1)
    if row.outcome != "exact":
        # Refused when the manager is built, or at the latest by save(), before any file.
        with pytest.raises(SpecError) as refused, \
                statereg.CheckpointManager(_spec(tmp_path, row.fmt), model=saved) as mgr:
            mgr.save(step=1)
        assert str(refused.value).startswith(row.outcome), str(refused.value)
        assert list(tmp_path.iterdir()) == [], "a refused save must write nothing"
        return
    with statereg.CheckpointManager(_spec(tmp_path, row.fmt), model=saved) as mgr:
        mgr.save(step=1)
    fresh = row.build(2)
    assert not _equal(saved.state_dict(), fresh.state_dict()), "the rows must start apart"
    with statereg.CheckpointManager(_spec(tmp_path, row.fmt), model=fresh) as mgr:
        result = mgr.load(strict=True)
    assert result is not None and result.step == 1
    assert _equal(saved.state_dict(), fresh.state_dict())
    if not isinstance(saved, WithBuffer):
        x = torch.randn(3, 8 if name.endswith("quantization") else 4)
        assert torch.equal(saved(x), fresh(x))
    statereg.verify(str(tmp_path / "step_00000001"))  # raises if any file is damaged


class Uncalibrated(nn.Module):
    """Calibrated's parameters without its extra state."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)


def test_saved_extra_state_is_reported_to_a_module_without_it(tmp_path: Path) -> None:
    saved = _calibrated(1)
    with statereg.CheckpointManager(_spec(tmp_path, "dcp"), model=saved) as mgr:
        mgr.save(step=1)
    plain = nn.Sequential(Uncalibrated(), nn.ReLU(), Uncalibrated())
    with statereg.CheckpointManager(_spec(tmp_path, "dcp"), model=plain) as mgr:
        with pytest.raises(statereg.errors.CheckpointMismatchError,
                           match=r"not in model: 0\._extra_state, 2\._extra_state"):
            mgr.load()
        result = mgr.load(strict=False)
    assert result is not None
    assert torch.equal(plain[0].lin.weight, saved[0].lin.weight)


class Shaped:
    """A custom object stored with format dcp: nested tensors and a number."""

    def __init__(self, size: int) -> None:
        self.state = {"t": torch.zeros(size), "nested": {"a": torch.ones(2)}, "n": 1}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


def test_a_dcp_object_of_another_shape_is_a_mismatch_and_the_run_keeps_saving(
        tmp_path: Path) -> None:
    spec = {"storage": {"url": str(tmp_path)},
            "components": {"obj": {"kind": "custom", "format": "dcp"}}}
    with statereg.CheckpointManager(spec, obj=Shaped(3)) as mgr:
        mgr.save(step=1)
    other = Shaped(5)
    with statereg.CheckpointManager(spec, obj=other) as mgr:
        with pytest.raises(statereg.errors.CheckpointMismatchError,
                           match=r"t \(checkpoint \[3\] torch.float32, object \[5\]"):
            mgr.load()
        assert torch.equal(other.state["t"], torch.zeros(5))  # untouched
        mgr.save(step=2)  # the failed load changed nothing, so saving goes on
    assert (tmp_path / "step_00000002" / "manifest.json").is_file()


@pytest.mark.parametrize("value", ["coo", "csr", "nested", "quantized"])
def test_a_dcp_object_holding_a_tensor_dcp_cannot_store_is_refused_before_any_file(
        tmp_path: Path, value: str) -> None:
    tensor = {"coo": lambda: torch.eye(3).to_sparse(),
              "csr": lambda: torch.eye(3).to_sparse_csr(),
              "nested": lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
              "quantized": lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0,
                                                             torch.qint8)}[value]()
    spec = {"storage": {"url": str(tmp_path)},
            "components": {"obj": {"kind": "custom", "format": "dcp"}}}
    obj = Shaped(2)
    obj.state["nested"]["odd"] = tensor
    refusal = (r"component 'obj' \(custom, format dcp\): entry 'nested.odd' is a .*declare "
               r"the component format: torch")
    with statereg.CheckpointManager(spec, obj=obj) as mgr, pytest.raises(SpecError,
                                                                          match=refusal):
        mgr.save(step=1)
    assert list(tmp_path.iterdir()) == []
