"""Shared builders for the suite: tiny models, a tiny dataset and a declaration factory.

Everything here is small on purpose: the whole suite runs on two CPU cores in well under a
minute. Storage roots live under pytest's `tmp_path`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import statereg


def pytest_configure(config: pytest.Config) -> None:
    # torchdata's StatefulDataLoader calls a deprecated torch API on every construction.
    config.addinivalue_line("filterwarnings", "ignore:'set_vital' is deprecated:UserWarning")


class TinyNet(nn.Module):
    """Linear -> ReLU -> Dropout -> Linear: 8 features in, 1 out."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


@pytest.fixture
def make_model() -> Callable[..., TinyNet]:
    """`make_model(seed=0, dropout=0.0)`: a TinyNet whose weights depend only on `seed`."""

    def build(seed: int = 0, dropout: float = 0.0) -> TinyNet:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            return TinyNet(dropout)

    return build


@pytest.fixture
def dataset() -> torch.utils.data.TensorDataset:
    """40 fixed samples (8 features -> 1 target), the same in every test."""
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(40, 8, generator=gen)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(40, 1, generator=gen)
    return torch.utils.data.TensorDataset(x, y)


@pytest.fixture
def make_loader(dataset: torch.utils.data.TensorDataset) -> Callable[..., Any]:
    """`make_loader(shuffle=True)`: a torchdata StatefulDataLoader, 10 batches of 4 per epoch."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    def build(shuffle: bool = True) -> StatefulDataLoader:
        return StatefulDataLoader(dataset, batch_size=4, shuffle=shuffle, num_workers=0)

    return build


@pytest.fixture
def make_spec(tmp_path) -> Callable[..., statereg.RegistrySpec]:
    """`make_spec("model", "optimizer", components={...}, save={...})`: a declaration.

    Each positional name declares a component of the kind with the same name; `components`
    adds or replaces declarations; `storage` adds storage fields; other keywords are top-level
    sections. The storage url defaults to `tmp_path / "ckpt"`.
    """

    def build(*names: str, components: dict[str, Any] | None = None, url: str | None = None,
              storage: dict[str, Any] | None = None, **sections: Any) -> statereg.RegistrySpec:
        declared: dict[str, Any] = {name: {"kind": name} for name in names}
        declared.update(components or {})
        storage = {"url": url or str(tmp_path / "ckpt"), **(storage or {})}
        data = {"storage": storage, "components": declared, **sections}
        return statereg.load_spec(data, environ={})

    return build


def sgd_batch(model: nn.Module, optimizer: torch.optim.Optimizer,
              batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """One training step on `batch` (MSE); returns the detached loss."""
    x, y = batch
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.detach()


@pytest.fixture
def train_step() -> Callable[..., torch.Tensor]:
    """`train_step(model, optimizer, (x, y))`: one optimizer step; returns the loss."""
    return sgd_batch
