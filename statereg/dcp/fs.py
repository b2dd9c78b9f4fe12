"""DCP's `FileSystemBase` over a `StorageBackend`: the only file system DCP sees.

Streams it opens for writing checksum every file and report it to a `FileRecorder`; it never
renames (object stores cannot do it atomically), and it resolves the `..` of items an
incremental save references, never above the backend root.
"""

from __future__ import annotations

import io
import os
import posixpath
from collections.abc import Generator
from contextlib import contextmanager

from torch.distributed.checkpoint.filesystem import FileSystemBase

from statereg.backends.base import StorageBackend
from statereg.backends.checksum import FileRecorder, HashingWriter
from statereg.backends.stores import ReadableStore
from statereg.errors import CorruptCheckpointError


def normalize_path(path: str) -> str:
    """Resolve '..' (items an incremental save references); never above the backend root."""
    if "/../" not in f"/{path}":
        return path
    resolved = posixpath.normpath(path)
    if resolved == ".." or resolved.startswith(("../", "/")):
        raise CorruptCheckpointError(
            f"DCP metadata refers to {path!r}, outside the checkpoint root; refusing to read it"
        )
    return resolved


class BackendFileSystem(FileSystemBase):
    """DCP's FileSystemBase over a StorageBackend; paths are relative to the backend root.

    A reader (dcp/reader.py) passes a ReadableStore and only reads through it. A writer
    passes the backend it writes through (`StorageBackend.for_writing`: around the page
    cache or not, as its I/O policy says)."""

    def __init__(self, backend: StorageBackend | ReadableStore,
                 recorder: FileRecorder | None = None, sizes: dict[str, int] | None = None,
                 ) -> None:
        self.backend = backend
        self.recorder = recorder
        self.sizes = sizes or {}  # file sizes known from the manifest, by path

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        path = normalize_path(os.fspath(path))
        if "r" in mode:
            with self.backend.open_read(path, self.sizes.get(path)) as stream:
                # DCP annotates io.IOBase; its callers use any binary file object:
                yield stream  # type: ignore[misc]
            return
        on_done = self.recorder.add if self.recorder is not None else None
        writer: HashingWriter = self._writable().open_write(path, on_done)
        try:
            yield writer
        except BaseException:
            writer.abort()
            raise
        writer.close()

    def _writable(self) -> StorageBackend:
        """The backend, for writes: only a writer's file system is built on a StorageBackend
        (a reader's may be a read-only store)."""
        assert isinstance(self.backend, StorageBackend), "a read-only store takes no writes"
        return self.backend

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return f"{os.fspath(path)}/{suffix}"

    def init_path(self, path: str | os.PathLike) -> str:
        return os.fspath(path)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        raise NotImplementedError("statereg's DCP glue never renames (object stores cannot)")

    def mkdir(self, path: str | os.PathLike) -> None:
        self._writable().makedirs(os.fspath(path))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False

    def exists(self, path: str | os.PathLike) -> bool:
        return self.backend.exists(os.fspath(path))

    def rm_file(self, path: str | os.PathLike) -> None:
        self._writable().remove_file(os.fspath(path))
