"""RNG adapter: the process's own generators (Python, NumPy, torch CPU, CUDA when present)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


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

    def restore(self, state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
