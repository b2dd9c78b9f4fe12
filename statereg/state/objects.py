"""Adapters for objects with state_dict()/load_state_dict(): schedulers, dataloaders, custom."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sized
from typing import Any

import torch

from statereg.errors import CheckpointMismatchError, LoadOrderError, SpecError

# Where a dataloader component's saved state records what the loader was (loader_shape):
# beside the loader's own keys, taken out again before the loader sees the state.
LOADER_SHAPE_KEY = "statereg_loader"


class ObjectAdapter:
    """Any object exposing `state_dict()` and `load_state_dict(state)`."""

    def __init__(self, name: str, kind: str, obj: Any) -> None:
        for method in ("state_dict", "load_state_dict"):
            if not callable(getattr(obj, method, None)):
                raise SpecError(
                    f"component {name!r} (kind {kind}) got a {type(obj).__name__} without "
                    f"{method}(); pass an object with state_dict() and load_state_dict()"
                )
        self.name = name
        self.kind = kind
        self.obj = obj
        # A scheduler's state_dict() keys before its first load (see restore()).
        self._native_keys: set[str] | None = None

    def capture(self) -> Any:
        return self.obj.state_dict()

    def check_ready(self) -> None:
        """Raise if saved state can no longer be applied correctly (checked before loading)."""

    def check_state(self, state: Any) -> None:
        """Raise if the saved `state` does not fit the live object (checked before loading)."""

    def restore(self, state: Any) -> None:
        scheduler = isinstance(self.obj, torch.optim.lr_scheduler.LRScheduler) and isinstance(
            state, dict)
        if scheduler and self._native_keys is None:
            self._native_keys = set(self.obj.state_dict())
        self.obj.load_state_dict(state)
        if scheduler:
            self._drop_keys_only_an_earlier_load_set(state)

    def _drop_keys_only_an_earlier_load_set(self, state: dict[str, Any]) -> None:
        """torch's schedulers load by `__dict__.update(state)`: an attribute that an earlier
        load brought (a checkpoint of another scheduler version, or a damaged one read with
        verify: off) outlives this load and would be saved from then on, so the object would
        not hold exactly what this checkpoint saved. Drop those: attributes neither in this
        state nor the scheduler's own before its first load."""
        for key in set(self.obj.state_dict()) - set(state) - (self._native_keys or set()):
            if key in vars(self.obj):
                delattr(self.obj, key)

    def reshard(self, states: list[Any], rank: int, world_size: int) -> Any:
        """This rank's state after a world-size change, from every saved rank's state.

        Delegates to the object's `reshard_state_dict(states, rank, world_size)`, e.g. a
        dataloader that splits one global sample cursor over the new ranks.
        """
        method = getattr(self.obj, "reshard_state_dict", None)
        if method is None:
            raise SpecError(
                f"component {self.name!r} declares on_world_size_change: reshard, but "
                f"{type(self.obj).__name__} has no reshard_state_dict(states, rank, world_size); "
                "implement it, or declare reset"
            )
        return method(states, rank, world_size)


def _sampler_of(loader: Any) -> Any:
    """The sampler that orders the loader's samples, through the batch samplers that wrap it
    (torch's BatchSampler, accelerate's BatchSamplerShard)."""
    batches = getattr(loader, "batch_sampler", None)
    for holder in (batches, getattr(batches, "batch_sampler", None)):
        sampler = getattr(holder, "sampler", None)
        if sampler is not None:
            return sampler
    return getattr(loader, "sampler", None)


def _shuffles(sampler: Any) -> bool | None:
    """Whether `sampler` draws a random order: torch's and torchdata's RandomSampler (and
    subclasses such as accelerate's SeedableRandomSampler) do, a SequentialSampler does
    not, a DistributedSampler (or Lightning's wrapper) says so in `shuffle`; None if unknown."""
    if isinstance(sampler, torch.utils.data.SequentialSampler):
        return False
    if isinstance(sampler, torch.utils.data.RandomSampler) or any(
            cls.__name__ == "RandomSampler" for cls in type(sampler).__mro__):
        return True
    shuffle = getattr(sampler, "shuffle", None)
    return shuffle if isinstance(shuffle, bool) else None


def loader_shape(loader: Any) -> dict[str, Any] | None:
    """What decides which samples a data loader yields and in which batches: its batch size,
    dataset length, whether it shuffles and drops the last batch, its sampler's class (None
    for what it does not say); None if `loader` is no data loader (no `dataset`).

    A saved position (StatefulDataLoader's sample and batch counts) only means the same
    place in the data if these are unchanged; the dataloader component records them."""
    dataset = getattr(loader, "dataset", None)
    if dataset is None:
        return None
    batches = getattr(loader, "batch_sampler", None)
    batch_size = getattr(loader, "batch_size", None)
    for holder in (batches, getattr(batches, "batch_sampler", None)):
        if batch_size is None:
            batch_size = getattr(holder, "batch_size", None)
    length = None
    if isinstance(dataset, Sized):
        try:
            length = len(dataset)
        except TypeError:  # an IterableDataset whose __len__ raises
            length = None
    drop_last = getattr(loader, "drop_last", None)
    sampler = _sampler_of(loader)
    return {"batch_size": batch_size if isinstance(batch_size, int) else None,
            "dataset_length": length,
            "shuffle": _shuffles(sampler),
            "drop_last": drop_last if isinstance(drop_last, bool) else None,
            "sampler": None if sampler is None else type(sampler).__name__}


_SHAPE_WORDS = {"batch_size": "batch size", "dataset_length": "dataset length",
                "shuffle": "shuffle", "drop_last": "drop_last", "sampler": "sampler"}


def with_loader_shape(state: Any, loader: Any) -> Any:
    """The loader's `state` with its loader_shape recorded beside it (a dict state only)."""
    shape = loader_shape(loader)
    if shape is None or not isinstance(state, dict):
        return state
    return {**state, LOADER_SHAPE_KEY: shape}


def check_loader_shape(name: str, state: Any, loader: Any, fix: str) -> Any:
    """`state` without the recorded loader shape, after checking that the live `loader` has
    the same one; CheckpointMismatchError naming each change and `fix` otherwise.

    A resume with another batch size would continue silently on another data stream, and
    torchdata's own load fails with a bare StopIteration (a shorter dataset) or
    AssertionError (shuffle turned off): neither says what changed. A state saved before
    the shape was recorded is let through unchecked."""
    if not isinstance(state, dict) or LOADER_SHAPE_KEY not in state:
        return state
    saved = state[LOADER_SHAPE_KEY]
    rest = {k: v for k, v in state.items() if k != LOADER_SHAPE_KEY}
    live = loader_shape(loader)
    if live is None or not isinstance(saved, dict):
        return rest
    differ = [key for key in _SHAPE_WORDS if saved.get(key) is not None
              and live[key] is not None and saved.get(key) != live[key]]
    if "shuffle" in differ and "sampler" in differ:
        differ.remove("sampler")  # the sampler's class says the same: one shuffle turned off
    changed = [f"{_SHAPE_WORDS[key]} {saved[key]!r} -> {live[key]!r}" for key in differ]
    if changed:
        raise CheckpointMismatchError(
            f"component {name!r}: the data loader is not the one the checkpoint saved "
            f"({', '.join(changed)}), so its saved position would continue another data "
            f"stream; build the loader as when saved to resume exactly, or {fix}")
    return rest


# What torchdata raises when a saved position does not fit the loader it is given (a
# shorter dataset: StopIteration; another sampler's state: AssertionError, KeyError...).
_REFUSALS = (StopIteration, AssertionError, IndexError, KeyError, ValueError)


@contextlib.contextmanager
def resuming_loader(name: str, fix: str) -> Iterator[None]:
    """Around the first iterator a loader builds from a restored position (where torchdata
    fast-forwards its sampler): what it raises because the position does not fit (a change
    that loader_shape does not show, or a checkpoint saved before it was recorded) becomes a
    CheckpointMismatchError naming the component, instead of a bare StopIteration or
    AssertionError."""
    try:
        yield
    except _REFUSALS as exc:
        raise CheckpointMismatchError(
            f"component {name!r}: the data loader could not continue from its saved position "
            f"({type(exc).__name__}: {exc or 'no message'}), so it is not the loader that was "
            f"saved (its dataset, sampler or batching changed); build the loader as when "
            f"saved to resume exactly, or {fix}") from exc


# The private names of torch's DataLoader and torchdata's StatefulDataLoader this adapter uses,
# in one block (docs/compatibility.md, "Private names of data loaders"); tests/compat checks
# them on the pinned releases. `_iterator`: the loader's live iterator (None before the first
# iter()); `_initial_iter_for_state_dict`: torchdata's flag on an iterator that its own
# state_dict() made without iterating; `_get_iterator`: the method that builds an iterator,
# wrapped once on restore (_build_resumed_iterator_outside_the_global_rng).
LIVE_ITERATOR = "_iterator"
STATE_DICT_ITERATOR = "_initial_iter_for_state_dict"
BUILD_ITERATOR = "_get_iterator"


class DataloaderAdapter(ObjectAdapter):
    """A dataloader (e.g. torchdata's StatefulDataLoader); refuses to rewind one
    mid-iteration, and a saved position that belongs to another loader (check_loader_shape).

    An object that wraps a loader (an integration's) names it with `live_loader()`: None
    while the loader does not exist yet, and then the shape stays in the state for the
    wrapper to check (check_loader_shape) when its loader exists."""

    fix = ("leave this component out of the load (exclude=[...]) to start the loader's "
           "epoch afresh")

    def _live_loader(self) -> Any:
        live = getattr(self.obj, "live_loader", None)
        return live() if callable(live) else self.obj

    def capture(self) -> Any:
        return with_loader_shape(self.obj.state_dict(), self._live_loader())

    def check_state(self, state: Any) -> None:
        loader = self._live_loader()
        if loader is not None:
            check_loader_shape(self.name, state, loader, self.fix)

    def check_ready(self) -> None:
        # StatefulDataLoader keeps its live iterator in `_iterator`; its own state_dict()
        # creates one without iterating and flags it `_initial_iter_for_state_dict`.
        iterating = getattr(self.obj, LIVE_ITERATOR, None) is not None
        if iterating and not getattr(self.obj, STATE_DICT_ITERATOR, False):
            raise LoadOrderError(
                f"component {self.name!r}: the dataloader was already iterated before its saved "
                "state was applied, so resuming would not continue the data where it stopped; "
                "call mgr.load() (or mgr.attach()) before the first iter(loader)"
            )

    def restore(self, state: Any) -> None:
        self.check_ready()
        loader = self._live_loader()
        if loader is not None:
            state = check_loader_shape(self.name, state, loader, self.fix)
        super().restore(state)
        if callable(getattr(type(self.obj), BUILD_ITERATOR, None)):
            self._build_resumed_iterator_outside_the_global_rng()
        elif isinstance(self.obj, torch.utils.data.DataLoader):
            warnings.warn(
                f"component {self.name!r}: {type(self.obj).__name__} has no {BUILD_ITERATOR}() "
                f"(torch {torch.__version__}), so statereg cannot build its resumed iterator "
                "outside the global RNG: the resumed run may draw one more seed from it than "
                "the uninterrupted run did (random ops after resume then differ). Install a "
                "torch release docs/compatibility.md lists as tested", RuntimeWarning,
                stacklevel=2)

    def reshard(self, states: list[Any], rank: int, world_size: int) -> Any:
        """As ObjectAdapter.reshard, from the saved states without their recorded shape
        (another world size may split the data otherwise; the object decides)."""
        return super().reshard([{k: v for k, v in s.items() if k != LOADER_SHAPE_KEY}
                                if isinstance(s, dict) else s for s in states],
                               rank, world_size)

    def _build_resumed_iterator_outside_the_global_rng(self) -> None:
        """Let StatefulDataLoader build its resumed iterator where it would, but under fork_rng.

        Building it draws a base seed from the global torch generator, which the
        uninterrupted run drew before the checkpoint: the draw must not shift the restored
        stream (dropout after resume would differ). Building it here instead would be
        too early: it iterates the sampler, fixing e.g. DistributedSampler's shuffle to the
        epoch it has now, before the usual `sampler.set_epoch(e)` after `mgr.load()`. So the
        loader's next build (at `iter(loader)` or `state_dict()`) runs once under fork_rng,
        then the loader's own method takes over again.
        """
        loader = self.obj
        build = getattr(type(loader), BUILD_ITERATOR)
        name, fix = self.name, self.fix

        def build_once() -> Any:
            delattr(loader, BUILD_ITERATOR)  # back to the class's method for every later epoch
            with torch.random.fork_rng(devices=[]), resuming_loader(name, fix):
                return build(loader)

        setattr(loader, BUILD_ITERATOR, build_once)
