"""`VerifiedReads`: a store whose whole-file reads of recorded files are checked as they are
read, against the manifest's records (checksum.py's checks over base.py's reads)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import IO

from statereg.backends.base import StorageBackend
from statereg.backends.capabilities import StoreCapabilities
from statereg.backends.checksum import Recorded, check_file, missing


class VerifiedReads:
    """A storage backend whose whole-file reads of recorded files are checked as they are read.

    `read_bytes` of a file the manifest records reads at most one byte more than its
    recorded size and raises CorruptCheckpointError (naming the file) on any difference,
    before the caller sees the bytes; the rest of `stores.ReadableStore`, what readers call,
    is the backend's own. The engine hands this to the layouts at load time, so every reader
    of whole files (object state, sidecars, DCP metadata, torch and safetensors model files)
    is verified without knowing. DCP items are read in ranges through `for_reading`'s
    backend and checked against their own digests (dcp/reader.py).
    """

    def __init__(self, backend: StorageBackend, records: Mapping[str, Recorded]) -> None:
        self._backend = backend
        self.records = records

    @property
    def capabilities(self) -> StoreCapabilities:
        return self._backend.capabilities

    def display(self, path: str = "") -> str:
        return self._backend.display(path)

    def open_read(self, path: str, size: int | None = None,
                  ) -> contextlib.AbstractContextManager[IO[bytes]]:
        return self._backend.open_read(path, size)

    def for_reading(self, nbytes: int) -> StorageBackend:
        return self._backend.for_reading(nbytes)

    def exists(self, path: str) -> bool:
        return self._backend.exists(path)

    def list_dir(self, path: str = "") -> list[str]:
        return self._backend.list_dir(path)

    def read_bytes(self, path: str, limit: int | None = None) -> bytes:
        record = self.records.get(path)
        if record is None or limit is not None:
            return self._backend.read_bytes(path, limit)
        where = self._backend.display(path)
        try:
            data = self._backend.read_bytes(path, limit=record.size + 1)
        except FileNotFoundError:
            raise missing(where, record) from None
        check_file(where, record, data)
        return data
