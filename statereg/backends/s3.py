"""s3:// and s3a:// through s3fs: Amazon S3 and S3-compatible stores (MinIO, Ceph, moto).

s3fs is imported only when an s3:// root is opened, so statereg works without it installed.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from statereg.backends.base import StorageBackend
from statereg.errors import SpecError


class S3Backend(StorageBackend):
    """Checkpoints under an S3 prefix; each file is one PUT, or one multipart upload if large."""

    schemes = ("s3", "s3a")

    # Listings are read fresh every time: another process (a second rank, an evaluator,
    # retention run elsewhere) may have changed the prefix since this one last looked.
    default_options = {"use_listings_cache": False}
    # s3fs's pipe_file sends one PUT below two parts' worth of bytes and a concurrent multipart
    # upload above; this is s3fs's own default part size (S3 needs at least 5 MiB per part).
    upload_options = {"chunksize": 50 * 2**20}

    def _open_filesystem(self, url: str, options: dict[str, Any]) -> tuple[Any, str]:
        if importlib.util.find_spec("s3fs") is None:
            raise SpecError(
                f"storage url {url!r} needs the s3fs package, which is not installed; "
                "run: pip install 'statereg[s3]'"
            )
        return super()._open_filesystem(url, options)

    def list_dir(self, path: str = "") -> list[str]:
        full = self.full_path(path)
        with self._storage_op("list", path):
            try:
                self.fs.invalidate_cache(full)
                entries = self.fs.ls(full, detail=False)
            except FileNotFoundError as exc:
                # An empty prefix and a missing bucket both arrive as FileNotFoundError; only
                # the first means "no checkpoints yet". A mistyped bucket must not silently
                # start a run from scratch.
                if _error_code(exc) == "NoSuchBucket":
                    raise self._missing_bucket("list", path) from exc
                return []
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries})


def _error_code(exc: BaseException) -> str | None:
    """The S3 error code of the botocore ClientError that s3fs translated into `exc`."""
    response = getattr(exc.__cause__, "response", None)
    return response.get("Error", {}).get("Code") if isinstance(response, dict) else None
