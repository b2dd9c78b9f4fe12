"""The tiny trainer the memory-tier tests share: a model and AdamW whose state after step s
is the same bits in every process, so a resumed run compares bit for bit with one that
never stopped. Its own module, so forkserver children import it by name."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import statereg


class Trainee:
    """`width` inputs, `hidden` units, 4 outputs; `step(s)` trains on batch s of `rows` rows,
    drawn from a generator seeded with s."""

    def __init__(self, width: int = 8, hidden: int = 16, rows: int = 4, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(width, hidden), nn.Tanh(), nn.Linear(hidden, 4))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.01)
        self.width, self.rows = width, rows

    def train_on(self, batch: torch.Tensor) -> None:
        self.model(batch).square().mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def step(self, step: int) -> None:
        self.train_on(torch.randn(self.rows, self.width,
                                  generator=torch.Generator().manual_seed(step)))

    def manager(self, spec: Any, **objects: Any) -> statereg.CheckpointManager:
        return statereg.CheckpointManager(spec, model=self.model, optimizer=self.optimizer,
                                          **objects)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the model and the optimizer, copied, by name."""
        found = {f"model.{k}": v.clone() for k, v in self.model.state_dict().items()}
        for index, state in self.optimizer.state_dict()["state"].items():
            found.update({f"opt.{index}.{k}": torch.as_tensor(v).clone()
                          for k, v in state.items()})
        return found
