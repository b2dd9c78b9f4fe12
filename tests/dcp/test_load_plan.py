"""statereg's local load plan equals DCP's, item for item, for every kind of entry a load
meets: the direct path for whole plain tensors, and DCP's own for everything else."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from statereg.dcp.reader import _local_plan


def whole(tensor: torch.Tensor) -> TensorStorageMetadata:
    """How a save of `tensor` on one rank describes it: one chunk of its own shape."""
    size = tensor.size()
    return TensorStorageMetadata(TensorProperties(dtype=tensor.dtype), size,
                                 [ChunkStorageMetadata(torch.Size([0] * len(size)), size)])


def chunked(size: tuple[int, ...], rows: int) -> TensorStorageMetadata:
    """A tensor saved as row blocks by several ranks (resharded on load)."""
    chunks = [ChunkStorageMetadata(torch.Size([start] + [0] * (len(size) - 1)),
                                   torch.Size([min(rows, size[0] - start), *size[1:]]))
              for start in range(0, size[0], rows)]
    return TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(size), chunks)


CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "plain tensors of every rank": (
        {"s": torch.tensor(3.0), "v": torch.zeros(7), "m": torch.zeros(3, 4),
         "t": torch.zeros(2, 3, 5, dtype=torch.bfloat16)},
        {}),
    "empty tensors": ({"e": torch.zeros(0), "e2": torch.zeros(3, 0)}, {}),
    "a parameter": ({"p": nn.Parameter(torch.zeros(4, 4))}, {}),
    "bytes entries": ({"x": 5, "y": {"a": 1}}, {"x": BytesStorageMetadata(),
                                                 "y": BytesStorageMetadata()}),
    "stored in chunks by several ranks": ({"c": torch.zeros(10, 3)}, {"c": chunked((10, 3), 4)}),
    "stored as one chunk at an offset": (
        {"o": torch.zeros(4)},
        {"o": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4]),
                                    [ChunkStorageMetadata(torch.Size([0]), torch.Size([2])),
                                     ChunkStorageMetadata(torch.Size([2]), torch.Size([2]))])}),
    "a non-contiguous tensor": ({"n": torch.zeros(4, 6).t()}, {}),
    "mixed, in order": (
        {"a": torch.zeros(3), "b": 7, "c": torch.zeros(10, 3), "d": torch.zeros(2, 2)},
        {"b": BytesStorageMetadata(), "c": chunked((10, 3), 3)}),
}


def metadata_for(state: dict[str, Any], stored: dict[str, Any]) -> Metadata:
    described = {fqn: stored.get(fqn) or whole(obj) for fqn, obj in state.items()}
    return Metadata(state_dict_metadata=described)


@pytest.mark.parametrize("case", list(CASES))
def test_the_local_plan_is_dcps_item_for_item(case: str) -> None:
    state, stored = CASES[case]
    metadata = metadata_for(state, stored)
    for strict in (True, False):
        ours = _local_plan(state, metadata, strict).items
        theirs = create_default_local_load_plan(state, metadata, strict).items
        assert ours == theirs
        assert ours or case == "empty tensors"  # DCP reads nothing for those


def test_a_missing_key_and_another_size_fail_as_dcp_fails() -> None:
    stored = metadata_for({"a": torch.zeros(3)}, {})
    for state, strict in (({"a": torch.zeros(3), "gone": torch.zeros(2)}, True),
                          ({"a": torch.zeros(4)}, True), ({"a": torch.zeros(4)}, False)):
        with pytest.raises(Exception) as ours:
            _local_plan(state, stored, strict)
        with pytest.raises(Exception) as theirs:
            create_default_local_load_plan(state, stored, strict)
        assert (type(ours.value), str(ours.value)) == (type(theirs.value), str(theirs.value))
    relaxed = {"a": torch.zeros(3), "gone": torch.zeros(2)}
    assert _local_plan(relaxed, stored, False).items == \
        create_default_local_load_plan(relaxed, stored, False).items
