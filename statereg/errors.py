"""One exception hierarchy for statereg; every message names the object and says what to do.

This module imports nothing heavy so that `statereg.schemas` and the CLI stay torch-free.
"""

from __future__ import annotations


class StateregError(Exception):
    """Base class of every error statereg raises on purpose."""


class SpecError(StateregError, ValueError):
    """The declaration (statereg.yaml, a RegistrySpec, or the objects given to it) is wrong."""


class StorageError(StateregError, OSError):
    """A storage operation failed; the message names the URL and the operation."""


class ManifestError(StateregError):
    """A manifest.json is missing, unparsable, or from an unsupported format version."""


class CorruptCheckpointError(StateregError):
    """A checkpoint's bytes differ from what its manifest recorded (size or checksum)."""


class CheckpointMismatchError(StateregError):
    """A checkpoint does not fit the live objects (keys, shapes, dtypes, world size)."""


class CheckpointNotFoundError(StateregError, FileNotFoundError):
    """The requested checkpoint does not exist or is not committed."""


class CheckpointExistsError(StateregError, FileExistsError):
    """A committed checkpoint already holds the requested step."""


class CheckpointInProgressError(CheckpointExistsError):
    """Another save, still running, holds the requested step (two saves cannot both commit)."""


class LoadOrderError(StateregError):
    """Saved state arrived after its object had started (e.g. a dataloader mid-epoch)."""


class CheckpointDeletedError(CheckpointNotFoundError):
    """A checkpoint was deleted while it was being read or reused (most often by another
    process's retention); nothing was loaded or committed from it."""
