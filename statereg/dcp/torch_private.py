"""The private torch names statereg uses, each with what happens on a torch without it.

torch promises nothing about underscored names, so every one statereg's backends import comes
from here and nowhere else: a torch release that moves one breaks this module, in one place,
with a message that says what to install, instead of a traceback deep inside a save.
docs/compatibility.md has the same list, the torch versions CI tests, and the private uses
statereg has replaced with its own code (per-file writes, file views, tensor narrowing,
nested-dict assignment, element sizes, the in-place DCP load).

`StorageInfo` (`torch.distributed.checkpoint.filesystem._StorageInfo`)
    What: DCP's record of where one item lies: file, offset, length, stream transforms.
    Why: `.metadata` stores one per item, so plain `dcp.load` and DCP's FileSystemReader can
    read a statereg checkpoint; statereg writes them and reads their fields back.
    Fallback: none can exist, since its pickled name is part of the format DCP reads: without
    it, importing statereg's DCP glue fails with an ImportError naming what to install. A
    torch that reorders the fields, or adds one with a default, reads every statereg
    checkpoint: statereg builds them by field name (`storage_info`) and pickles them the way
    DCP does, fields by name (tests/compat/test_torch_private.py).

`StreamTransformExtension`, `ExtensionRegistry` (`torch.distributed.checkpoint._extension`)
    What: DCP's (experimental) registry of stream transforms, which decodes `stream.zstd/1`
    items in plain `dcp.load`.
    Why: `codec.FloatPlanes` registers statereg's float-aware decoder there, so a plain DCP
    reader can load a float-aware compressed checkpoint.
    Fallback: statereg's own reader decodes every descriptor itself and never needs the
    registry, so saves and loads through statereg work unchanged; `FloatPlanes` derives from
    a stand-in base with the same interface and `codec.extension_registry()`, the hand-off to
    plain DCP readers, raises a StateregError that says why (`EXTENSIONS_AVAILABLE` is False).
    tests/compat/test_torch_private.py runs statereg with that module hidden.

`_load_state_dict` (`torch.distributed.checkpoint.state_dict_loader`)
    What: what `dcp.load` runs after asking every value of the state dict whether it is
    `Stateful` (a runtime Protocol check: ~11 us a tensor, 13 ms a load of 600 tensors).
    Why: statereg's load targets are tensors and plain objects, so `dcp_load` asks only the
    values that are not plain tensors and, when none is `Stateful`, calls this directly.
    Fallback: the public `dcp.load`, the same load a little slower (tests/compat).

`PyTorchFileWriter` (`torch._C`), `_save`, `_get_storage_alignment` (`torch.serialization`)
    What: torch.save's zip writer, opened with its CRC-32 turned off for one call (the public
    switch, `set_crc32_options`, is process-wide: another thread's torch.save would lose its
    CRCs), and the function torch.save runs inside it.
    Why: torchsave/crc_stream.py computes the CRC-32s itself, several times faster, and
    writes torch.save's exact bytes (benchmarks/results/journal.md, "CRC-32s at the speed of
    the copy").
    Fallback: torchsave/crc_stream.py checks once per process that its bytes equal
    torch.save's; without these names, or if they differ, it warns once and every record is
    written by torch.save as before.
"""

from __future__ import annotations

import abc
import io
from collections.abc import Sequence
from typing import IO, Any

import torch

try:
    from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo
except ImportError as exc:  # only on a torch statereg does not support; see the docstring
    raise ImportError(
        "statereg needs torch.distributed.checkpoint.filesystem._StorageInfo, which torch "
        f"{torch.__version__} does not have: install a torch release that docs/compatibility.md "
        "lists as tested"
    ) from exc

try:
    from torch.distributed.checkpoint._extension import (
        ExtensionRegistry,
        StreamTransformExtension,
    )

    EXTENSIONS_AVAILABLE = True
except ImportError:  # see the docstring: statereg's reader needs no registry
    EXTENSIONS_AVAILABLE = False
    ExtensionRegistry = None  # type: ignore[misc,assignment]  # torch without `_extension`

    class StreamTransformExtension(abc.ABC):  # type: ignore[no-redef]
        """Stand-in with the interface of DCP's base, for a torch without `_extension`."""

        @staticmethod
        @abc.abstractmethod
        def registry_name() -> str:
            """The descriptor's name part."""

        @staticmethod
        @abc.abstractmethod
        def from_descriptor(version: str) -> StreamTransformExtension:
            """The extension for one descriptor version."""

        @abc.abstractmethod
        def get_descriptor(self) -> str:
            """`name/version`, as stored in `.metadata`."""

        @abc.abstractmethod
        def transform_to(self, output: IO[bytes]) -> IO[bytes]:
            """The encoding stream."""

        @abc.abstractmethod
        def transform_from(self, input: IO[bytes]) -> IO[bytes]:
            """The decoding stream."""

try:
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
except ImportError:  # see the docstring: the public dcp.load is used instead
    _load_state_dict = None  # type: ignore[assignment]  # torch without it: None, checked

try:
    from torch._C import PyTorchFileWriter
    from torch.serialization import DEFAULT_PROTOCOL, _get_storage_alignment
    from torch.serialization import _save as _save_into_zip

    ZIP_WRITER_AVAILABLE = True
except ImportError:  # see the docstring: torch.save, with torch's own CRCs, is used instead
    ZIP_WRITER_AVAILABLE = False


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def dcp_load(state_dict: dict[str, Any], *, storage_reader: Any, planner: Any,
             process_group: Any = None, no_dist: bool = False) -> None:
    """`dcp.load`, without its `Stateful` check of values that are plain tensors."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.stateful import Stateful

    if _load_state_dict is None or any(type(value) not in _PLAIN_TENSORS
                                       and isinstance(value, Stateful)
                                       for value in state_dict.values()):
        dcp.load(state_dict, storage_reader=storage_reader, planner=planner,
                 process_group=process_group, no_dist=no_dist)
        return
    _load_state_dict(state_dict=state_dict, storage_reader=storage_reader,
                     process_group=process_group, planner=planner,
                     no_dist=no_dist or not dist.is_available() or not dist.is_initialized())


def zip_writer_without_crc(buffer: IO[bytes] | io.RawIOBase) -> Any:
    """torch's zip writer into `buffer`, computing no CRC-32 (torchsave/crc_stream.py does)."""
    # torch's stub says IO[bytes]; the writer takes any object with write():
    return PyTorchFileWriter(buffer, False, _get_storage_alignment())  # type: ignore[arg-type]


def storage_alignment() -> int:
    """The alignment torch.save pads each storage's bytes to (a runtime setting)."""
    return _get_storage_alignment()


def save_into_zip(obj: Any, writer: Any, pickle_module: Any) -> None:
    """What torch.save does between opening its zip writer and ending it."""
    _save_into_zip(obj, writer, pickle_module, DEFAULT_PROTOCOL, False)


def storage_info(relative_path: str, offset: int, length: int,
                 transform_descriptors: Sequence[str] | None = None) -> Any:
    """A StorageInfo built by field name, right on a torch that reorders its fields."""
    return StorageInfo(relative_path=relative_path, offset=offset, length=length,
                       transform_descriptors=transform_descriptors)


__all__ = ["EXTENSIONS_AVAILABLE", "ZIP_WRITER_AVAILABLE", "ExtensionRegistry", "StorageInfo",
           "StreamTransformExtension", "dcp_load", "save_into_zip", "storage_alignment",
           "storage_info", "zip_writer_without_crc"]
