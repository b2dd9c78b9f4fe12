"""s3:// and s3a:// through s3fs: Amazon S3 and S3-compatible stores (MinIO, Ceph, moto).

s3fs is imported only when an s3:// root is opened, so statereg works without it installed.
"""

from __future__ import annotations

from statereg.backends.base import StorageBackend


class S3Backend(StorageBackend):
    """Checkpoints under an S3 prefix; each file is one PUT, or one multipart upload if large."""

    schemes = ("s3", "s3a")
    client_package = "s3fs"
    install_extra = "s3"
    # Listings are read fresh every time: another process (a second rank, an evaluator,
    # retention run elsewhere) may have changed the prefix since this one last looked.
    default_options = {"use_listings_cache": False}
    # s3fs's pipe_file sends one PUT below two parts' worth of bytes and a concurrent multipart
    # upload above; this is s3fs's own default part size (S3 needs at least 5 MiB per part).
    upload_options = {"chunksize": 50 * 2**20}

    def _bucket_missing(self, not_found: FileNotFoundError) -> bool:
        # s3fs keeps botocore's ClientError as the cause, with S3's error code.
        response = getattr(not_found.__cause__, "response", None)
        code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
        return code == "NoSuchBucket"
