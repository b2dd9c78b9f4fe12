"""Adapters for objects with state_dict()/load_state_dict(): schedulers, dataloaders, custom."""

from __future__ import annotations

from typing import Any

import torch

from statereg.errors import LoadOrderError, SpecError


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


class DataloaderAdapter(ObjectAdapter):
    """A dataloader (e.g. torchdata's StatefulDataLoader); refuses to rewind one mid-iteration."""

    def check_ready(self) -> None:
        # StatefulDataLoader keeps its live iterator in `_iterator`; its own state_dict()
        # creates one without iterating and flags it `_initial_iter_for_state_dict`.
        iterating = getattr(self.obj, "_iterator", None) is not None
        if iterating and not getattr(self.obj, "_initial_iter_for_state_dict", False):
            raise LoadOrderError(
                f"component {self.name!r}: the dataloader was already iterated before its saved "
                "state was applied, so resuming would not continue the data where it stopped; "
                "call mgr.load() (or mgr.attach()) before the first iter(loader)"
            )

    def restore(self, state: Any) -> None:
        self.check_ready()
        super().restore(state)
        if callable(getattr(type(self.obj), "_get_iterator", None)):
            self._build_resumed_iterator_outside_the_global_rng()

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
        build = type(loader)._get_iterator

        def build_once() -> Any:
            del loader._get_iterator  # back to the class's method for every later epoch
            with torch.random.fork_rng(devices=[]):
                return build(loader)

        loader._get_iterator = build_once
