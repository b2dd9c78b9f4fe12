"""gs:// and gcs:// through gcsfs: Google Cloud Storage (and emulators speaking its JSON API).

gcsfs is imported only when a gs:// root is opened, so statereg works without it installed.
"""

from __future__ import annotations

import logging
from typing import Any

from statereg import env
from statereg.backends.base import StorageBackend
from statereg.backends.capabilities import StoreCapabilities

logger = logging.getLogger(__name__)


class GCSBackend(StorageBackend):
    """Checkpoints under a GCS prefix; each file is one upload, resumable in chunks if large."""

    schemes = ("gs", "gcs")
    client_package = "gcsfs"
    install_extra = "gcs"

    # Listings are read fresh every time: another process (a second rank, an evaluator,
    # retention run elsewhere) may have changed the prefix since this one last looked.
    default_options = {"use_listings_cache": False}
    # gcsfs's pipe_file sends one simple upload below this size and a resumable upload in
    # chunks of this size above it (GCS needs chunks in multiples of 256 KiB).
    upload_options = {"chunksize": 50 * 2**20}
    kind = StoreCapabilities("object-store", "network")

    # An upload with ifGenerationMatch=0: GCS refuses it with 412 if the object exists, so
    # of two racing writers exactly one wins. (gcp-storage-emulator ignores the condition.)
    atomic_create = True

    def _open_filesystem(self, url: str, options: dict[str, Any]) -> tuple[Any, str]:
        fs, root = super()._open_filesystem(url, options)
        _warn_if_probing_emulator(fs, options)
        return fs, root

    def _bucket_missing(self, not_found: FileNotFoundError) -> bool:
        # Listing one object needs no more permission than the listing itself (a bucket GET
        # would need storage.buckets.get).
        bucket = self.root.split("/", 1)[0]
        try:
            self.fs.call("GET", "b/{}/o", bucket, maxResults=1)  # type: ignore[attr-defined]
        except FileNotFoundError:
            return True
        return False


def _warn_if_probing_emulator(fs: Any, options: dict[str, Any]) -> None:
    """gcsfs's experimental class asks a gRPC API for each bucket's type; emulators never answer.

    Each operation then waits for that lookup to time out (about a minute), so say why.
    """
    custom_endpoint = options.get("endpoint_url") or env.storage_emulator_host()
    if custom_endpoint and type(fs).__name__ == "ExtendedGcsFileSystem":
        logger.warning(
            "gcsfs's experimental bucket-type lookup is on while storage.options.endpoint_url "
            "(or STORAGE_EMULATOR_HOST) points at a custom endpoint; an emulator does not "
            "answer it and every operation will stall. Set GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="
            "false in the environment before gcsfs is imported"
        )
