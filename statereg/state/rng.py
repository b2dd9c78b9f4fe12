"""RNG adapter: the process's own generators (Python, NumPy, torch CPU, CUDA when present)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import xxhash


class RNGAdapter:
    """Captures and restores every global random generator a training loop draws from."""

    kind = "rng"

    def __init__(self, name: str) -> None:
        self.name = name

    def capture(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def check_ready(self) -> None:
        """Generators can be restored at any time."""

    def check_state(self, state: dict[str, Any]) -> None:
        """Any process's generator states fit this one's."""

    def restore(self, state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if torch.cuda.is_available():
            if "cuda" in state:
                torch.cuda.set_rng_state_all(state["cuda"])
            elif "cuda_seed" in state:
                torch.cuda.manual_seed_all(state["cuda_seed"])

    def reshard(self, states: list[dict[str, Any]], rank: int, world_size: int) -> dict[str, Any]:
        """Fresh per-rank streams after a world-size change, derived from the checkpoint.

        The seed is a hash of saved rank 0's torch generator state and the new rank, so a
        resumed job is reproducible (same checkpoint + same world size -> same streams) and
        ranks differ; it cannot match a run that never changed its world size.
        """
        hasher = xxhash.xxh3_64()
        hasher.update(states[0]["torch"].numpy().tobytes())
        hasher.update(f"{rank}/{world_size}".encode())
        seed = hasher.intdigest() & (2**63 - 1)
        generator = torch.Generator().manual_seed(seed)
        return {
            "python": random.Random(seed).getstate(),
            "numpy": np.random.RandomState(seed % 2**32).get_state(),
            "torch": generator.get_state(),
            "cuda_seed": seed,
        }
