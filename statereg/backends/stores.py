"""The read-only faces of a store, as protocols: what readers call and nothing more.

`ReadOnlyStore`: files under a root read whole, by byte ranges or in blocks. Every
`StorageBackend` is one, and so is another node's memory read through its server
(tiers/transport/client.PeerBackend), which has these methods and no others: a store that
only reads is typed as this, not as a backend whose writes refuse.

`ReadableStore`: what a load reads a checkpoint through (the layouts, DCP's readers, the
model-file readers). A StorageBackend meets it, and so does verified.VerifiedReads, which
checks each whole-file read against the manifest.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import IO, Protocol, runtime_checkable

from statereg.backends.capabilities import StoreCapabilities
from statereg.backends.checksum import SeekableReads


@runtime_checkable
class ReadOnlyStore(Protocol):
    """Files under a root, read: whole, by byte ranges, or a block at a time. A file that
    is not there is FileNotFoundError; any other failure the store's StorageError."""

    def display(self, path: str = "") -> str:
        """The file's URL, for messages (never a credential)."""
        ...

    def exists(self, path: str) -> bool:
        """Whether the file exists."""
        ...

    def size(self, path: str) -> int:
        """The file's size in bytes."""
        ...

    def read_bytes(self, path: str, limit: int | None = None) -> bytes:
        """The whole file (at most its first `limit` bytes)."""
        ...

    def read_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of the file (fewer if it ends sooner)."""
        ...

    def open_read(self, path: str, size: int | None = None,
                  ) -> contextlib.AbstractContextManager[IO[bytes]]:
        """A seekable stream over the whole file (`size`, where known, spares asking)."""
        ...

    def open_ranges(self, path: str, ranges: Sequence[tuple[int, int]],
                    size: int | None = None) -> contextlib.AbstractContextManager[IO[bytes]]:
        """A seekable stream over the file that fetches only `ranges`."""
        ...

    def open_blocks(self, path: str) -> contextlib.AbstractContextManager[SeekableReads]:
        """The file a block at a time, for whole-file checks in bounded memory."""
        ...


class ReadableStore(Protocol):
    """What a load reads a checkpoint through: the layouts, DCP's readers (BackendReader,
    GroupReader, BackendFileSystem's reads) and the model-file readers (safetensors, torch
    files) call these and nothing else."""

    @property
    def capabilities(self) -> StoreCapabilities:
        """What kind of store this is; the engine's I/O policy is derived from it."""
        ...

    def display(self, path: str = "") -> str:
        """The file's URL, for messages."""
        ...

    def read_bytes(self, path: str, limit: int | None = None) -> bytes:
        """The whole file (at most its first `limit` bytes); FileNotFoundError if missing."""
        ...

    def open_read(self, path: str, size: int | None = None,
                  ) -> contextlib.AbstractContextManager[IO[bytes]]:
        """A seekable stream over the whole file."""
        ...

    def for_reading(self, nbytes: int) -> ReadOnlyStore:
        """The store one load that reads `nbytes` in all reads its byte ranges through."""
        ...

    def exists(self, path: str) -> bool:
        """Whether the file exists."""
        ...

    def list_dir(self, path: str = "") -> list[str]:
        """Names of the entries directly under `path`; empty if it does not exist."""
        ...
