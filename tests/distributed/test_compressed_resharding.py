"""Compressed checkpoints of FSDP-sharded state load bit-exact at other world sizes.

A compressed tensor item decodes straight into its destination only where the destination
is exactly the stored chunk (statereg.dcp.codec.decode_into, FrameStream); a chunk that a
rank needs only part of, or that fills part of a larger tensor, must still load exactly.
Real gloo groups of 1, 2 and 4 processes; float-aware (planes) and plain zstd items.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from harness import run_ranks
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import statereg


def made(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """fp32 and bf16 weights whose shards stay over 64 KiB at four ranks (float planes),
    small biases (plain zstd frames), and AdamW state."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(512, 256), nn.Linear(256, 512).bfloat16())
    if dist.get_world_size() > 1:
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters())
    for param in model.parameters():  # no RNG: the same values at every world size
        param.grad = param.detach() * 0.5
    opt.step()
    return model, opt


def full(values: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {key: (value.full_tensor() if isinstance(value, DTensor) else value).clone()
            for key, value in values.items() if isinstance(value, torch.Tensor | DTensor)}


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    state = full(model.state_dict())
    for i, entries in enumerate(opt.state.values()):
        state.update({f"opt.{i}.{k}": v for k, v in full(entries).items()})
    return state


def spec(url: Path, float_aware: bool) -> dict[str, Any]:
    return {"storage": {"url": str(url),
                        "compression": {"codec": "zstd", "float_aware": float_aware}},
            "components": {"model": {"kind": "model", "sharing": "sharded"},
                           "optimizer": {"kind": "optimizer", "sharing": "sharded"}}}


def save_then_load(rank: int, world: int, root: Path, saved_at: int | None) -> None:
    for float_aware in (True, False):
        declared = spec(root / f"fa{float_aware}-ws{saved_at or world}", float_aware)
        if saved_at is None:
            model, opt = made(0)
            statereg.CheckpointManager(declared, model=model, optimizer=opt).save(step=1)
        expected = snapshot(*made(0))  # the same seed: the saved values, at this world size
        model, opt = made(1)
        statereg.CheckpointManager(declared, model=model, optimizer=opt).load()
        loaded = snapshot(model, opt)
        assert loaded.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(loaded[key].reshape(-1).view(torch.uint8),
                               value.reshape(-1).view(torch.uint8)), (
                f"{key}: not bit-identical at world size {world} from {saved_at or world}, "
                f"float_aware={float_aware}")


def test_compressed_sharded_state_loads_exactly_at_other_world_sizes(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    run_ranks(2, save_then_load, tmp_path, root, None)
    run_ranks(1, save_then_load, tmp_path, root, 2)
    run_ranks(4, save_then_load, tmp_path, root, 2)
