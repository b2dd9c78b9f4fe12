"""The headline: a run killed after a save resumes bit for bit, as if it never stopped.

Run A trains 30 steps without a break. Run B trains the same 30 steps but saves at step 12,
"dies", and a fresh set of objects (new model, optimizer, scheduler, loader and manager, with
the process's RNGs scrambled) loads that checkpoint and trains steps 13..30. Every loss of
run B must equal run A's exactly: dropout masks, the shuffle order of every epoch, the data
noise drawn from Python and NumPy, Adam's moments and the learning rate all line up.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import statereg

STEPS = 30
SAVE_AT = 12  # mid-epoch: 10 batches per epoch
COMPONENTS = ("model", "optimizer", "scheduler", "dataloader", "rng")


class PositionLoader:
    """A plain object (no torch DataLoader) that yields batches in a per-epoch permutation and
    resumes from its position: what a hand-written streaming loader looks like."""

    def __init__(self, dataset: torch.utils.data.TensorDataset, batch_size: int = 4) -> None:
        self.x, self.y = dataset.tensors
        self.batch_size = batch_size
        self.epoch = 0
        self.position = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The rest of the current epoch."""
        order = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(self.epoch))
        while self.position < len(self.x) // self.batch_size:
            start = self.position * self.batch_size
            self.position += 1
            idx = order[start:start + self.batch_size]
            yield self.x[idx], self.y[idx]
        self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


@dataclass
class Run:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    dataloader: Any

    def components(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler,
                "dataloader": self.dataloader}


def noisy(x: torch.Tensor) -> torch.Tensor:
    """Augmentation that draws from Python's and NumPy's generators, so both must resume."""
    noise = torch.from_numpy(np.random.standard_normal(x.shape).astype(np.float32))
    return x + noise * (0.01 * random.random())


def train(run: Run, steps: range, on_step: Callable[[int], bool] | None = None
          ) -> dict[int, torch.Tensor]:
    """Train over `steps`; epochs restart the loader. Stops early if `on_step` says so."""
    losses: dict[int, torch.Tensor] = {}
    step = steps.start
    while step < steps.stop:
        for x, y in run.dataloader:
            run.optimizer.zero_grad()
            loss = nn.functional.mse_loss(run.model(noisy(x)), y)
            loss.backward()
            run.optimizer.step()
            run.scheduler.step()
            losses[step] = loss.detach()
            if on_step is not None and on_step(step):
                return losses
            step += 1
            if step >= steps.stop:
                break
    return losses


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


@pytest.fixture
def new_run(make_model) -> Callable[[Any, int], Run]:
    def build(loader: Any, seed: int) -> Run:
        model = make_model(seed=seed, dropout=0.3)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.05)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.5)
        return Run(model, optimizer, scheduler, loader)

    return build


def resume_matches_uninterrupted(make_spec, new_run, make_loader: Callable[[], Any]) -> None:
    spec = make_spec(*COMPONENTS)

    seed_everything(0)
    run_a = new_run(make_loader(), seed=0)
    losses_a = train(run_a, range(1, STEPS + 1))

    seed_everything(0)
    run_b = new_run(make_loader(), seed=0)
    mgr = statereg.CheckpointManager(spec, **run_b.components())

    def save_and_die(step: int) -> bool:
        if step == SAVE_AT:
            mgr.save(step=step, tokens_seen=step * 4)
            return True
        return False

    losses_b = train(run_b, range(1, STEPS + 1), on_step=save_and_die)
    assert sorted(losses_b) == list(range(1, SAVE_AT + 1))

    seed_everything(987654)  # a new process would start from other generator states
    run_c = new_run(make_loader(), seed=1)
    result = statereg.CheckpointManager(spec, **run_c.components()).load()
    assert result is not None
    assert (result.step, result.tokens_seen) == (SAVE_AT, SAVE_AT * 4)
    losses_b.update(train(run_c, range(SAVE_AT + 1, STEPS + 1)))

    assert sorted(losses_b) == sorted(losses_a) == list(range(1, STEPS + 1))
    mismatched = [s for s in losses_a if not torch.equal(losses_a[s], losses_b[s])]
    assert mismatched == [], f"losses differ from step {mismatched[:1]} on"
    for (name, a), (_, b) in zip(run_a.model.named_parameters(),
                                 run_c.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert run_c.scheduler.get_last_lr() == run_a.scheduler.get_last_lr()


def test_resume_with_a_stateful_dataloader_matches_the_uninterrupted_run(make_spec, new_run,
                                                                         make_loader):
    resume_matches_uninterrupted(make_spec, new_run, make_loader)


def test_resume_with_a_plain_object_as_dataloader(make_spec, new_run, dataset):
    resume_matches_uninterrupted(make_spec, new_run, lambda: PositionLoader(dataset))


def test_without_the_rng_component_the_resumed_run_diverges(make_spec, new_run, make_loader):
    # The control experiment: the headline test can fail, because randomness matters here.
    spec = make_spec("model", "optimizer", "scheduler", "dataloader")

    seed_everything(0)
    run_a = new_run(make_loader(), seed=0)
    losses_a = train(run_a, range(1, STEPS + 1))

    seed_everything(0)
    run_b = new_run(make_loader(), seed=0)
    mgr = statereg.CheckpointManager(spec, **run_b.components())
    train(run_b, range(1, SAVE_AT + 1))
    mgr.save(step=SAVE_AT)

    seed_everything(987654)
    run_c = new_run(make_loader(), seed=1)
    statereg.CheckpointManager(spec, **run_c.components()).load()
    losses_c = train(run_c, range(SAVE_AT + 1, STEPS + 1))

    assert not torch.equal(losses_a[SAVE_AT + 1], losses_c[SAVE_AT + 1])
