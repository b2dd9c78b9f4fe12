"""What statereg writes survives a torch that changes its private classes, and every fallback
of statereg/dcp/torch_private.py works (docs/compatibility.md names this file)."""

from __future__ import annotations

import dataclasses
import io
import pickle
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

from statereg.backends import FileRecorder, open_backend
from statereg.dcp import codec, torch_private
from statereg.dcp.metadata import load_dcp_metadata
from statereg.dcp.reader import BackendReader, SafeLoadPlanner
from statereg.dcp.torch_private import StorageInfo
from statereg.dcp.writer import BackendWriter

STORAGE_INFO = ("torch.distributed.checkpoint.filesystem", "_StorageInfo")


@dataclasses.dataclass
class ReorderedStorageInfo:
    """_StorageInfo as a future torch might declare it: fields reordered, one added."""

    transform_descriptors: Sequence[str] | None = None
    checksum: str | None = None
    length: int = -1
    relative_path: str = ""
    offset: int = -1


class ReorderingUnpickler(pickle.Unpickler):
    """Plain pickle, except `_StorageInfo` resolves to the reordered class."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == STORAGE_INFO:
            return ReorderedStorageInfo
        return super().find_class(module, name)


class _PositionalInfo:
    """Pickles a _StorageInfo the way statereg 0.1 did: `_StorageInfo(path, offset, length)`."""

    def __init__(self, info: Any) -> None:
        self.info = info

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return StorageInfo, (self.info.relative_path, self.info.offset, self.info.length)


def save_checkpoint(root: Path, compression: codec.CompressionSettings | None) -> Path:
    """A statereg-written DCP directory with tensors of several dtypes and one pickled object."""
    backend = open_backend(str(root))
    state = {"w": torch.randn(300, 64), "b": torch.arange(50, dtype=torch.int64),
             "h": torch.randn(2000).bfloat16(), "extra": {"step": 3, "note": "x"}}
    writer = BackendWriter(backend, "ckpt", FileRecorder(), thread_count=2,
                           compression=compression)
    dcp.save(state, storage_writer=writer, no_dist=True)
    return root / "ckpt"


def fields(info: Any) -> tuple[Any, ...]:
    descriptors = info.transform_descriptors
    return (info.relative_path, info.offset, info.length,
            None if descriptors is None else list(descriptors))


@pytest.mark.parametrize("compression", [None, codec.CompressionSettings(float_aware=True)],
                         ids=["plain", "compressed"])
def test_metadata_unpickles_by_field_name_against_a_reordered_storage_info(tmp_path,
                                                                           compression):
    directory = save_checkpoint(tmp_path, compression)
    data = (directory / ".metadata").read_bytes()
    expected = {index: fields(info)
                for index, info in load_dcp_metadata(data, ".metadata").storage_data.items()}

    reordered = ReorderingUnpickler(io.BytesIO(data)).load()

    assert isinstance(reordered, Metadata)
    assert {index: fields(info) for index, info in reordered.storage_data.items()} == expected
    assert all(type(info) is ReorderedStorageInfo and info.checksum is None
               for info in reordered.storage_data.values())
    if compression is not None:
        assert {tuple(f[3]) for f in expected.values()} == {
            (codec.ZSTD_DESCRIPTOR,), (codec.PLANES_DESCRIPTOR,)}


def test_the_old_positional_pickle_is_what_a_reordering_breaks():
    # statereg 0.1 pickled _StorageInfo as a positional constructor call: against the
    # reordered class its values land in the wrong fields. The test above would catch it.
    info = StorageInfo("__0_0.distcp", 128, 4096)
    old_style = pickle.dumps(_PositionalInfo(info))

    reordered = ReorderingUnpickler(io.BytesIO(old_style)).load()

    assert fields(reordered) != ("__0_0.distcp", 128, 4096, None)
    assert pickle.loads(old_style) == info  # and it still loads against today's class


def test_plain_dcp_reads_the_reordered_fields(tmp_path):
    # End to end: plain dcp.load in a process whose torch declares _StorageInfo reordered.
    directory = save_checkpoint(tmp_path, None)
    script = textwrap.dedent(f"""
        import dataclasses
        from collections.abc import Sequence
        import torch, torch.distributed.checkpoint as dcp
        import torch.distributed.checkpoint.filesystem as fs

        @dataclasses.dataclass
        class _StorageInfo:
            transform_descriptors: Sequence[str] | None = None
            checksum: str | None = None
            length: int = -1
            relative_path: str = ""
            offset: int = -1

        _StorageInfo.__module__ = fs.__name__
        fs._StorageInfo = _StorageInfo
        state = {{"w": torch.zeros(300, 64), "b": torch.zeros(50, dtype=torch.int64),
                  "h": torch.zeros(2000).bfloat16(), "extra": {{"step": 0, "note": ""}}}}
        dcp.load(state, checkpoint_id={str(directory)!r}, no_dist=True)
        print(state["b"].sum().item(), state["extra"])
    """)
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", script], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1225", "{'step':", "3,", "'note':", "'x'}"]


def test_statereg_works_on_a_torch_without_the_extension_registry(tmp_path):
    # torch_private's fallback: hide torch.distributed.checkpoint._extension, then save and
    # load a compressed checkpoint through statereg; only the plain-DCP hand-off refuses.
    script = textwrap.dedent(f"""
        import sys
        import torch, torch.distributed.checkpoint as dcp
        sys.modules["torch.distributed.checkpoint._extension"] = None
        from statereg.backends import FileRecorder, open_backend
        from statereg.dcp import codec, torch_private
        from statereg.dcp.reader import BackendReader, SafeLoadPlanner
        from statereg.dcp.writer import BackendWriter
        from statereg.errors import StateregError
        assert not torch_private.EXTENSIONS_AVAILABLE
        backend = open_backend({str(tmp_path)!r})
        state = {{"w": torch.randn(256, 256), "i": torch.arange(9)}}
        writer = BackendWriter(backend, "ckpt", FileRecorder(),
                               compression=codec.CompressionSettings(float_aware=True))
        dcp.save(state, storage_writer=writer, no_dist=True)
        back = {{"w": torch.zeros(256, 256), "i": torch.zeros(9, dtype=torch.int64)}}
        dcp.load(back, storage_reader=BackendReader(backend, "ckpt"),
                 planner=SafeLoadPlanner(), no_dist=True)
        assert torch.equal(back["w"], state["w"]) and torch.equal(back["i"], state["i"])
        try:
            codec.extension_registry()
        except StateregError as exc:
            print("refused:", exc)
    """)
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", script], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("refused: torch ")
    assert "has no torch.distributed.checkpoint._extension" in done.stdout
    assert "load the checkpoint with statereg" in done.stdout


def test_own_narrow_and_set_element_agree_with_the_private_torch_ones_they_replace():
    # statereg no longer imports these; while this torch still has them, ours must agree.
    shard_utils = pytest.importorskip("torch.distributed._shard._utils")
    traverse = pytest.importorskip("torch.distributed.checkpoint._traverse")
    from statereg.dcp.reader import _narrow, _set_element

    tensor = torch.arange(60.).reshape(5, 12)
    for offsets, lengths in [((0, 0), (5, 12)), ((1, 3), (2, 4)), ((4, 0), (1, 12))]:
        assert torch.equal(_narrow(tensor, offsets, lengths),
                           shard_utils.narrow_tensor_by_index(tensor, offsets, lengths))
    for path in [("a",), ("a", "b", "c"), ("opt", "param_groups", 2, "lr"), ("l", 0), ("l", 3)]:
        ours: dict[str, Any] = {"a": {"x": 1}}
        theirs: dict[str, Any] = {"a": {"x": 1}}
        _set_element(ours, path, 7)
        traverse.set_element(theirs, path, 7)
        assert ours == theirs


@pytest.mark.parametrize("private", [True, False], ids=["private", "public fallback"])
def test_dcp_load_fills_tensors_and_objects_with_or_without_the_private_loader(
        tmp_path, monkeypatch, private):
    if not private:
        monkeypatch.setattr(torch_private, "_load_state_dict", None)
    backend = open_backend(str(tmp_path))
    state = {"w": torch.randn(64, 64), "n": torch.nn.Parameter(torch.randn(3)),
             "note": "step 3"}
    dcp.save(state, storage_writer=BackendWriter(backend, "ckpt", FileRecorder()), no_dist=True)
    back = {"w": torch.zeros(64, 64), "n": torch.nn.Parameter(torch.zeros(3)), "note": ""}
    torch_private.dcp_load(back, storage_reader=BackendReader(backend, "ckpt"),
                           planner=SafeLoadPlanner(), no_dist=True)
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["n"], state["n"])
    assert back["note"] == "step 3"


def test_dcp_load_hands_a_stateful_value_to_public_dcp_load(tmp_path, monkeypatch):
    # dcp.load calls state_dict() and load_state_dict() of a Stateful value; the private
    # loader would not, so dcp_load must take the public path for one.
    class Holder:
        def __init__(self, value: torch.Tensor) -> None:
            self.value, self.loaded = value, None

        def state_dict(self) -> dict:
            return {"v": self.value}

        def load_state_dict(self, state: dict) -> None:
            self.loaded = state["v"].clone()

    def no_private(**kwargs: object) -> None:
        raise AssertionError("a Stateful value went to the private loader")

    backend = open_backend(str(tmp_path))
    saved = torch.randn(5)
    dcp.save({"h": {"v": saved}}, storage_writer=BackendWriter(backend, "ckpt", FileRecorder()),
             no_dist=True)
    monkeypatch.setattr(torch_private, "_load_state_dict", no_private)
    holder = Holder(torch.zeros(5))
    torch_private.dcp_load({"h": holder}, storage_reader=BackendReader(backend, "ckpt"),
                           planner=SafeLoadPlanner(), no_dist=True)
    assert torch.equal(holder.loaded, saved)
