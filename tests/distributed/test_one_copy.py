"""One stored copy is one rank's: replicated state is never stitched from several ranks, and a
copy that would not stand for every rank is refused before anything is written.

Under DDP each rank updates its own BatchNorm statistics in its forward; DDP broadcasts rank
0's at the next training forward. A checkpoint therefore stores rank 0's buffers (never one
buffer from one rank and the next from another, as DCP's write balancing once did), and a
resume at 3 ranks gives every rank the training losses, eval losses and final buffers of the
uninterrupted run. Where nothing makes rank 0's copy the one every rank goes on with (no
DDP; a `global` object whose value differs by rank), the save is refused naming the key.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from harness import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import statereg
from statereg.errors import CheckpointMismatchError, SpecError

WORLD = 3
SAVE_AT, TOTAL = 3, 7


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8),
                         nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))


def _batch(step: int, rank: int, eval_: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + 10 * rank + eval_)
    # Each rank's data has its own scale, so the ranks' running statistics differ a lot.
    x = torch.randn(5, 6, generator=gen) * (1 + rank)
    return x, x.sum(dim=1, keepdim=True)


def _spec(url: str) -> dict:
    return {"storage": {"url": url}, "components": {
        "model": {"kind": "model"}, "optimizer": {"kind": "optimizer"}}}


def train_bn(rank: int, world: int, url: str, out: str) -> None:
    """TOTAL steps of a DDP loop with BatchNorm, an eval after every step; saves at SAVE_AT
    and, when a checkpoint exists, resumes from it with fresh objects of another seed."""
    torch.manual_seed(0)
    model = _net()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    record: dict[str, list[str]] = {"train": [], "eval": []}
    with statereg.CheckpointManager(_spec(url), model=model, optimizer=optimizer) as mgr:
        if mgr.latest() is not None:
            with torch.no_grad():  # a fresh process: nothing of the saved run is left
                for p in model.parameters():
                    p.mul_(0.5)
                for b in model.buffers():
                    b.fill_(3)
        restored = mgr.load()
        step = 0 if restored is None else restored.step
        while step < TOTAL:
            step += 1
            model.train()
            x, y = _batch(step, rank)
            loss = F.mse_loss(ddp(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step == SAVE_AT and restored is None:
                mgr.save(step=step)  # each rank holds its own statistics here
            # Each rank's own statistics after its step (an eval forward through DDP
            # broadcasts rank 0's first).
            record["buffers"] = [repr(b.flatten().tolist()) for b in model.buffers()]
            model.eval()
            with torch.no_grad():
                ex, ey = _batch(step, rank, eval_=True)
                eval_loss = F.mse_loss(ddp(ex), ey)
            record["train"].append(f"{step}:{loss.item().hex()}")
            record["eval"].append(f"{step}:{eval_loss.item().hex()}")
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))


def _run(fn, tmp: Path, name: str, url: str) -> list[dict]:
    out = tmp / name
    out.mkdir()
    run_ranks(WORLD, fn, tmp, url, str(out))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_ddp_batchnorm_at_3_ranks_resumes_every_rank_exactly(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    reference = _run(train_bn, tmp_path, "reference", url)
    resumed = _run(train_bn, tmp_path, "resumed", url)
    for rank in range(WORLD):
        later = {"train": reference[rank]["train"][SAVE_AT:],
                 "eval": reference[rank]["eval"][SAVE_AT:]}
        assert resumed[rank]["train"] == later["train"], f"rank {rank} training losses"
        assert resumed[rank]["eval"] == later["eval"], f"rank {rank} eval losses"
        assert resumed[rank]["buffers"] == reference[rank]["buffers"], f"rank {rank} buffers"
    # The ranks' statistics really differ (else this test would prove nothing).
    assert reference[0]["buffers"] != reference[1]["buffers"]


def saved_buffers(rank: int, world: int, url: str, out: str) -> None:
    """Save a DDP model whose ranks hold different buffers; write what each rank held."""
    torch.manual_seed(0)
    model = _net()
    ddp = DistributedDataParallel(model)
    x, _ = _batch(1, rank)
    ddp(x)  # each rank's own statistics
    held = {name: b.tolist() for name, b in model.named_buffers()}
    with statereg.CheckpointManager(_spec(url), model=model,
                                    optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as mgr:
        mgr.save(step=1)
    Path(out, f"rank{rank}.json").write_text(json.dumps(held))


def test_every_buffer_of_a_ddp_checkpoint_is_rank_0s(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    held = _run(saved_buffers, tmp_path, "held", url)
    model = _net()
    with statereg.CheckpointManager(_spec(url), model=model,
                                    optimizer=torch.optim.SGD(model.parameters())) as mgr:
        mgr.load()
    for name, buffer in model.named_buffers():
        assert buffer.tolist() == held[0][name], name
        if buffer.is_floating_point():
            assert buffer.tolist() != held[1][name] and buffer.tolist() != held[2][name]


def no_ddp(rank: int, world: int, url: str, out: str) -> None:
    """Ranks that train their own BatchNorm statistics with no DDP to broadcast them."""
    torch.manual_seed(0)
    model = _net()
    model(_batch(1, rank)[0])
    spec = {"storage": {"url": url}, "components": {"model": {"kind": "model"}}}
    with statereg.CheckpointManager(spec, model=model) as mgr:
        try:
            mgr.save(step=1)
        except SpecError as exc:
            Path(out, f"rank{rank}.json").write_text(json.dumps(str(exc)))
            return
    Path(out, f"rank{rank}.json").write_text(json.dumps("saved"))


def test_buffers_that_differ_without_ddp_are_refused_naming_the_buffer(tmp_path: Path) -> None:
    messages = _run(no_ddp, tmp_path, "out", str(tmp_path / "ckpt"))
    for message in messages:
        assert "buffer '1.running_mean' differs between rank 0 and rank(s) [1, 2]" in message
        assert "per_rank" in message and "nothing was saved" in message
    assert not (tmp_path / "ckpt").exists() or not list((tmp_path / "ckpt").glob("step_*"))


class Counter:
    """A custom object whose value is each rank's own (a per-rank sample count)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"seen": self.value, "name": "counter"}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["seen"]


def per_rank_object(rank: int, world: int, url: str, out: str) -> None:
    results = {}
    for sharing in ("global", "replicated", "per_rank"):
        spec = {"storage": {"url": f"{url}-{sharing}"},
                "components": {"counter": {"kind": "custom", "sharing": sharing}}}
        counter = Counter(10 + rank)
        with statereg.CheckpointManager(spec, counter=counter) as mgr:
            try:
                mgr.save(step=1)
            except SpecError as exc:
                results[sharing] = str(exc)
                continue
            counter.value = -1
            mgr.load()
            results[sharing] = counter.value
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


def test_an_object_whose_ranks_differ_is_not_collapsed_to_rank_0s(tmp_path: Path) -> None:
    results = _run(per_rank_object, tmp_path, "out", str(tmp_path / "ckpt"))
    for rank, got in enumerate(results):
        for sharing in ("global", "replicated"):
            assert f"component 'counter' (custom) is declared {sharing}" in got[sharing]
            assert "differs between rank 0 and rank(s) [1, 2] (at key 'seen')" in got[sharing]
            assert "sharing: per_rank" in got[sharing]
        assert got["per_rank"] == 10 + rank


def validated(rank: int, world: int, url: str, out: str) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 3)
    with torch.no_grad():
        model.bias.add_(rank)  # the ranks' "replicas" differ
    spec = {"storage": {"url": url}, "components": {
        "model": {"kind": "model", "sharing": "replicated", "validate": True}}}
    with statereg.CheckpointManager(spec, model=model) as mgr:
        try:
            mgr.save(step=1)
        except CheckpointMismatchError as exc:
            Path(out, f"rank{rank}.json").write_text(json.dumps(str(exc)))


def test_the_validate_message_never_advises_sharded(tmp_path: Path) -> None:
    for message in _run(validated, tmp_path, "out", str(tmp_path / "ckpt")):
        assert "tensor 'bias' differs between rank 0 and rank(s) [1, 2]" in message
        assert "per_rank" in message and "sharded" not in message


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_whole_file_formats_refuse_state_they_cannot_hold(tmp_path: Path, fmt: str) -> None:
    """Not distributed, but the same rule: one copy of exactly what the model holds."""

    class WithExtra(nn.Linear):
        def get_extra_state(self) -> dict:
            return {"calls": 3}

        def set_extra_state(self, state: dict) -> None:
            pass

    spec = {"storage": {"url": str(tmp_path)},
            "components": {"model": {"kind": "model", "format": fmt}}}
    with statereg.CheckpointManager(spec, model=WithExtra(2, 2)) as mgr, \
            pytest.raises(SpecError, match=r"holds _extra_state .*declare the component "
                                           r"format: dcp"):
        mgr.save(step=1)
    assert list(tmp_path.glob("step_*")) == []
