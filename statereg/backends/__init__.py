"""Storage: one backend per URL scheme over fsspec, and the glue that lets DCP write through it."""

from statereg.backends.base import StorageBackend
from statereg.backends.checksum import FileRecorder, WrittenFile
from statereg.backends.registry import open_backend, register_backend

__all__ = ["FileRecorder", "StorageBackend", "WrittenFile", "open_backend", "register_backend"]
