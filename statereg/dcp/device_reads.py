"""Reads whose destination is a GPU tensor: through page-locked slices, overlapped.

A plain load into CUDA tensors reads each record into pageable memory, unpickles it there
and copies it to the device, which stages the copy through the driver's own buffers again.
Here the stored bytes are read into a small ring of page-locked slices per reader thread and
each slice is copied to the device asynchronously, so the read of the next slice overlaps
the copy of this one, and every byte crosses host memory once. `DeviceLanding.finish()`
waits for the copies before the load returns.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

# Slice size: large enough that a copy's launch is amortised, small enough that two slices
# per reader thread are a few tens of MiB of page-locked memory.
LANDING_SLICE = 16 << 20
_RING = 2


class _Ring:
    """One thread's page-locked slices, each reused once its last copy has finished."""

    def __init__(self) -> None:
        self.slices = [torch.empty(LANDING_SLICE, dtype=torch.uint8, pin_memory=True)
                       for _ in range(_RING)]
        # numpy's stubs give ndarray __buffer__ only on 3.12+:
        self.views = [memoryview(s.numpy()) for s in self.slices]  # type: ignore[arg-type]
        self.done: list[Any] = [None] * _RING
        self.turn = 0


class DeviceLanding:
    """Carries bytes read from storage into device tensors; shared by a load's threads."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._devices: set[torch.device] = set()
        self._lock = threading.Lock()

    def fill(self, target: torch.Tensor, readinto: Callable[[memoryview], None],
             hasher: Any = None) -> None:
        """Fill the contiguous device tensor `target` with bytes `readinto(view)` provides,
        slice by slice, each slice hashed (with `hasher`) while it is in host memory."""
        ring = getattr(self._local, "ring", None)
        if ring is None:
            ring = self._local.ring = _Ring()
        with self._lock:
            self._devices.add(target.device)
        flat = target.reshape(-1).view(torch.uint8)
        stream = torch.cuda.current_stream(target.device)
        for at in range(0, flat.numel(), LANDING_SLICE):
            size = min(LANDING_SLICE, flat.numel() - at)
            turn = ring.turn
            ring.turn = (turn + 1) % _RING
            if ring.done[turn] is not None:
                ring.done[turn].synchronize()  # its previous copy has left the slice
            view = ring.views[turn][:size]
            readinto(view)
            if hasher is not None:
                hasher.update(view)
            # On the device's current stream (where later work on the tensor runs too).
            flat[at:at + size].copy_(ring.slices[turn][:size], non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
            ring.done[turn] = event

    def finish(self) -> None:
        """Wait until every copy to a device has landed."""
        for device in self._devices:
            torch.cuda.synchronize(device)
