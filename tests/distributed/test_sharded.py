"""sharing: sharded — FSDP2 model and AdamW saved at one world size, loaded at others.

Every tensor (weights and optimizer moments) must equal the unsharded reference bit for bit,
and a parameter that never had a gradient must still have no optimizer state.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from harness import run_ranks
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import statereg


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 10)
        self.out = nn.Linear(10, 3)
        self.unused = nn.Linear(3, 3)  # never in forward: no gradient, no optimizer state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inp(x)))


def _spec(root: Path) -> dict:
    return {"storage": {"url": str(root)},
            "components": {"model": {"kind": "model"}, "optimizer": {"kind": "optimizer"}}}


def _build(seed: int, shard: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    if shard:
        fully_shard(model.inp)
        fully_shard(model.out)
        fully_shard(model.unused)
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Unsharded copies of every weight and optimizer state entry, by name (collective)."""
    names = {id(p): n for n, p in model.named_parameters()}
    snap = {f"w.{k}": _full(v).clone() for k, v in model.state_dict().items()}
    for param, entries in opt.state.items():
        for key, value in entries.items():
            snap[f"o.{names[id(param)]}.{key}"] = _full(value).clone()
    return snap


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(123)  # same batches on every rank
    for _ in range(steps):
        model(torch.randn(8, 6, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def save_sharded(rank: int, world: int, root: Path, reference: Path, step: int) -> None:
    model, opt = _build(seed=0, shard=True)
    _train(model, opt, 3)
    statereg.CheckpointManager(_spec(root), model=model, optimizer=opt).save(step=step)
    snap = _snapshot(model, opt)
    if rank == 0:
        torch.save(snap, reference)


def load_and_compare(rank: int, world: int, root: Path, reference: Path, resave: int) -> None:
    model, opt = _build(seed=rank + 99, shard=True)  # different init: the load must overwrite
    mgr = statereg.CheckpointManager(_spec(root), model=model, optimizer=opt)
    mgr.load()
    snap = _snapshot(model, opt)
    expected = torch.load(reference)
    assert snap.keys() == expected.keys(), sorted(set(snap) ^ set(expected))
    for key, value in expected.items():
        assert torch.equal(snap[key], value), f"rank {rank}: {key} differs after load"
    assert not any(k.startswith("o.unused.") for k in snap)
    if resave:
        mgr.save(step=resave)
        if rank == 0:
            torch.save(snap, reference.with_name("resaved.pt"))
    dist.barrier()


def test_fsdp2_checkpoint_reshards_4_to_2_to_1_and_back_to_4(tmp_path: Path) -> None:
    root, reference = tmp_path / "ckpt", tmp_path / "reference.pt"
    run_ranks(4, save_sharded, tmp_path, root, reference, 10)
    manifest = statereg.read_manifest(str(root / "step_00000010"))
    assert manifest.world_size == 4
    assert {f.path.split("/")[-1] for f in manifest.files if f.path.startswith("model/")} >= {
        "__0_0.distcp", "__3_0.distcp", ".metadata"}

    run_ranks(2, load_and_compare, tmp_path, root, reference, 20)

    # World size 1: a plain, unsharded model in this process (no process group at all).
    model, opt = _build(seed=5, shard=False)
    statereg.CheckpointManager(_spec(root), model=model, optimizer=opt).load(step=10)
    snap = _snapshot(model, opt)
    expected = torch.load(reference)
    assert snap.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(snap[key], value), key
    assert opt.state_dict()["param_groups"][0]["lr"] == 0.05

    # And back up: the checkpoint written at world size 2 loads at world size 4.
    run_ranks(4, load_and_compare, tmp_path, root, tmp_path / "resaved.pt", 0)
