"""Components stored as whole files: the hooks engine.save_steps and engine.load call.

A model in format `safetensors` or `torch` is consolidated: every rank sends its shards, rank
0 writes full tensors, and on load every rank takes its own slice. Small object state goes
to one file per copy in format `json` or `torch`.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import torch

from statereg.backends.base import StorageBackend
from statereg.backends.checksum import WrittenFile
from statereg.backends.stores import ReadableStore
from statereg.formats.hf import SafetensorsDirectory, write_safetensors
from statereg.formats.jsonstate import decode_state, encode_state
from statereg.formats.names import TORCH_MODEL_NAME
from statereg.formats.tensors import gather_full, tensor_meta
from statereg.formats.torchfile import TorchFile, decode_torch, encode_torch
from statereg.schemas.spec import DEFAULT_MAX_SHARD_SIZE, Format, parse_size

# Model formats that hold full tensors in whole files (the others: dcp).
MODEL_FILE_FORMATS = frozenset({"safetensors", "torch"})


def encode_object(fmt: Format, state: Any, where: str) -> bytes:
    """The bytes of an object's state in format json or torch."""
    return encode_torch(state, where) if fmt == "torch" else encode_state(state, where)


def decode_object(fmt: Format, data: bytes, where: str) -> Any:
    return decode_torch(data, where) if fmt == "torch" else decode_state(data, where)


def write_model_files(backend: StorageBackend, directory: str, fmt: Format,
                      tensors: dict[str, torch.Tensor], group: Any, writes: bool,
                      max_shard_size: int | None,
                      on_written: Callable[[WrittenFile], None]) -> None:
    """Write a model's full tensors under `directory`: a collective over `group` (if any)
    that gathers them; the rank that `writes` writes the files."""
    metas = {k: tensor_meta(t) for k, t in tensors.items()}

    def fetch(names: list[str]) -> dict[str, torch.Tensor] | None:
        return gather_full(tensors, names, group)

    if fmt == "safetensors":
        limit = max_shard_size or parse_size(DEFAULT_MAX_SHARD_SIZE)
        write_safetensors(backend, directory, metas, fetch, limit, on_written, writes)
        return
    full = fetch(list(metas))
    if full is not None:
        buffer = io.BytesIO()
        torch.save(full, buffer)
        on_written(backend.write_bytes(f"{directory}/{TORCH_MODEL_NAME}", buffer.getvalue()))


def open_model_files(backend: ReadableStore, directory: str, fmt: Format,
                     read: Callable[[str], bytes] | None = None,
                     ) -> SafetensorsDirectory | TorchFile:
    """The model files of `directory`; `read(path)` reads a whole file for every rank (once
    for the job: engine/layouts/consolidated.py), else each reads it itself."""
    if fmt == "safetensors":
        return SafetensorsDirectory(backend, directory)
    path = f"{directory}/{TORCH_MODEL_NAME}"
    return TorchFile(backend, path, None if read is None else read(path))
