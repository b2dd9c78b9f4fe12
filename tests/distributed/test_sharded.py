"""sharing: sharded — FSDP2 model and AdamW saved at one world size, loaded at others.

Every tensor (weights and optimizer moments) must equal the unsharded reference bit for bit,
on local disk and on object stores; a parameter that never had a gradient must still have no
optimizer state, and gets it from its first real step after the load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from harness import MEMORY_IS_PROCESS_LOCAL, run_ranks
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

    def forward(self, x: torch.Tensor, use_all: bool = False) -> torch.Tensor:
        y = self.out(torch.relu(self.inp(x)))
        return self.unused(y) if use_all else y


def _spec(url: str, options: dict[str, Any]) -> dict:
    return {"storage": {"url": url, "options": options},
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


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int,
           use_all: bool = False) -> None:
    gen = torch.Generator().manual_seed(123)  # same batches on every rank
    for _ in range(steps):
        model(torch.randn(8, 6, generator=gen), use_all).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _steps(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, float]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: entries["step"].item() for p, entries in opt.state.items()}


def save_sharded(rank: int, world: int, url: str, options: dict, reference: Path,
                 step: int) -> None:
    model, opt = _build(seed=0, shard=True)
    _train(model, opt, 3)
    statereg.CheckpointManager(_spec(url, options), model=model, optimizer=opt).save(step=step)
    snap = _snapshot(model, opt)
    if rank == 0:
        torch.save(snap, reference)


def load_and_compare(rank: int, world: int, url: str, options: dict, reference: Path,
                     resave: int) -> None:
    model, opt = _build(seed=rank + 99, shard=True)  # different init: the load must overwrite
    mgr = statereg.CheckpointManager(_spec(url, options), model=model, optimizer=opt)
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
    # Training goes on, now through the unused layer too: its first gradient gives it
    # optimizer state, while the others count on from the loaded step.
    _train(model, opt, 1, use_all=True)
    assert _steps(model, opt) == {**dict.fromkeys(["inp.weight", "inp.bias", "out.weight",
                                                   "out.bias"], 4.0),
                                  "unused.weight": 1.0, "unused.bias": 1.0}


def _check_saved_on_4_ranks(url: str, options: dict[str, Any]) -> None:
    manifest = statereg.read_manifest(f"{url}/step_00000010", options)
    assert manifest.world_size == 4
    # model/..., or writer-<token>/model/... on a store that ignores conditional creates
    assert {f.path.split("/")[-1] for f in manifest.files if "model/" in f.path} >= {
        "__0_0.distcp", "__3_0.distcp", ".metadata"}


def test_fsdp2_checkpoint_reshards_4_to_2_to_1_and_back_to_4(tmp_path: Path) -> None:
    url, reference = str(tmp_path / "ckpt"), tmp_path / "reference.pt"
    run_ranks(4, save_sharded, tmp_path, url, {}, reference, 10)
    _check_saved_on_4_ranks(url, {})

    run_ranks(2, load_and_compare, tmp_path, url, {}, reference, 20)

    # World size 1: a plain, unsharded model in this process (no process group at all).
    model, opt = _build(seed=5, shard=False)
    statereg.CheckpointManager(_spec(url, {}), model=model, optimizer=opt).load(step=10)
    snap = _snapshot(model, opt)
    expected = torch.load(reference)
    assert snap.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(snap[key], value), key
    assert opt.state_dict()["param_groups"][0]["lr"] == 0.05

    # And back up: the checkpoint written at world size 2 loads at world size 4.
    run_ranks(4, load_and_compare, tmp_path, url, {}, tmp_path / "resaved.pt", 0)


@pytest.mark.parametrize("store", [MEMORY_IS_PROCESS_LOCAL, "s3", "gcs"], indirect=True)
def test_fsdp2_checkpoint_on_an_object_store_reshards_4_to_2(store, tmp_path: Path) -> None:
    """Every rank writes its shards to, and reads them back from, the shared object store."""
    reference = tmp_path / "reference.pt"
    run_ranks(4, save_sharded, tmp_path, store.url, store.options, reference, 10)
    _check_saved_on_4_ranks(store.url, store.options)
    run_ranks(2, load_and_compare, tmp_path, store.url, store.options, reference, 20)
    assert statereg.read_manifest(f"{store.url}/step_00000020", store.options).world_size == 2


def async_save_of_shards(rank: int, world: int, root: str) -> None:
    # Staging copies each rank's shards (a DTensor's local tensor) and keeps the layout.
    model, opt = _build(seed=0, shard=True)
    _train(model, opt, 2)
    before = _snapshot(model, opt)
    spec = {**_spec(root, {}), "save": {"async": "thread", "early_return": True}}
    mgr = statereg.CheckpointManager(spec, model=model, optimizer=opt)
    mgr.save(step=1).wait_staged()
    _train(model, opt, 1)  # the state moves on while the write runs
    mgr.close()
    fresh_model, fresh_opt = _build(seed=rank + 99, shard=True)
    statereg.CheckpointManager(_spec(root, {}), model=fresh_model, optimizer=fresh_opt).load()
    after = _snapshot(fresh_model, fresh_opt)
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert torch.equal(after[key], value), f"rank {rank}: {key} is not the staged state"


def test_an_async_early_return_save_of_fsdp2_shards_holds_the_state_at_save(
        tmp_path: Path) -> None:
    run_ranks(2, async_save_of_shards, tmp_path, str(tmp_path / "ckpt"))
