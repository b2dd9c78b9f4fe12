"""Adapters from live objects (model, optimizer, scheduler, dataloader, RNG, custom) to state."""

from statereg.state.factory import build_adapters
from statereg.state.model import ModelAdapter
from statereg.state.objects import DataloaderAdapter, ObjectAdapter
from statereg.state.optimizer import OptimizerAdapter
from statereg.state.protocols import TensorMeta
from statereg.state.rng import RNGAdapter

__all__ = [
    "DataloaderAdapter",
    "ModelAdapter",
    "ObjectAdapter",
    "OptimizerAdapter",
    "RNGAdapter",
    "TensorMeta",
    "build_adapters",
]
