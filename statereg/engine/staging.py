"""Host buffers that hold a copy of the state while a background save writes it.

The buffers of one save live in one host arena, carved into one storage per tensor (a
tensor's storage is exactly its bytes, so the writer never clones it). With `async: pinned`
and CUDA the arena is page-locked once, at its exact size, with cudaHostRegister: torch's
caching host allocator (`tensor.pin_memory()`) rounds each block up to a power of two, so a
1.1 GB tensor would hold 2 GB of page-locked memory. Device-to-host copies run on a side
stream that waits for the training loop's stream as it was when save() was called, so
they overlap the loop's next kernels instead of queueing between them.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace
from typing import Any, cast

import torch

from statereg.engine.layouts import Captured

_ALIGN = 4096  # each tensor starts on its own page: page-aligned copies, no shared pages


def _like(original: torch.Tensor, local_copy: torch.Tensor) -> torch.Tensor:
    """`local_copy` as the same kind of tensor as `original` (a DTensor keeps its layout)."""
    if hasattr(original, "_local_tensor"):
        from torch.distributed.tensor import DTensor

        dtensor = cast(DTensor, original)
        return DTensor.from_local(local_copy, dtensor.device_mesh, dtensor.placements,
                                  run_check=False, shape=original.shape,
                                  stride=original.stride())
    return local_copy


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return getattr(tensor, "_local_tensor", tensor).detach()


def _register(arena: torch.Tensor) -> None:
    """Page-lock `arena` where it lies (cudaHostRegister), unlocked when it is freed."""
    cudart = torch.cuda.cudart()
    pointer, size = arena.data_ptr(), arena.nbytes
    error = int(cudart.cudaHostRegister(pointer, size, 0))
    if error != 0:
        raise RuntimeError(f"cudaHostRegister of {size} bytes of staging memory failed "
                           f"(cudaError {error}); use save.async: thread, or free host memory")
    weakref.finalize(arena, cudart.cudaHostUnregister, pointer)


@dataclass(frozen=True)
class LoopMark:
    """Where each device's training stream stood when save() was called: the copies wait
    for these events, and no later work of the loop."""

    events: dict[torch.device, Any]


def mark_loop(captured: list[Captured]) -> LoopMark | None:
    """An event on the current stream of every CUDA device the state lives on; call it on
    the training loop's thread. None where no tensor is on a CUDA device."""
    devices = {_local(t).device for item in captured for t in (item.tensors or {}).values()
               if isinstance(t, torch.Tensor) and _local(t).is_cuda}
    if not devices:
        return None
    events = {}
    for device in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events[device] = event
    return LoopMark(events)


class StagingArea:
    """Host buffers that hold a copy of the tensors while a background save writes them.

    The arena is allocated on the first save and reused while the tensors' shapes and dtypes
    stay the same, so repeated async saves do not grow memory.
    """

    def __init__(self, pinned: bool = False) -> None:
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}
        self._arena: torch.Tensor | None = None
        # Page-locked memory only helps (and only exists) with CUDA.
        self._pin = pinned and torch.cuda.is_available()
        self._streams: dict[torch.device, Any] = {}

    @property
    def nbytes(self) -> int:
        """Host bytes the staging buffers hold (their arena, page-aligned)."""
        return 0 if self._arena is None else self._arena.nbytes

    def stage(self, captured: list[Captured], mark: LoopMark | None = None,
              ) -> list[Captured]:
        """The components with every tensor copied into its reused buffer.

        `mark`: the loop's streams as they were at save() (mark_loop). CUDA tensors are
        copied on a side stream per device that waits for them; this returns once every copy
        is done. Without it the copies wait for the devices' current streams.
        """
        slots = [((item.task.component, key), _local(tensor))
                 for item in captured for key, tensor in (item.tensors or {}).items()
                 if isinstance(tensor, torch.Tensor)]
        self._fit(slots)
        if mark is None:
            mark = mark_loop(captured)
        side: dict[torch.device, Any] = {}
        if mark is not None:
            for device, event in mark.events.items():
                stream = self._streams.get(device)
                if stream is None:
                    stream = self._streams[device] = torch.cuda.Stream(device)
                stream.wait_event(event)
                side[device] = stream
        for slot, local in slots:
            buf = self._buffers[slot]
            if local.is_cuda:
                with torch.cuda.stream(side[local.device]):
                    # The loop may free the tensor before the copy ran: keep its memory.
                    local.record_stream(side[local.device])
                    buf.copy_(local, non_blocking=self._pin)
            else:
                buf.copy_(local)
        for stream in side.values():
            stream.synchronize()
        staged = []
        for item in captured:
            if item.tensors is None:
                staged.append(item)
                continue
            copies = {key: _like(tensor, self._buffers[(item.task.component, key)])
                      if isinstance(tensor, torch.Tensor) else tensor
                      for key, tensor in item.tensors.items()}
            staged.append(replace(item, tensors=copies))
        return staged

    def _fit(self, slots: list[tuple[tuple[str, str], torch.Tensor]]) -> None:
        """(Re)build the arena when the tensors' slots, shapes or dtypes changed."""
        if (len(slots) == len(self._buffers) and all(
                (buf := self._buffers.get(slot)) is not None and buf.shape == local.shape
                and buf.dtype == local.dtype for slot, local in slots)):
            return
        self._buffers, self._arena = {}, None  # the old arena is freed (and unlocked)
        offsets, total = [], 0
        for _, local in slots:
            offsets.append(total)
            total += -(-local.nbytes // _ALIGN) * _ALIGN
        # One spare page, so the first tensor can start on a page boundary.
        arena = torch.empty(total + _ALIGN, dtype=torch.uint8)
        base = -arena.data_ptr() % _ALIGN
        arena = arena[base:base + total]
        if self._pin and total:
            _register(arena)
        # numpy's stubs give ndarray __buffer__ only on 3.12+:
        memory = memoryview(arena.numpy()) if total else None  # type: ignore[arg-type]
        for (slot, local), offset in zip(slots, offsets, strict=True):
            if local.nbytes == 0:
                buf = torch.empty(local.shape, dtype=local.dtype)
            else:
                # A storage of exactly these bytes, inside the arena (kept alive by it).
                assert memory is not None  # total > 0 whenever a slot has bytes
                raw = torch.frombuffer(memory[offset:offset + local.nbytes], dtype=torch.uint8)
                buf = raw.view(local.dtype).view(local.shape)
            self._buffers[slot] = buf
        self._arena = arena
