"""A StatefulDataLoader's workers resume with their random generators: a dataset that augments
in its workers gives the uninterrupted run's batches after a mid-epoch resume.

torchdata saves each worker's position (and a Stateful dataset's state), not the Python,
torch and NumPy generators a worker seeds at start; statereg carries them in the dataset's
state (statereg/state/loader_workers.py). Each case runs the loader to a save, on to the
end, and again from the checkpoint with new objects: the resumed batches must equal the
rest of the reference bit for bit.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

import statereg

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


class Augmenting(Dataset):
    """Each item drawn with all three of the worker's generators."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, index: int) -> torch.Tensor:
        return (torch.tensor([float(index)]) + torch.rand(1) + random.random()
                + float(np.random.rand()))


class CountingAugmenting(Augmenting):
    """Stateful itself: its own state (items served in this worker) must come back too."""

    def __init__(self) -> None:
        self.served = 0

    def __getitem__(self, index: int) -> torch.Tensor:
        self.served += 1
        return super().__getitem__(index) * 0 + self.served + torch.rand(1)

    def state_dict(self) -> dict[str, Any]:
        return {"served": self.served}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.served = state["served"]


class Stream(IterableDataset):
    """An iterable dataset, split over the workers, noisy in each."""

    def __iter__(self) -> Any:
        info = get_worker_info()
        start, step = (info.id, info.num_workers) if info else (0, 1)
        for i in range(start, 48, step):
            yield torch.tensor([float(i)]) + torch.randn(1)


class _Position:
    """A stream iterator with state: where it is, not its generators."""

    def __init__(self, start: int, step: int) -> None:
        self.next, self.step = start, step

    def __iter__(self) -> _Position:
        return self

    def __next__(self) -> torch.Tensor:
        if self.next >= 48:
            raise StopIteration
        self.next += self.step
        return torch.tensor([float(self.next)]) + torch.randn(1)

    def state_dict(self) -> dict[str, int]:
        return {"next": self.next}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.next = state["next"]


class StatefulStream(IterableDataset):
    """An iterable dataset whose iterator resumes where it was (torchdata then does not
    replay the stream), noisy in each worker."""

    def __iter__(self) -> _Position:
        info = get_worker_info()
        return _Position(*((info.id, info.num_workers) if info else (0, 1)))


def _loader(dataset: Dataset) -> StatefulDataLoader:
    torch.manual_seed(0)  # the loader's base seed comes from the global generator
    shuffle = not isinstance(dataset, IterableDataset)
    return StatefulDataLoader(dataset, batch_size=4, shuffle=shuffle, num_workers=2)


def _spec(root: Path) -> dict[str, Any]:
    return {"storage": {"url": str(root)}, "components": {"dataloader": {"kind": "dataloader"}}}


@pytest.mark.parametrize("make", [Augmenting, CountingAugmenting, Stream, StatefulStream],
                         ids=["map-style", "stateful-dataset", "iterable",
                              "iterable-stateful-iterator"])
def test_workers_resume_mid_epoch_with_their_generators(tmp_path: Path, make: type) -> None:
    loader = _loader(make())
    reference = []
    with statereg.CheckpointManager(_spec(tmp_path), dataloader=loader) as mgr:
        for i, batch in enumerate(loader):
            reference.append(batch)
            if i == 4:
                mgr.save(step=5)
    if make not in (Stream, StatefulStream):
        assert len(loader.dataset) == 48  # the wrapper answers as the dataset does
    loader = _loader(make())
    with statereg.CheckpointManager(_spec(tmp_path), dataloader=loader) as mgr:
        mgr.load()
        resumed = list(loader)
    assert len(resumed) == len(reference) - 5
    for got, want in zip(resumed, reference[5:], strict=True):
        assert torch.equal(got, want)


def test_a_loader_whose_workers_already_started_is_named_in_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    loader = StatefulDataLoader(Augmenting(), batch_size=4, num_workers=1,
                                persistent_workers=True)
    next(iter(loader))
    with caplog.at_level(logging.WARNING), \
            statereg.CheckpointManager(_spec(tmp_path), dataloader=loader):
        pass
    assert "component 'dataloader': the loader's workers were started before" in caplog.text
    assert isinstance(loader.dataset, Augmenting)  # left as it was


def test_a_loader_without_workers_is_left_alone(tmp_path: Path) -> None:
    dataset = Augmenting()
    loader = StatefulDataLoader(dataset, batch_size=4)
    with statereg.CheckpointManager(_spec(tmp_path), dataloader=loader):
        assert loader.dataset is dataset
