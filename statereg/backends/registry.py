"""Map a URL scheme to its backend class; third-party packages add backends by entry point.

Callers never branch on the scheme: `open_backend(url, options)` is the whole surface.
The built-in backends are known by class path (`KNOWN_BACKENDS`, as fsspec's
`known_implementations`) and imported the first time a URL of their scheme is opened.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any

import fsspec

from statereg.backends.base import StorageBackend
from statereg.backends.local import READ_CACHE_MODES, LocalBackend, ReadCache
from statereg.errors import SpecError
from statereg.process_state import process_wide

ENTRY_POINT_GROUP = "statereg.backends"

# The built-in backends, by scheme: "module:Class", imported on first use.
KNOWN_BACKENDS: dict[str, str] = {
    **dict.fromkeys(("", "file", "local"), "statereg.backends.local:LocalBackend"),
    "memory": "statereg.backends.memory:MemoryBackend",
    **dict.fromkeys(("s3", "s3a"), "statereg.backends.s3:S3Backend"),
    **dict.fromkeys(("gs", "gcs"), "statereg.backends.gcs:GCSBackend"),
    **dict.fromkeys(("az", "abfs", "abfss"), "statereg.backends.azure:AzureBackend"),
    "shm": "statereg.backends.shm:SharedMemoryBackend",
}

_BACKENDS: dict[str, type[StorageBackend]] = {}
process_wide(__name__, "_BACKENDS", "register_backend is process-wide, as fsspec's registry is; "
             "clearing would unregister what a program or package registered", kept=True)


def register_backend(backend: type[StorageBackend]) -> type[StorageBackend]:
    """Register `backend` for each scheme it lists (usable as a class decorator)."""
    for scheme in backend.schemes:
        _BACKENDS[scheme] = backend
    return backend


def _load_known(scheme: str) -> None:
    """Import and register the built-in backend of `scheme` (KNOWN_BACKENDS)."""
    module, _, name = KNOWN_BACKENDS[scheme].partition(":")
    backend = getattr(importlib.import_module(module), name)
    for own in backend.schemes:  # its other schemes too, unless something replaced them
        _BACKENDS.setdefault(own, backend)


_entry_points_loaded = False
process_wide(__name__, "_entry_points_loaded", "entry points register into _BACKENDS once, "
             "and stay with it", kept=True)


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            backend = entry.load()
        except Exception as exc:
            raise SpecError(
                f"storage backend entry point {entry.name!r} ({entry.value}, group "
                f"{ENTRY_POINT_GROUP}) failed to import: {exc}; fix or uninstall the package "
                "that provides it"
            ) from exc
        if not (isinstance(backend, type) and issubclass(backend, StorageBackend)):
            raise SpecError(f"storage backend entry point {entry.name!r} ({entry.value}) is not "
                            "a StorageBackend subclass")
        register_backend(backend)


def url_scheme(url: str) -> str:
    """The URL's scheme, '' for a plain path."""
    head, sep, _ = url.partition("://")
    return head.lower() if sep else ""


def backend_class(url: str) -> type[StorageBackend]:
    """The backend class for `url`: a registered one, else the generic fsspec backend."""
    scheme = url_scheme(url)
    if scheme not in _BACKENDS and scheme in KNOWN_BACKENDS:
        _load_known(scheme)
    if scheme not in _BACKENDS:
        _load_entry_points()
    if scheme in _BACKENDS:
        return _BACKENDS[scheme]
    if scheme in fsspec.available_protocols():
        return StorageBackend
    raise SpecError(
        f"storage url {url!r}: no backend for scheme {scheme!r}; use a path, file://, memory://, "
        f"s3://, gs://, az:// or another fsspec protocol "
        f"({', '.join(sorted(set(_BACKENDS) | set(KNOWN_BACKENDS)))} registered)"
    )


def open_backend(url: str, options: dict[str, Any] | None = None,
                 read_cache: ReadCache = "auto") -> StorageBackend:
    """Open the checkpoint root at `url` with fsspec `options` (secrets stay out of messages).

    `read_cache` (storage.read_cache) is the page-cache policy of a root on local disk
    (`LocalBackend.read_cache`); other backends have no page cache of their own to steer.
    """
    if read_cache not in READ_CACHE_MODES:
        raise SpecError(f"storage.read_cache {read_cache!r} for {url!r}: use one of "
                        f"{', '.join(READ_CACHE_MODES)}")
    backend = backend_class(url)(url, options)
    if isinstance(backend, LocalBackend):
        backend.read_cache = read_cache
    return backend
