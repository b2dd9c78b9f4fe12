"""Adapters for objects with state_dict()/load_state_dict(): schedulers, dataloaders, custom."""

from __future__ import annotations

from typing import Any

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

    def capture(self) -> Any:
        return self.obj.state_dict()

    def restore(self, state: Any) -> None:
        self.obj.load_state_dict(state)


class DataloaderAdapter(ObjectAdapter):
    """A dataloader (e.g. torchdata's StatefulDataLoader); refuses to rewind one mid-iteration."""

    def restore(self, state: Any) -> None:
        # StatefulDataLoader keeps its live iterator here; loading state into a loader that is
        # already being iterated would silently restart or skip data.
        if getattr(self.obj, "_iterator", None) is not None:
            raise LoadOrderError(
                f"component {self.name!r}: the dataloader was already iterated before its saved "
                "state was applied, so resuming would not continue the data where it stopped; "
                "call mgr.load() (or mgr.attach()) before the first iter(loader)"
            )
        super().restore(state)
