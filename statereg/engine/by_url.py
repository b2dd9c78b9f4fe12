"""Look at checkpoints by URL without a declaration: read the manifest, verify, summarize."""

from __future__ import annotations

import json
import os
from typing import Any

from statereg.backends.base import StorageBackend
from statereg.backends.registry import open_backend
from statereg.engine.checkpoints import Committed, read_manifest_at
from statereg.engine.report import format_bytes, format_table
from statereg.engine.verify import verify_files
from statereg.errors import CheckpointNotFoundError
from statereg.schemas.manifest import Manifest


def split_checkpoint_url(url: str) -> tuple[str, str]:
    """'s3://b/run/step_00000100' -> ('s3://b/run', 'step_00000100'); a local path is made
    absolute first, so '.' inside a checkpoint names it, and '/' names no checkpoint."""
    if "://" not in url:
        url = os.path.abspath(url)
    trimmed = url.rstrip("/")
    root, _, name = trimmed.rpartition("/")
    if name in ("", ".", "..") or name.endswith(":"):
        raise CheckpointNotFoundError(
            f"{url!r} names no checkpoint directory; give one, e.g. "
            "./checkpoints/step_00000100 or s3://bucket/run/step_00000100"
        )
    if root.endswith(":/"):  # 'memory://step_x': the root is the scheme's top
        if root != "memory:/":  # 's3://bucket', 'shm://run7': a root, not a checkpoint
            raise CheckpointNotFoundError(
                f"{url!r} is a root, not a checkpoint directory in it; give one, e.g. "
                f"{trimmed}/step_00000100 (`statereg ls {trimmed}` lists them)"
            )
        root += "/"
    return root or "/", name


def open_checkpoint(url: str, options: dict[str, Any] | None = None,
                    ) -> tuple[StorageBackend, Committed]:
    """The backend holding checkpoint `url`, and the committed checkpoint itself."""
    root, name = split_checkpoint_url(url)
    backend = open_backend(root, options)
    return backend, Committed(name, read_manifest_at(backend, name))


def read_manifest(url: str, options: dict[str, Any] | None = None) -> Manifest:
    """The manifest of the checkpoint at `url` (raises ManifestError / CheckpointNotFoundError)."""
    return open_checkpoint(url, options)[1].manifest


def verify(url: str, options: dict[str, Any] | None = None) -> Manifest:
    """Recompute every file's size and checksum; raises CorruptCheckpointError on a difference."""
    backend, ckpt = open_checkpoint(url, options)
    verify_files(backend, ckpt.name, ckpt.manifest.files, "full")
    verify_files(backend, "", ckpt.manifest.references, "full")
    return ckpt.manifest


def describe(manifest: Manifest, url: str) -> str:
    """A human summary: step, versions, and one line per component."""
    lines = [
        f"checkpoint:  {url}",
        f"step:        {manifest.step}",
        f"tokens_seen: {manifest.tokens_seen if manifest.tokens_seen is not None else '-'}",
        f"extra:       {json.dumps(manifest.extra) if manifest.extra else '-'}",
        f"created:     {manifest.created_at}",
        f"versions:    format {manifest.format_version}, statereg {manifest.statereg_version}, "
        f"torch {manifest.torch_version}",
        f"world size:  {manifest.world_size}",
        f"total:       {len(manifest.files)} files, {format_bytes(manifest.total_bytes)}",
        "",
    ]
    rows = [("component", "kind", "sharing", "format", "tensors", "bytes")]
    for name, comp in manifest.components.items():
        rows.append((name, comp.kind, comp.sharing, comp.format, str(comp.tensors),
                     format_bytes(comp.bytes)))
    lines += format_table(rows)
    return "\n".join(lines)
