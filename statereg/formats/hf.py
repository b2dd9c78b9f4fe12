"""Hugging Face safetensors directories: write them (sharded, with an index) and read them.

The layout is transformers': `model-0000i-of-0000N.safetensors` files of at most a chosen
size and `model.safetensors.index.json` naming the file of every tensor, so `from_pretrained`
and `safetensors.torch.load_file` read what statereg writes. The bytes come from the
`safetensors` library; statereg only routes them through a StorageBackend, so any storage
works and every file is checksummed as it is written.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable

import safetensors.torch
import torch

from statereg.backends.base import StorageBackend
from statereg.backends.checksum import WrittenFile
from statereg.backends.stores import ReadableStore
from statereg.errors import CheckpointNotFoundError, CorruptCheckpointError
from statereg.formats.names import (
    SAFETENSORS_INDEX_NAME,
    SAFETENSORS_SINGLE_NAME,
    SAFETENSORS_SUFFIX,
    shard_file_name,
)
from statereg.formats.tensors import copy_full_into, nbytes, owned, plan_shards
from statereg.state.protocols import TensorMeta

INDEX_NAME = SAFETENSORS_INDEX_NAME
SINGLE_NAME = SAFETENSORS_SINGLE_NAME
SUFFIX = SAFETENSORS_SUFFIX
# safetensors' own bound on the JSON header; anything larger is not a safetensors file.
_MAX_HEADER = 100 * 1024 * 1024
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}

Fetch = Callable[[list[str]], "dict[str, torch.Tensor] | None"]


def join(directory: str, name: str) -> str:
    return f"{directory}/{name}" if directory else name


def cast_metas(metas: dict[str, TensorMeta], dtype: torch.dtype | None,
               ) -> dict[str, TensorMeta]:
    """Shapes and dtypes after converting floating-point tensors to `dtype` (None: as they are)."""
    if dtype is None:
        return metas
    return {k: TensorMeta(m.shape, dtype if m.dtype.is_floating_point else m.dtype)
            for k, m in metas.items()}


def write_safetensors(backend: StorageBackend, directory: str, metas: dict[str, TensorMeta],
                      fetch: Fetch, max_shard_size: int, on_written: Callable[[WrittenFile], None],
                      writes: bool, dtype: torch.dtype | None = None) -> None:
    """Write the tensors `metas` names as safetensors files plus the index under `directory`.

    `fetch(names)` returns full tensors on the writing rank (`writes`) and None elsewhere; it
    may be a collective, so it runs for every file on every rank even after a failed write,
    and the first failure is raised once all files were fetched.
    """
    final = cast_metas(metas, dtype)
    shards = plan_shards(final, max_shard_size)
    weight_map: dict[str, str] = {}
    error: Exception | None = None
    for number, names in enumerate(shards, start=1):
        tensors = fetch(names)
        if tensors is None or error is not None:
            continue
        file = shard_file_name(number, len(shards))
        try:
            if dtype is not None:
                tensors = {k: t.to(dtype) if t.is_floating_point() else t
                           for k, t in tensors.items()}
            data = safetensors.torch.save(owned(tensors), metadata={"format": "pt"})
            del tensors
            on_written(backend.write_bytes(join(directory, file), data))
        except Exception as exc:
            error = exc
        weight_map.update(dict.fromkeys(names, file))
    if error is not None:
        raise error
    if writes:
        index = {"metadata": {"total_size": sum(nbytes(m) for m in final.values())},
                 "weight_map": weight_map}
        data = json.dumps(index, indent=2, sort_keys=True).encode()
        on_written(backend.write_bytes(join(directory, INDEX_NAME), data))


def _read_header(backend: ReadableStore, path: str) -> dict:
    """The JSON header of a safetensors file: 8 bytes of length, then the header."""
    where = backend.display(path)
    with backend.open_read(path) as stream:
        head = stream.read(8)
        size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < size <= _MAX_HEADER:
            raise CorruptCheckpointError(f"{where} is not a safetensors file (bad header length)")
        try:
            header = json.loads(stream.read(size).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptCheckpointError(f"{where}: safetensors header is not JSON ({exc})"
                                         ) from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{where}: safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    return header


def _entry_meta(where: str, name: str, entry: object) -> TensorMeta:
    """The shape and dtype a header entry declares, once it is what safetensors writes:
    {"dtype": known, "shape": [ints >= 0], "data_offsets": [begin, end]} with end - begin
    the tensor's bytes. Anything else is CorruptCheckpointError naming the file and tensor
    (a damaged header once escaped as AttributeError, KeyError or TypeError)."""
    if not isinstance(entry, dict):
        raise CorruptCheckpointError(f"{where}: tensor {name!r} has a header entry that is "
                                     "not a JSON object; the file is damaged")
    dtype_name = entry.get("dtype")
    dtype = _DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise CorruptCheckpointError(f"{where}: tensor {name!r} has unsupported dtype "
                                     f"{entry.get('dtype')!r}")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")

    def counts(value: object, length: int | None) -> bool:
        return isinstance(value, list) and (length is None or len(value) == length) and all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63 for v in value)

    if not counts(shape, None) or not counts(offsets, 2):
        raise CorruptCheckpointError(f"{where}: tensor {name!r} has a malformed shape or "
                                     "data_offsets in the header; the file is damaged")
    meta = TensorMeta(tuple(shape), dtype)  # type: ignore[arg-type]
    begin, end = offsets  # type: ignore[misc]
    if end - begin != nbytes(meta):
        raise CorruptCheckpointError(
            f"{where}: tensor {name!r} is {list(shape)} {entry['dtype']} "  # type: ignore[arg-type]
            f"({nbytes(meta)} bytes) but its header gives it {end - begin} bytes; the file "
            "is damaged"
        )
    return meta


class SafetensorsDirectory:
    """The safetensors files of one directory (one file, or shards with an index).

    Reading the headers is cheap; tensors are read one file at a time.
    """

    def __init__(self, backend: ReadableStore, directory: str) -> None:
        self.backend = backend
        self.directory = directory
        self.metas: dict[str, TensorMeta] = {}
        self.file_of: dict[str, str] = {}
        for file in self._files():
            for name, entry in _read_header(backend, join(directory, file)).items():
                if name in self.file_of:
                    raise CorruptCheckpointError(
                        f"{backend.display(directory)}: tensor {name!r} is in both "
                        f"{self.file_of[name]} and {file}"
                    )
                self.metas[name] = _entry_meta(backend.display(join(directory, file)), name,
                                               entry)
                self.file_of[name] = file

    def _files(self) -> list[str]:
        names = self.backend.list_dir(self.directory)
        if INDEX_NAME in names:
            where = self.backend.display(join(self.directory, INDEX_NAME))
            try:
                index = json.loads(self.backend.read_bytes(
                    join(self.directory, INDEX_NAME)).decode("utf-8"))
                files = sorted(set(index["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise CorruptCheckpointError(f"{where} is not a safetensors index ({exc})"
                                             ) from None
            missing = [f for f in files if f not in names]
            if missing:
                raise CorruptCheckpointError(f"{where} names missing files: {missing[:5]}")
            return files
        # transformers' single file wins over other files beside it (adapters, originals).
        files = ([SINGLE_NAME] if SINGLE_NAME in names
                 else sorted(n for n in names if n.endswith(SUFFIX)))
        if not files:
            raise CheckpointNotFoundError(
                f"{self.backend.display(self.directory)} holds no .safetensors file"
            )
        return files

    def _files_holding(self, names: list[str]) -> dict[str, list[str]]:
        by_file: dict[str, list[str]] = {}
        for name in names:
            by_file.setdefault(self.file_of[name], []).append(name)
        return by_file

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Full CPU tensors of `names`."""
        found: dict[str, torch.Tensor] = {}
        for file, wanted in self._files_holding(names).items():
            loaded = self._load_file(file)
            found.update({n: loaded[n] for n in wanted})
        return found

    def load_into(self, targets: dict[str, torch.Tensor]) -> None:
        """Copy every target's tensor in (each rank its own shard of a DTensor), file by file."""
        for file, wanted in self._files_holding(list(targets)).items():
            loaded = self._load_file(file)
            for name in wanted:
                copy_full_into(targets[name], loaded[name])

    def _load_file(self, file: str) -> dict[str, torch.Tensor]:
        path = join(self.directory, file)
        try:
            return safetensors.torch.load(self.backend.read_bytes(path))
        except safetensors.SafetensorError as exc:
            raise CorruptCheckpointError(f"{self.backend.display(path)}: {exc}") from None
