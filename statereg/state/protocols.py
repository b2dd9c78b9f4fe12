"""The two shapes of state the engine handles: tensors (through DCP or whole tensor files) and
plain objects (through small files). Every adapter meets one of them, so the engine executes
a plan without asking what kind of object it holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of a stored tensor, as DCP's metadata records it."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class TensorCapture:
    """One component's tensors at save time (live references, not copies), and its small
    state: `meta` goes into the manifest's component record, `sidecar` (larger JSON data such
    as optimizer hyperparameters) into a file beside the tensors."""

    tensors: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)
    sidecar: dict[str, Any] | None = None
    # Keys of plain buffers (not parameters): each rank updates its own copy (BatchNorm under
    # DDP), so a collective save stores one rank's, the coordinator's (engine/save_steps.py).
    buffers: frozenset[str] = frozenset()


@runtime_checkable
class TensorState(Protocol):
    """State that is a flat (or nested) dict of tensors: models, optimizers, tensor objects."""

    name: str

    def capture(self) -> TensorCapture:
        """The tensors to save and their small state; nothing is copied."""
        ...

    def sharded_keys(self) -> list[str]:
        """Keys whose tensors are split over ranks (DTensor shards), for the plan's lint."""
        ...

    def unsaved_buffers(self) -> list[str]:
        """Live buffers the checkpoints leave out (a `trainable_only` model's), which a load
        leaves as they are; the manager warns about them once. Empty for other state."""
        ...

    def load_targets(self, stored: dict[str, TensorMeta], meta: dict[str, Any], strict: bool,
                     sidecar: dict[str, Any] | None) -> dict[str, Any]:
        """Tensors to load into, after checking every key, shape and dtype against the
        stored ones; raises CheckpointMismatchError before anything live is modified."""
        ...

    def key_differences(self, stored: dict[str, TensorMeta], meta: dict[str, Any],
                        ) -> tuple[list[str], list[str]]:
        """(missing, unexpected): live keys the checkpoint lacks, stored keys the object
        lacks; what `load(strict=False)` reports."""
        ...

    def apply(self, targets: dict[str, Any], meta: dict[str, Any],
              sidecar: dict[str, Any] | None) -> None:
        """Finish a load once `targets` hold the saved values (ties, optimizer groups)."""
        ...


@runtime_checkable
class ObjectState(Protocol):
    """State that is one picklable or JSON-able object: schedulers, dataloaders, RNG, custom."""

    name: str

    def capture(self) -> Any:
        ...

    def check_ready(self) -> None:
        """Raise if saved state could no longer be applied correctly (before any load)."""
        ...

    def check_state(self, state: Any) -> None:
        """Raise CheckpointMismatchError if the saved `state` does not fit the live object
        (before any load: e.g. a dataloader position saved for another batch size)."""
        ...

    def restore(self, state: Any) -> None:
        ...

    def reshard(self, states: list[Any], rank: int, world_size: int) -> Any:
        """This rank's state after a world-size change, from every saved rank's state."""
        ...


def sharded_keys_of(tensors: dict[str, Any]) -> list[str]:
    """Keys of DTensors with a Shard placement: each rank holds only a piece of them."""
    return sorted(key for key, tensor in tensors.items()
                  if any(p.is_shard() for p in getattr(tensor, "placements", ())))
