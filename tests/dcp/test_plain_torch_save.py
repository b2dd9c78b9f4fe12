"""$STATEREG_PLAIN_TORCH_SAVE=1 bypasses statereg's own torch.save record code everywhere:
records written by torch.save, given CRC-32s by torch.load and torch.save, read by torch.load
(docs/compatibility.md, "Forcing plain torch.save"). `plain_torch_save` (tests/conftest.py)
makes that code fail wherever it would still run; the record tests that must hold both ways
run both ways through the `record_code` fixture."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
import xxhash

import statereg
from statereg import env
from statereg.dcp import torchsave
from statereg.dcp.torchsave import crc_stream, layout
from statereg.errors import SpecError

TENSORS = {
    "fp32": lambda: torch.randn(64, 33),
    "bf16 past a slice": lambda: torch.randn(600_000).bfloat16(),
    "empty": lambda: torch.zeros(0, 7, dtype=torch.int64),
    "bool": lambda: torch.rand(17) > 0.5,
}


def torch_save_bytes(tensor: torch.Tensor) -> bytes:
    out = io.BytesIO()
    torch.save(tensor, out)
    return out.getvalue()


def without_crcs(tensor: torch.Tensor) -> bytes:
    out = io.BytesIO()
    crc_stream.save_without_crcs(tensor, out)
    return out.getvalue()


@pytest.mark.parametrize("crcs_wanted", [True, False], ids=["CRC-32s", "memory"])
@pytest.mark.parametrize("name", list(TENSORS))
def test_the_switch_writes_torch_saves_bytes(name, crcs_wanted, plain_torch_save):
    # In memory statereg leaves every CRC-32 zero; under the switch torch.save writes them.
    tensor = TENSORS[name]()
    out = io.BytesIO()
    torchsave.save_record(tensor, out, crcs=crcs_wanted)
    assert out.getvalue() == torch_save_bytes(tensor)


@pytest.mark.parametrize("written", ["without CRC-32s", "with CRC-32s"])
@pytest.mark.parametrize("name", list(TENSORS))
def test_the_switch_adds_crcs_with_torch_load_and_torch_save(name, written, plain_torch_save):
    tensor = TENSORS[name]()
    record = torch_save_bytes(tensor) if written == "with CRC-32s" else without_crcs(tensor)
    out, hasher = io.BytesIO(), xxhash.xxh3_64()
    torchsave.add_crcs(io.BytesIO(b"lead" + record), 4, len(record), out, hasher)
    assert out.getvalue() == torch_save_bytes(tensor)
    assert hasher.intdigest() == xxhash.xxh3_64_intdigest(record)  # every byte, in order


def test_the_switch_adds_crcs_only_to_what_torch_load_reads(plain_torch_save):
    record = bytearray(torch_save_bytes(torch.randn(10)))
    record[-22:-18] = b"PK\x00\x00"  # no end of central directory
    with pytest.raises(torchsave.RecordError, match=r"a record torch\.load reads"):
        torchsave.add_crcs(io.BytesIO(bytes(record)), 0, len(record), io.BytesIO(),
                           xxhash.xxh3_64())


def test_the_switch_reads_every_record_with_torch_load(plain_torch_save):
    tensor = torch.randn(300)
    record = torch_save_bytes(tensor)
    target = torch.zeros(300)
    assert not torchsave.read_into(io.BytesIO(record), 0, len(record), target)
    assert not torchsave.frames(record[:1000], record[1000 + tensor.nbytes:], target)
    loaded = torchsave.load(io.BytesIO(record), 0, len(record), "record")
    assert torch.equal(loaded, tensor)


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 64), torch.nn.Linear(64, 8)).bfloat16()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 48).bfloat16()).float().sum().backward()
    optimizer.step()
    return model, optimizer


def spec(root: Path) -> dict[str, object]:
    return {"storage": {"url": str(root)},
            "components": {"model": {"kind": "model"}, "optimizer": {"kind": "optimizer"}}}


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, bytes]:
    found = {f"model.{k}": v for k, v in model.state_dict().items()}
    for index, state in optimizer.state_dict()["state"].items():
        found.update({f"optimizer.{index}.{k}": v for k, v in state.items()})
    return {k: v.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            for k, v in found.items()}


def test_checkpoints_written_either_way_are_the_same_bytes_and_load_bit_identically(
        tmp_path, monkeypatch):
    model, optimizer = trained()
    written = {}
    for switch in ("0", "1"):
        monkeypatch.setenv(env.PLAIN_TORCH_SAVE, switch)
        monkeypatch.setattr(layout, "_plain", None)  # the switch is read once per process
        root = tmp_path / f"switch-{switch}"
        written[switch] = statereg.CheckpointManager(spec(root), model=model,
                                                     optimizer=optimizer).save(step=1)
    files = {switch: {p.relative_to(path): p.read_bytes() for p in Path(path).rglob("*.distcp")}
             for switch, path in written.items()}
    assert files["0"] and files["0"] == files["1"]  # torch.save's bytes, both ways
    expected = state_bytes(model, optimizer)
    for switch, path in written.items():
        for reading in ("0", "1"):
            monkeypatch.setenv(env.PLAIN_TORCH_SAVE, reading)
            monkeypatch.setattr(layout, "_plain", None)
            other, other_optimizer = trained()
            for param in other.parameters():
                param.data.fill_(7)
            statereg.CheckpointManager(spec(Path(path).parent), model=other,
                                       optimizer=other_optimizer).load(path, verify="full")
            assert state_bytes(other, other_optimizer) == expected, (switch, reading)


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("Yes", True), ("on", True),
                                       ("", False), ("0", False), ("false", False),
                                       ("off", False)])
def test_the_switch_reads_on_and_off(monkeypatch, value, on):
    monkeypatch.setenv(env.PLAIN_TORCH_SAVE, value)
    assert env.plain_torch_save() is on


def test_a_switch_that_is_neither_on_nor_off_is_a_spec_error_naming_it(monkeypatch):
    monkeypatch.setenv(env.PLAIN_TORCH_SAVE, "sometimes")
    monkeypatch.setattr(layout, "_plain", None)
    with pytest.raises(SpecError, match=r"\$STATEREG_PLAIN_TORCH_SAVE is 'sometimes'; set it"):
        torchsave.save_record(torch.randn(3), io.BytesIO())
