"""Publishing a fully written checkpoint: manifest.sum, manifest.json, then `latest`.

No step needs a rename, so the protocol holds on object stores, where a single PUT is the
atomic unit. The manifest is created exclusively, so two savers can never both believe they
committed one step. docs/reliability.md walks through each step and what a crash at each one
leaves behind.
"""

from __future__ import annotations

from statereg.backends.base import StorageBackend
from statereg.engine.checkpoints import LATEST_NAME, MANIFEST_SUM_NAME, manifest_checksum
from statereg.engine.claims import Claim
from statereg.errors import CheckpointExistsError
from statereg.schemas.manifest import MANIFEST_NAME, Manifest


def commit(backend: StorageBackend, name: str, manifest: Manifest, claim: Claim | None,
           move_latest: bool = True) -> None:
    """Publish a fully written checkpoint: manifest.sum, then the manifest (both created
    exclusively; the manifest commits it), then the `latest` pointer.

    `claim` is the one claim_checkpoint() returned for `name`: it is checked to be still this
    saver's before anything is published (CheckpointInProgressError if another saver took the
    directory over) and released afterwards, committed or not. None publishes unclaimed.
    """
    if claim is not None:
        claim.check_owner()
    data = manifest.to_json()
    try:
        # Both created exclusively: a save that lost a race never overwrites the winner's.
        for path, content in ((f"{name}/{MANIFEST_SUM_NAME}",
                               f"{manifest_checksum(data)}\n".encode()),
                              (f"{name}/{MANIFEST_NAME}", data)):
            try:
                backend.create_bytes(path, content)
            except FileExistsError:
                raise CheckpointExistsError(
                    f"{backend.display(name)} was committed by another save first (or is being "
                    "committed by one); this save's files were not used. Two saves of one step "
                    "cannot both commit: give each run its own root or step"
                ) from None
        if move_latest:
            backend.write_bytes(LATEST_NAME, name.encode())
    finally:
        if claim is not None:
            claim.release()
