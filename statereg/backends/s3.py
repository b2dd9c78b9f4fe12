"""s3:// and s3a:// through s3fs: Amazon S3 and S3-compatible stores (MinIO, Ceph, moto).

s3fs is imported only when an s3:// root is opened, so statereg works without it installed.
"""

from __future__ import annotations

import time
from typing import Any

from statereg.backends.base import EXCLUSIVE_WRITE, IncompleteUpload, StorageBackend
from statereg.backends.checksum import WrittenFile, checksum_of, new_hasher

# A conditional PUT racing another one on the same key may be answered 409
# ConditionalRequestConflict ("retry"); the retry then gets 412 if the other one won.
_CONFLICT_RETRIES = 5


def _s3_error_code(exc: BaseException) -> str | None:
    """The S3 error code of a botocore ClientError, or of the one s3fs chained as the cause."""
    for link in (exc, exc.__cause__):
        response = getattr(link, "response", None)
        if isinstance(response, dict):
            return response.get("Error", {}).get("Code")
    return None


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
    # Each file is a round trip to the store: keep more of them in flight than on a disk.
    default_io_threads = 8
    # PUT with If-None-Match: * (S3 since August 2024; MinIO, moto): the store refuses the
    # write with 412 if the key exists, so of two racing writers exactly one wins.
    atomic_create = True

    def _bucket_missing(self, not_found: FileNotFoundError) -> bool:
        # s3fs keeps botocore's ClientError as the cause, with S3's error code.
        return _s3_error_code(not_found) == "NoSuchBucket"

    def _split(self, path: str) -> tuple[str, str]:
        bucket, _, key = self.full_path(path).partition("/")
        return bucket, key

    def _store_if_absent(self, path: str, data: bytes) -> WrittenFile:
        bucket, key = self._split(path)
        hasher = new_hasher()
        hasher.update(data)
        with self._storage_op(EXCLUSIVE_WRITE, path):
            for attempt in range(_CONFLICT_RETRIES):
                try:
                    self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data,
                                    IfNoneMatch="*")
                    break
                except FileExistsError:
                    raise
                except Exception as exc:
                    code = _s3_error_code(exc)
                    if code == "PreconditionFailed":
                        raise FileExistsError(self.display(path)) from None
                    if code != "ConditionalRequestConflict" or attempt == _CONFLICT_RETRIES - 1:
                        raise
                    time.sleep(0.05 * (attempt + 1))
            self.fs.invalidate_cache(self.full_path(path))
        return WrittenFile(path, len(data), checksum_of(hasher))

    def incomplete_uploads(self, path: str = "") -> list[IncompleteUpload]:
        bucket, key = self._split(path)
        prefix = f"{key}/" if key else ""
        found: list[IncompleteUpload] = []
        request: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
        with self._storage_op("list uploads", path):
            while True:
                page = self.fs.call_s3("list_multipart_uploads", **request)
                for upload in page.get("Uploads", []) or []:
                    initiated = upload.get("Initiated")
                    root_key = self.root.partition("/")[2]
                    relative = upload["Key"][len(root_key) + 1:] if root_key else upload["Key"]
                    found.append(IncompleteUpload(
                        relative, upload["UploadId"],
                        initiated.timestamp() if initiated is not None else None))
                if not page.get("IsTruncated"):
                    break
                request["KeyMarker"] = page.get("NextKeyMarker")
                request["UploadIdMarker"] = page.get("NextUploadIdMarker")
        return found

    def abort_upload(self, upload: IncompleteUpload) -> None:
        bucket, key = self._split(upload.path)
        with self._storage_op("abort upload", upload.path):
            self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key,
                            UploadId=upload.upload_id)
