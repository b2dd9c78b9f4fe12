"""The acceptance sweep of issue 14: single-bit flips through the DEFAULT `load()`.

What is swept. Two checkpoints of one tiny state are saved side by side, one uncompressed
and one zstd-compressed (float-aware), with one writer thread; the state has three
components: `model` (a 2 -> 1 Linear without bias: one tensor item), `optimizer` (SGD with
momentum: one tensor item, param groups in `extra.json`) and `scheduler` (StepLR, json).
For each checkpoint:

- every byte of every file the load reads (`model/__0_0.distcp`, `model/.metadata`,
  `optimizer/__0_0.distcp`, `optimizer/.metadata`, `optimizer/extra.json`,
  `scheduler/state.json`), each with one bit flipped: bit (offset mod 8), so every bit
  position occurs throughout each file;
- all eight bits of every byte of the model's tensor payload in the uncompressed data file
  (the bytes that load straight into the live parameter).

`manifest.json` and `manifest.sum` are swept byte by byte in test_corruption.py.
Each flip is loaded with `mgr.load(url)` (verify="fast", the default) and must raise
CorruptCheckpointError naming the flipped file. Then the live objects are exactly as they
were, or `save()` refuses (the load had started to overwrite them; docs/reliability.md).
After the first refusal in each file, loading the intact step 1 restores every component and
the sweep goes on with that manager; after the others it goes on with fresh objects and a
fresh manager. The restoring load is a whole load of step 1 whatever the failed load left
behind (it overwrites every component and clears the refusal, which a save then shows), so
one per file, the component it damaged, shows it; one per refusal cost half the sweep's time.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from reliability_kit import assert_identical
from torch import nn

import statereg

FILES = ["model/__0_0.distcp", "model/.metadata", "optimizer/__0_0.distcp",
         "optimizer/.metadata", "optimizer/extra.json", "scheduler/state.json"]


class Tiny:
    """The swept state; `trained(step)` gives the same bits on every run."""

    def __init__(self, step: int) -> None:
        torch.manual_seed(0)
        self.model = nn.Linear(2, 1, bias=False)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1)
        gen = torch.Generator().manual_seed(step)
        for _ in range(step):
            self.model(torch.randn(3, 2, generator=gen)).pow(2).mean().backward()
            self.optimizer.step()
            self.scheduler.step()

    def objects(self) -> dict[str, object]:
        return {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler}

    def snapshot(self) -> dict[str, object]:
        return {"model": {k: v.clone() for k, v in self.model.state_dict().items()},
                "optimizer": {k: v.clone() for k, v in
                              self.optimizer.state_dict()["state"][0].items()},
                "groups": self.optimizer.state_dict()["param_groups"],
                "scheduler": dict(self.scheduler.state_dict())}


def declaration(root: Path, compression: str) -> dict:
    storage = {"url": str(root), "io_threads": 1}
    if compression != "none":
        storage["compression"] = {"codec": "zstd", "float_aware": True}
    return {"storage": storage,
            "components": {"model": {"kind": "model"}, "optimizer": {"kind": "optimizer"},
                           "scheduler": {"kind": "scheduler"}}}


def flips(directory: Path, payload: bytes) -> list[tuple[str, int, int]]:
    """(file, byte offset, bit) of every flip swept in one checkpoint (module docstring)."""
    chosen = []
    for name in FILES:
        size = (directory / name).stat().st_size
        chosen += [(name, offset, offset % 8) for offset in range(size)]
    data = (directory / "model/__0_0.distcp").read_bytes()
    start = data.find(payload)
    if start >= 0:  # uncompressed: the parameter's bytes lie in the file as they are
        assert data.find(payload, start + 1) < 0
        chosen += [("model/__0_0.distcp", offset, bit)
                   for offset in range(start, start + len(payload)) for bit in range(8)
                   if bit != offset % 8]
    return chosen


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_every_swept_bit_flip_is_caught_and_leaves_nothing_usable_damaged(tmp_path, compression,
                                                                          report_figure):
    decl = declaration(tmp_path, compression)
    for step in (1, 2):
        statereg.CheckpointManager(decl, **Tiny(step).objects()).save(step=step)
    url = str(tmp_path / "step_00000002")
    live = Tiny(1)
    mgr = statereg.CheckpointManager(decl, **live.objects())
    before = live.snapshot()
    saved = Tiny(2).snapshot()
    payload = Tiny(2).model.weight.detach().numpy().tobytes()
    swept = flips(tmp_path / "step_00000002", payload)
    outcomes = {"unchanged": 0, "refused": 0}
    restored: set[str] = set()  # files after whose first refusal a load restored everything
    started = time.perf_counter()

    for name, offset, bit in swept:
        path = tmp_path / "step_00000002" / name
        original = path.read_bytes()
        damaged = bytearray(original)
        damaged[offset] ^= 1 << bit
        path.write_bytes(bytes(damaged))
        label = f"{compression}: {name} byte {offset} bit {bit}"
        with pytest.raises(statereg.CorruptCheckpointError) as info:
            mgr.load(url)
        assert f"{url}/{name}" in str(info.value), f"{label}: {info.value}"
        try:
            assert_identical(live.snapshot(), before, label)
            outcomes["unchanged"] += 1
        except AssertionError:
            with pytest.raises(statereg.StateregError, match=r"refused: loading .* failed"):
                mgr.save(step=3)
            outcomes["refused"] += 1
            if name not in restored:
                assert mgr.load(step=1).step == 1  # restores every component, clears the refusal
                assert_identical(live.snapshot(), before, f"{label}, restored")
                restored.add(name)
                mgr.save(step=2 + len(restored))  # the refusal is cleared
            else:
                live = Tiny(1)
                mgr = statereg.CheckpointManager(decl, **live.objects())
        path.write_bytes(original)

    elapsed = time.perf_counter() - started
    report_figure(f"{compression}: {len(swept)} single-bit flips through the default load(), "
                  f"all CorruptCheckpointError; {outcomes['unchanged']} left the live objects "
                  f"unchanged, {outcomes['refused']} made save() refuse ({elapsed:.1f} s)")
    assert sum(outcomes.values()) == len(swept) > 3000
    assert "optimizer/__0_0.distcp" in restored  # a failed load always overwrote the model
    assert mgr.load(url).step == 2  # the intact checkpoint loads, bit for bit
    assert_identical(live.snapshot(), saved)
    mgr.save(step=9)
