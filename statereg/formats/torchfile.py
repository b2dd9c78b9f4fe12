"""The `torch` format: one `torch.save` file per component (per rank for per_rank state).

Any `torch.load` reads it; statereg itself loads it only with `weights_only=True`, so a file
cannot run code. A model is stored as its full state dict (shards gathered onto rank 0), a
scheduler, dataloader or custom object as its `state_dict()`. State that `weights_only`
would refuse is refused at save time, not discovered at resume.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from statereg.backends.stores import ReadableStore
from statereg.errors import CorruptCheckpointError, SpecError
from statereg.formats.tensors import copy_full_into, tensor_meta
from statereg.state.protocols import TensorMeta


def _load(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def encode_torch(state: Any, where: str) -> bytes:
    """`torch.save` bytes of `state`, checked to load back with `weights_only=True`."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    try:
        _load(data)
    except pickle.UnpicklingError as exc:
        raise SpecError(
            f"{where}: its state holds an object torch.load(weights_only=True) refuses "
            f"({str(exc).splitlines()[0]}); return tensors and plain Python values from "
            "state_dict(), or declare format: json"
        ) from None
    return data


def decode_torch(data: bytes, where: str) -> Any:
    """Load `torch.save` bytes with `weights_only=True`; anything else is refused."""
    try:
        return _load(data)
    except pickle.UnpicklingError as exc:
        raise CorruptCheckpointError(
            f"{where}: holds a pickled object outside the weights-only allow-list "
            f"({str(exc).splitlines()[0]}); refusing to load it"
        ) from None
    except (RuntimeError, EOFError, ValueError) as exc:
        raise CorruptCheckpointError(f"{where}: not a readable torch.save file ({exc})") from None


class TorchFile:
    """A model's full state dict in one torch.save file, read once and kept until loaded."""

    def __init__(self, backend: ReadableStore, path: str, data: bytes | None = None) -> None:
        """`data`: the file's bytes when the caller has them (read once for all ranks)."""
        where = backend.display(path)
        state = decode_torch(backend.read_bytes(path) if data is None else data, where)
        if not isinstance(state, dict) or not all(
                isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
            raise CorruptCheckpointError(f"{where}: not a state dict of named tensors")
        self.tensors: dict[str, torch.Tensor] = state
        self.metas: dict[str, TensorMeta] = {k: tensor_meta(t) for k, t in state.items()}

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        return {n: self.tensors[n] for n in names}

    def load_into(self, targets: dict[str, torch.Tensor]) -> None:
        for name, target in targets.items():
            copy_full_into(target, self.tensors[name])
