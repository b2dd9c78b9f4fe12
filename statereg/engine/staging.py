"""Host buffers that hold a copy of the state while a background save writes it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from statereg.engine.layouts import Captured


def _like(original: torch.Tensor, local_copy: torch.Tensor) -> torch.Tensor:
    """`local_copy` as the same kind of tensor as `original` (a DTensor keeps its layout)."""
    if hasattr(original, "_local_tensor"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local_copy, original.device_mesh, original.placements,
                                  run_check=False, shape=original.shape,
                                  stride=original.stride())
    return local_copy


class StagingArea:
    """Host buffers that hold a copy of the tensors while a background save writes them.

    Buffers are allocated on the first save and reused while shapes and dtypes stay the same,
    so repeated async saves do not grow memory.
    """

    def __init__(self, pinned: bool = False) -> None:
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}
        # Page-locked memory only helps (and only exists) with CUDA.
        self._pin = pinned and torch.cuda.is_available()

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())

    def stage(self, captured: list[Captured], stream: Any = None,
              ) -> list[Captured]:
        """The components with every tensor copied into its reused buffer.

        `stream`: the CUDA stream to copy on. Staging on a background thread passes the
        training loop's stream, taken when save() was called, so the copies follow the
        loop's work on the device; None copies on the current stream.
        """
        staged = []
        with torch.cuda.stream(stream):
            for item in captured:
                if item.tensors is None:
                    staged.append(item)
                    continue
                copies: dict[str, Any] = {}
                for key, tensor in item.tensors.items():
                    if not isinstance(tensor, torch.Tensor):
                        copies[key] = tensor
                        continue
                    slot = (item.task.component, key)
                    local = getattr(tensor, "_local_tensor", tensor)
                    buf = self._buffers.get(slot)
                    if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
                        buf = torch.empty(local.shape, dtype=local.dtype, device="cpu",
                                          pin_memory=self._pin)
                        self._buffers[slot] = buf
                    buf.copy_(local.detach(), non_blocking=self._pin)
                    copies[key] = _like(tensor, buf)
                staged.append(replace(item, tensors=copies))
            if self._pin:
                torch.cuda.current_stream().synchronize()
        return staged


def loop_stream() -> Any:
    """The calling thread's current CUDA stream, or None where CUDA is not in use."""
    return torch.cuda.current_stream() if torch.cuda.is_initialized() else None

