"""A dataloader's saved position only resumes the loader it was saved from.

A StatefulDataLoader's state is a count of batches and samples into the epoch, plus its
sampler's generator: given to a loader whose dataset shrank, whose shuffle was turned off or
whose batch size changed, torchdata fails with a bare StopIteration or AssertionError, or
resumes silently on another data stream. statereg records the loader's batch size, dataset
length, shuffle and drop_last with its state and refuses such a load, naming what changed,
before anything live is modified (docs/exact-resume.md#dataloaders).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import statereg

stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")


def _loader(samples: int = 48, batch_size: int = 4, shuffle: bool = True,
            drop_last: bool = False) -> Any:
    data = TensorDataset(torch.arange(samples, dtype=torch.float32).unsqueeze(1))
    return stateful_dataloader.StatefulDataLoader(
        data, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last,
        generator=torch.Generator().manual_seed(3))


def _spec(root: Path) -> dict[str, Any]:
    return {"storage": {"url": str(root)},
            "components": {"model": {"kind": "model"}, "dataloader": {"kind": "dataloader"}}}


def _save_mid_epoch(root: Path) -> list[torch.Tensor]:
    """Save after 3 batches of a shuffled loader of 48 samples, batch size 4; the batches
    an uninterrupted run sees after the save."""
    torch.manual_seed(0)
    loader = _loader()
    with statereg.CheckpointManager(_spec(root), model=nn.Linear(1, 1),
                                    dataloader=loader) as mgr:
        batches = iter(loader)
        for _ in range(3):
            next(batches)
        mgr.save(3)
        return [b[0] for b in batches]


@pytest.mark.parametrize(("changed", "named"), [
    ({"samples": 40}, "dataset length 48 -> 40"),
    ({"shuffle": False}, "shuffle True -> False"),
    ({"batch_size": 8}, "batch size 4 -> 8"),
    ({"drop_last": True}, "drop_last False -> True"),
])
def test_a_changed_loader_is_refused_naming_the_change_before_anything_loads(
        tmp_path: Path, changed: dict[str, Any], named: str) -> None:
    _save_mid_epoch(tmp_path)
    model = nn.Linear(1, 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loader = _loader(**changed)
    with statereg.CheckpointManager(_spec(tmp_path), model=model, dataloader=loader) as mgr:
        with pytest.raises(statereg.CheckpointMismatchError, match=(
                rf"component 'dataloader': the data loader is not the one the checkpoint "
                rf"saved \({named}\).*build the loader as when saved")):
            mgr.load()
        # Refused while checking: the model was not loaded either, and saves go on.
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        mgr.save(4)


def test_the_same_loader_resumes_where_it_stopped(tmp_path: Path) -> None:
    rest = _save_mid_epoch(tmp_path)
    loader = _loader()
    with statereg.CheckpointManager(_spec(tmp_path), model=nn.Linear(1, 1),
                                    dataloader=loader) as mgr:
        assert mgr.load() is not None
        assert [b[0].tolist() for b in loader] == [b.tolist() for b in rest]


def test_the_recorded_shape_names_what_decides_the_data_stream() -> None:
    from statereg.state.objects import loader_shape

    assert loader_shape(_loader(samples=40, batch_size=8, shuffle=False)) == {
        "batch_size": 8, "dataset_length": 40, "shuffle": False, "drop_last": False,
        "sampler": "SequentialSampler"}
    sampler = torch.utils.data.DistributedSampler(range(10), num_replicas=2, rank=0,
                                                  shuffle=True)
    plain = torch.utils.data.DataLoader(range(10), batch_size=2, sampler=sampler)
    assert loader_shape(plain) == {"batch_size": 2, "dataset_length": 10, "shuffle": True,
                                   "drop_last": False, "sampler": "DistributedSampler"}
    assert loader_shape(object()) is None


def test_a_state_saved_without_the_shape_loads_unchecked() -> None:
    """Checkpoints from before the shape was recorded hold the loader's state alone."""
    from statereg.state.objects import LOADER_SHAPE_KEY, check_loader_shape, with_loader_shape

    loader = _loader()
    state = loader.state_dict()
    assert check_loader_shape("dataloader", state, _loader(samples=8), "fix") == state
    recorded = with_loader_shape(state, loader)
    assert recorded[LOADER_SHAPE_KEY]["batch_size"] == 4
    assert check_loader_shape("dataloader", recorded, _loader(), "fix") == state


@pytest.mark.parametrize(("changed", "raw"), [
    ({"samples": 8}, "StopIteration"), ({"shuffle": False}, "AssertionError")])
def test_a_position_that_does_not_fit_unchecked_fails_as_a_mismatch(
        changed: dict[str, Any], raw: str) -> None:
    """A state without the recorded shape (saved before it was) given to another loader:
    torchdata's bare error while the resumed iterator fast-forwards becomes a
    CheckpointMismatchError naming the component."""
    from statereg.state.objects import DataloaderAdapter

    saved = _loader()
    batches = iter(saved)
    for _ in range(3):
        next(batches)
    loader = _loader(**changed)
    DataloaderAdapter("dataloader", "dataloader", loader).restore(saved.state_dict())
    with pytest.raises(statereg.CheckpointMismatchError, match=(
            rf"component 'dataloader': the data loader could not continue from its saved "
            rf"position \({raw}")):
        next(iter(loader))
