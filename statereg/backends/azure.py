"""az://, abfs:// and abfss:// through adlfs: Azure Blob Storage (and the Azurite emulator).

adlfs is imported only when an Azure root is opened, so statereg works without it installed.
"""

from __future__ import annotations

from statereg.backends.base import StorageBackend, StoredFile
from statereg.backends.capabilities import StoreCapabilities


def _error_codes(error: BaseException) -> set[str]:
    """The Azure error codes (`ContainerNotFound`, ...) of `error` and the errors it chains."""
    codes: set[str] = set()
    seen: list[BaseException] = []
    link: BaseException | None = error
    while link is not None and link not in seen:
        seen.append(link)
        code = getattr(link, "error_code", None)
        if code:
            codes.add(str(code))
        link = link.__cause__ or link.__context__
    return codes


class AzureBackend(StorageBackend):
    """Checkpoints under a prefix of an Azure Blob container; each file is one block upload
    (staged in blocks by the Azure SDK when large)."""

    schemes = ("az", "abfs", "abfss")
    client_package = "adlfs"
    install_extra = "azure"
    bucket_word = "container"
    # adlfs caches listings by default; another process (a second rank, an evaluator,
    # retention run elsewhere) may have changed the prefix since this one last looked.
    default_options = {"use_listings_cache": False}
    kind = StoreCapabilities("object-store", "network")
    # adlfs sends mode="create" as an upload with If-None-Match: *; the service refuses it
    # (409 BlobAlreadyExists) if the blob exists, so of two racing writers exactly one wins.
    atomic_create = True

    def _bucket_missing(self, not_found: FileNotFoundError) -> bool:
        # adlfs raises FileNotFoundError both for an empty prefix and, with the SDK's
        # ContainerNotFound chained, for a missing container.
        return "ContainerNotFound" in _error_codes(not_found)

    def walk(self, path: str = "") -> list[StoredFile]:
        found = super().walk(path)
        if not found:
            # adlfs's find answers an empty list for a missing container too: ask for it.
            container = self.root.split("/", 1)[0]
            with self._storage_op("list", path):
                try:
                    self.fs.info(container, refresh=True)
                except FileNotFoundError as exc:
                    raise self._missing_bucket("list", path) from exc
        return found

    def _names_missing_bucket(self, error: BaseException) -> bool:
        # Writes to a missing container fail with the SDK's own ResourceNotFoundError.
        return "ContainerNotFound" in _error_codes(error)
