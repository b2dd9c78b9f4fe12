"""The async save's host buffers: one arena, one exact storage per tensor, reused."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from statereg.engine.layouts import Captured
from statereg.engine.staging import StagingArea


def _captured(tensors: dict[str, object]) -> list[Captured]:
    return [Captured(SimpleNamespace(component="model"), tensors=tensors),  # type: ignore[arg-type]
            Captured(SimpleNamespace(component="extra"), meta={"n": 1})]


def _state() -> dict[str, object]:
    return {"w": torch.randn(300, 7), "b": torch.arange(5, dtype=torch.int64),
            "scalar": torch.tensor(3.5, dtype=torch.float64), "empty": torch.empty(0, 4),
            "half": torch.randn(3, 3).half().t(), "flag": torch.tensor([True, False]),
            "name": "not a tensor"}


def test_staged_copies_equal_the_state_and_each_owns_exactly_its_bytes() -> None:
    state = _state()
    staging = StagingArea()
    model, extra = staging.stage(_captured(state))
    assert extra.tensors is None and extra.meta == {"n": 1}
    copies = model.tensors
    assert copies["name"] == "not a tensor"
    for key, original in state.items():
        if not isinstance(original, torch.Tensor):
            continue
        copy = copies[key]
        assert copy.dtype == original.dtype and copy.shape == original.shape
        assert torch.equal(copy, original), key
        # The writer clones a tensor whose storage is larger than it; these never are.
        assert copy.untyped_storage().nbytes() == original.numel() * original.element_size()
        if copy.numel():
            assert copy.data_ptr() % 4096 == 0, key  # each on its own page
    # A copy, not a view: changing the state afterwards leaves the staged bytes alone.
    state["w"].add_(1)
    assert not torch.equal(copies["w"], state["w"])
    assert staging.nbytes >= sum(t.nbytes for t in state.values() if isinstance(t, torch.Tensor))


def test_buffers_are_reused_while_shapes_stay_and_rebuilt_when_they_change() -> None:
    state = _state()
    staging = StagingArea()
    first = staging.stage(_captured(state))[0].tensors["w"].data_ptr()
    state["w"].mul_(2)
    again = staging.stage(_captured(state))[0].tensors
    assert again["w"].data_ptr() == first
    assert torch.equal(again["w"], state["w"])
    state["w"] = torch.randn(10, 10)
    changed = staging.stage(_captured(state))[0].tensors
    assert changed["w"].shape == (10, 10) and torch.equal(changed["w"], state["w"])
