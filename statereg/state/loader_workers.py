"""The random generators of a StatefulDataLoader's worker processes, as loader state.

Each worker of a `DataLoader` seeds Python's `random`, torch's and NumPy's global generators
once, when it starts (base seed + worker id), and a dataset that augments draws from them.
torchdata's `StatefulDataLoader` saves where each worker is in the data and, if the dataset
has `state_dict()`, the dataset's state, taken inside the worker right after each batch; it
does not save the generators. A mid-epoch resume therefore starts every worker's generators
from the seed again, and the augmented batches differ from the uninterrupted run's.

`carry_worker_generators` wraps the loader's dataset in `WorkerGenerators`, a dataset whose
`state_dict()` holds the worker's three generators (and the wrapped dataset's own state), so
torchdata saves them with each worker's state, at the same point as its position, and a
resumed worker sets them back before it produces its next batch. Nothing changes in the
main process: a loader without workers is left alone (there the dataset's state would be
taken in the training process, whose generators the `rng` component owns).
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

logger = logging.getLogger(__name__)

_VERSION = 1


def _generators() -> dict[str, Any]:
    return {"version": _VERSION, "python": random.getstate(),
            "torch": torch.get_rng_state(), "numpy": np.random.get_state()}


def _set_generators(state: dict[str, Any]) -> None:
    random.setstate(_tuples(state["python"]))
    torch.set_rng_state(state["torch"])
    numpy_state = state["numpy"]
    np.random.set_state(tuple(numpy_state) if isinstance(numpy_state, list) else numpy_state)


def _tuples(value: Any) -> Any:
    """random.setstate wants the tuples getstate gave (a JSON round trip may make lists)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


class _Carrying:
    """What both wrappers share: the wrapped dataset, its attributes, and the state."""

    inner: Any

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (unpickling in a worker): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)

    def state_dict(self) -> dict[str, Any]:
        """This worker's generators, and the wrapped dataset's own state if it has one."""
        state: dict[str, Any] = {"generators": _generators()}
        if callable(getattr(self.inner, "state_dict", None)):
            state["dataset"] = self.inner.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Set this worker's generators (and the wrapped dataset's state) as they were."""
        if not isinstance(state, dict) or "generators" not in state:
            # The dataset's own state, saved before its generators were carried.
            if callable(getattr(self.inner, "load_state_dict", None)):
                self.inner.load_state_dict(state)
            return
        _set_generators(state["generators"])
        if "dataset" in state and callable(getattr(self.inner, "load_state_dict", None)):
            self.inner.load_state_dict(state["dataset"])


class WorkerGenerators(_Carrying, Dataset):
    """A map-style dataset that carries its worker's generators in its state."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getitem__(self, index: Any) -> Any:
        return self.inner[index]


class IterableWorkerGenerators(_Carrying, IterableDataset):
    """An iterable dataset that carries its worker's generators in its state.

    When neither the dataset nor its current iterator has state, torchdata resumes by
    replaying the stream from its start in freshly seeded workers, which draws the same
    numbers on the way: the state is then None, so that torchdata still does that.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._stream: Any = None

    def __iter__(self) -> Any:
        self._stream = iter(self.inner)
        return self._stream

    def state_dict(self) -> dict[str, Any] | None:  # type: ignore[override]
        if not (callable(getattr(self.inner, "state_dict", None))
                or callable(getattr(self._stream, "state_dict", None))):
            return None
        return super().state_dict()


def carry_worker_generators(loader: Any, name: str) -> None:
    """Make a StatefulDataLoader with worker processes save its workers' generators.

    Done before its first iterator (an iterator's workers hold the dataset they started
    with); the dataset is replaced in place, which DataLoader otherwise forbids after
    construction, because the user's loader object is the one statereg must save.
    """
    if getattr(loader, "num_workers", 0) <= 0 or not callable(getattr(loader, "state_dict",
                                                                      None)):
        return
    dataset = loader.dataset
    if isinstance(dataset, _Carrying):
        return
    if getattr(loader, "_iterator", None) is not None:
        logger.warning(
            "component %r: the loader's workers were started before the CheckpointManager, so "
            "their random generators are not saved; a mid-epoch resume of a dataset that draws "
            "random numbers in its workers will not be bit-exact. Build the manager before "
            "the first iter(loader)", name)
        return
    wrapper = (IterableWorkerGenerators if isinstance(dataset, IterableDataset)
               else WorkerGenerators)(dataset)
    object.__setattr__(loader, "dataset", wrapper)
