"""gs:// and gcs:// through gcsfs: Google Cloud Storage (and emulators speaking its JSON API).

gcsfs is imported only when a gs:// root is opened, so statereg works without it installed.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any

from statereg.backends.base import StorageBackend
from statereg.errors import SpecError

logger = logging.getLogger("statereg")


class GCSBackend(StorageBackend):
    """Checkpoints under a GCS prefix; each file is one upload, resumable in chunks if large."""

    schemes = ("gs", "gcs")

    # Listings are read fresh every time: another process (a second rank, an evaluator,
    # retention run elsewhere) may have changed the prefix since this one last looked.
    default_options = {"use_listings_cache": False}
    # gcsfs's pipe_file sends one simple upload below this size and a resumable upload in
    # chunks of this size above it (GCS needs chunks in multiples of 256 KiB).
    upload_options = {"chunksize": 50 * 2**20}

    def _open_filesystem(self, url: str, options: dict[str, Any]) -> tuple[Any, str]:
        if importlib.util.find_spec("gcsfs") is None:
            raise SpecError(
                f"storage url {url!r} needs the gcsfs package, which is not installed; "
                "run: pip install 'statereg[gcs]'"
            )
        fs, root = super()._open_filesystem(url, options)
        _warn_if_probing_emulator(fs, options)
        return fs, root

    def list_dir(self, path: str = "") -> list[str]:
        full = self.full_path(path)
        with self._storage_op("list", path):
            try:
                self.fs.invalidate_cache(full)
                entries = self.fs.ls(full, detail=False)
            except FileNotFoundError:
                # An empty prefix and a missing bucket both arrive as FileNotFoundError; only
                # the first means "no checkpoints yet". A mistyped bucket must not silently
                # start a run from scratch. Listing one object needs no more permission than
                # the listing itself (a bucket GET would need storage.buckets.get).
                bucket = self.root.split("/", 1)[0]
                try:
                    self.fs.call("GET", "b/{}/o", bucket, maxResults=1)  # type: ignore[attr-defined]
                except FileNotFoundError as exc:
                    raise self._missing_bucket("list", path) from exc
                return []
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries})


def _warn_if_probing_emulator(fs: Any, options: dict[str, Any]) -> None:
    """gcsfs's experimental class asks a gRPC API for each bucket's type; emulators never answer.

    Each operation then waits for that lookup to time out (about a minute), so say why.
    """
    custom_endpoint = options.get("endpoint_url") or os.environ.get("STORAGE_EMULATOR_HOST")
    if custom_endpoint and type(fs).__name__ == "ExtendedGcsFileSystem":
        logger.warning(
            "gcsfs's experimental bucket-type lookup is on while storage.options.endpoint_url "
            "(or STORAGE_EMULATOR_HOST) points at a custom endpoint; an emulator does not "
            "answer it and every operation will stall. Set GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="
            "false in the environment before gcsfs is imported"
        )
