"""statereg: declare PyTorch training state once; save, resume and fine-tune from it.

Names are re-exported lazily so that `import statereg.schemas` (and the CLI's YAML checks)
never import torch.
"""

from __future__ import annotations

import logging
from importlib import import_module
from typing import TYPE_CHECKING, Any

from statereg.version import __version__

# Every module logs to its own logger under "statereg" (logging.getLogger(__name__)); the
# application decides where records go. Without a handler of its own, Python's last-resort
# handler would print its warnings on stderr in every program that configured no logging
# (the `statereg` command prints them itself: cli/parser.py, _warnings_to_stderr).
logging.getLogger(__name__).addHandler(logging.NullHandler())

_EXPORTS = {
    "load_spec": "statereg.declaration",
    "RegistrySpec": "statereg.schemas",
    "ComponentSpec": "statereg.schemas",
    "StorageSpec": "statereg.schemas",
    "Manifest": "statereg.schemas",
    "CheckpointManager": "statereg.manager",
    "LoadResult": "statereg.engine.load",
    "SaveInfo": "statereg.engine.saver",
    "CadenceReport": "statereg.engine.cadence",
    "KeyReport": "statereg.engine.load",
    "load_model_from": "statereg.interop",
    "export_hf": "statereg.interop",
    "read_manifest": "statereg.engine.by_url",
    "verify": "statereg.engine.by_url",
    "list_checkpoints": "statereg.engine.listing",
    "latest": "statereg.engine.listing",
    "CheckpointInfo": "statereg.engine.listing",
    "StateregError": "statereg.errors",
    "SpecError": "statereg.errors",
    "StorageError": "statereg.errors",
    "ManifestError": "statereg.errors",
    "CorruptCheckpointError": "statereg.errors",
    "CheckpointMismatchError": "statereg.errors",
    "CheckpointNotFoundError": "statereg.errors",
    "CheckpointDeletedError": "statereg.errors",
    "CheckpointExistsError": "statereg.errors",
    "CheckpointInProgressError": "statereg.errors",
    "LoadOrderError": "statereg.errors",
    "clear_process_state": "statereg.process_state",
}

__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:
    from statereg.declaration import load_spec
    from statereg.engine.by_url import read_manifest, verify
    from statereg.engine.cadence import CadenceReport
    from statereg.engine.listing import CheckpointInfo, latest, list_checkpoints
    from statereg.engine.load import KeyReport, LoadResult
    from statereg.engine.saver import SaveInfo
    from statereg.errors import (
        CheckpointDeletedError,
        CheckpointExistsError,
        CheckpointInProgressError,
        CheckpointMismatchError,
        CheckpointNotFoundError,
        CorruptCheckpointError,
        LoadOrderError,
        ManifestError,
        SpecError,
        StateregError,
        StorageError,
    )
    from statereg.interop import export_hf, load_model_from
    from statereg.manager import CheckpointManager
    from statereg.process_state import clear_process_state
    from statereg.schemas import ComponentSpec, Manifest, RegistrySpec, StorageSpec


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'statereg' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public names too, though they load lazily: IDEs, `help()` and `dir()` list them."""
    return sorted({*globals(), *_EXPORTS})
