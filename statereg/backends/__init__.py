"""Storage, torch-free: one backend per URL scheme over fsspec, the registry, and checksums.

How DCP writes tensors through a backend is `statereg.dcp`, one layer up.
"""

from statereg.backends.base import StorageBackend
from statereg.backends.checksum import FileRecorder, WrittenFile
from statereg.backends.registry import open_backend, register_backend

__all__ = ["FileRecorder", "StorageBackend", "WrittenFile", "open_backend", "register_backend"]
