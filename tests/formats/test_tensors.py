"""Consolidation on real ranks: an FSDP2 model saved as safetensors holds full tensors.

Two gloo processes shard the model unevenly (3 output rows over 2 ranks); rank 0 writes the
files. Any reader sees whole tensors, and the files load back at world size 2 and 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import safetensors.torch
import torch
from harness import run_ranks
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import statereg


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 10)
        self.out = nn.Linear(10, 3)  # 3 rows over 2 ranks: an uneven shard


def _build(seed: int, shard: bool) -> nn.Module:
    torch.manual_seed(seed)
    model = Net()
    if shard:
        fully_shard(model.inp)
        fully_shard(model.out)
        fully_shard(model)
    return model


def _spec(root: Path) -> dict:
    # A small bound puts the tensors in several files, gathered one file at a time.
    return {"storage": {"url": str(root)},
            "components": {"model": {"kind": "model", "format": "safetensors",
                                     "max_shard_size": 200}},
            "save": {"async": "thread"}}


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded copies of every weight (a collective for DTensors)."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}


def save_and_load_sharded(rank: int, world: int, root: Path, reference: Path) -> None:
    model = _build(seed=0, shard=True)
    with statereg.CheckpointManager(_spec(root), model=model) as mgr:
        mgr.save(step=1)  # written and committed by a background thread
    dcp_spec = {"storage": {"url": f"{root}-dcp"}, "components": {"model": {"kind": "model"}}}
    statereg.CheckpointManager(dcp_spec, model=model).save(step=1)
    expected = _full(model)
    if rank == 0:
        torch.save(expected, reference)

    other = _build(seed=rank + 9, shard=True)  # other values: the load must overwrite them
    statereg.CheckpointManager(_spec(root), model=other).load()
    for key, value in _full(other).items():
        assert torch.equal(value, expected[key]), f"rank {rank}: {key}"


def test_an_fsdp2_model_is_consolidated_into_full_safetensors(tmp_path: Path) -> None:
    root, reference = tmp_path / "ckpt", tmp_path / "reference.pt"
    run_ranks(2, save_and_load_sharded, tmp_path, root, reference)
    expected = torch.load(reference)

    directory = root / "step_00000001" / "model"
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    files = sorted(directory.glob("model-*.safetensors"))
    assert len(files) > 1
    stored: dict[str, torch.Tensor] = {}
    for file in files:
        tensors = safetensors.torch.load_file(file)
        assert not stored.keys() & tensors.keys()
        stored.update(tensors)
    assert stored.keys() == index["weight_map"].keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(stored[key], value), key
    manifest = statereg.read_manifest(str(root / "step_00000001"))
    assert manifest.world_size == 2
    assert {f.path for f in manifest.files} == {f"model/{f.name}" for f in files} | {
        "model/model.safetensors.index.json"}

    plain = _build(seed=5, shard=False)  # world size 1, no process group
    statereg.CheckpointManager(_spec(root), model=plain).load()
    for key, value in plain.state_dict().items():
        assert torch.equal(value, expected[key]), key

    # A DCP checkpoint of the same shards exports to the same full tensors.
    done = statereg.export_hf(f"{root}-dcp/step_00000001", tmp_path / "hf")
    exported = safetensors.torch.load_file(tmp_path / "hf" / done.files[0])
    assert exported.keys() == expected.keys()
    assert all(torch.equal(exported[k], v) for k, v in expected.items())
