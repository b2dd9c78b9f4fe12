"""A tiny training run (model, AdamW, scheduler, global RNG) and exact comparisons of its state."""

from __future__ import annotations

import copy
import random
from typing import Any

import numpy as np
import torch
from torch import nn

COMPONENTS = {
    "model": {"kind": "model"},
    "optimizer": {"kind": "optimizer"},
    "scheduler": {"kind": "scheduler"},
    "rng": {"kind": "rng"},
}


class TinyRun:
    """The live objects of one training process."""

    def __init__(self, seed: int, width: int = 16) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 4))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=2, gamma=0.5)

    @property
    def objects(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler}

    def train(self, steps: int = 2) -> None:
        for _ in range(steps):
            loss = self.model(torch.randn(4, 8)).pow(2).mean()
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            self.scheduler.step()

    def snapshot(self) -> dict[str, Any]:
        """A deep copy of every component's state, for exact comparison later."""
        return {
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "scheduler": copy.deepcopy(self.scheduler.state_dict()),
        }


def next_draws() -> tuple[Any, ...]:
    """The next value of every global generator (advances them, as training would)."""
    return random.random(), float(np.random.rand()), torch.rand(3)


def assert_identical(actual: Any, expected: Any, where: str = "state") -> None:
    """Equal structure and values; tensors bit-exact (same dtype, shape and bytes)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: {type(actual).__name__}, not a tensor"
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), where
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), where
        for key in expected:
            assert_identical(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_identical(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"
