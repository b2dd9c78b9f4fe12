"""storage.compression: smaller files, bit-exact loads, plain-DCP readability, bounded decoding."""

from __future__ import annotations

import io
import json
import pickle
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
import zstandard
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader

import statereg
from statereg.dcp import codec, torchsave
from statereg.dcp.metadata import load_dcp_metadata
from statereg.dcp.torch_private import storage_info


class Mixed(nn.Module):
    """Parameters and buffers of every dtype family the codec treats differently."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.bf16 = nn.Parameter(torch.randn(256, 64, generator=gen).mul(0.02).bfloat16())
        self.fp32 = nn.Parameter(torch.randn(128, 64, generator=gen).mul(0.02))
        self.fp16 = nn.Parameter(torch.randn(33, generator=gen).half())  # odd byte count
        self.register_buffer("steps", torch.arange(1000, dtype=torch.int64))
        self.register_buffer("mask", torch.rand(77, generator=gen) > 0.5)
        self.register_buffer("zeros", torch.zeros(4096))
        self.register_buffer("scalar", torch.tensor(3.5, dtype=torch.float64))


def trained() -> tuple[Mixed, torch.optim.Optimizer]:
    model = Mixed()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    (model.bf16.float().sum() + model.fp32.square().sum() + model.fp16.float().sum()).backward()
    opt.step()
    return model, opt


def spec_for(url: str, compression: object = None) -> dict[str, object]:
    storage: dict[str, object] = {"url": url}
    if compression is not None:
        storage["compression"] = compression
    return {"storage": storage,
            "components": {"model": {"kind": "model"}, "optimizer": {"kind": "optimizer"}}}


def stored_bytes(url: str) -> int:
    return sum(p.stat().st_size for p in Path(url).rglob("*") if p.is_file())


def assert_same_state(model: nn.Module, opt: torch.optim.Optimizer, other: nn.Module,
                      other_opt: torch.optim.Optimizer) -> None:
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    mine, theirs = opt.state_dict()["state"], other_opt.state_dict()["state"]
    for param, entries in mine.items():
        for key, value in entries.items():
            assert torch.equal(value, theirs[param][key]), (param, key)


@pytest.mark.parametrize("compression", ["zstd", {"codec": "zstd", "float_aware": False},
                                         {"codec": "zstd", "level": 19, "threads": 2}])
def test_compressed_checkpoints_are_smaller_and_load_bit_exact(tmp_path, compression,
                                                               record_code):
    model, opt = trained()
    plain = statereg.CheckpointManager(spec_for(str(tmp_path / "plain")), model=model,
                                       optimizer=opt).save(step=1)
    packed = statereg.CheckpointManager(spec_for(str(tmp_path / "packed"), compression),
                                        model=model, optimizer=opt).save(step=1)

    # The reader's declaration says nothing about compression: the checkpoint does.
    other = Mixed()
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    for param in other.parameters():
        param.data.fill_(7)
    statereg.CheckpointManager(spec_for(str(tmp_path / "packed")), model=other,
                               optimizer=other_opt).load(packed, verify="full")

    assert_same_state(model, opt, other, other_opt)
    assert stored_bytes(packed) < 0.8 * stored_bytes(plain)
    manifest = json.loads((Path(packed) / "manifest.json").read_text())
    expected = "zstd+planes" if compression == "zstd" or compression.get(
        "float_aware", True) else "zstd"
    codecs = {f["path"]: f["codec"] for f in manifest["files"]}
    assert {c for p, c in codecs.items() if p.endswith(".distcp")} == {expected}
    assert {c for p, c in codecs.items() if not p.endswith(".distcp")} == {"none"}


def encoded(encode: Callable[..., None], *args: object, **kwargs: object) -> bytes:
    """What an encoder writes, copied chunk by chunk (its plane buffers are reused)."""
    chunks: list[bytes] = []
    encode(*args, write=lambda chunk: chunks.append(bytes(chunk)), **kwargs)
    return b"".join(chunks)


def test_float_planes_beat_plain_zstd_on_weights():
    weights = torch.randn(1 << 20).mul(0.02)
    settings = codec.CompressionSettings()
    for tensor, elem in ((weights.bfloat16(), 2), (weights, 4)):
        raw = memoryview(tensor.view(torch.uint8).numpy())
        planes = encoded(codec.encode_planes, raw, elem, True, settings)
        assert codec.decode_planes(planes, len(raw), "w") == raw.tobytes()
        zstd = encoded(codec.encode_zstd_parts, b"", raw, b"", settings)
        assert len(planes) < 0.93 * len(zstd)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("numel", [0, 1, 7, (1 << 17) + 1, 3 << 18, (1 << 20) + 3])
@pytest.mark.parametrize("spread", ["narrow", "wide"])
def test_float_planes_round_trip_any_length_with_prefix_and_suffix(dtype, numel, spread):
    gen = torch.Generator().manual_seed(numel)
    tensor = torch.randn(numel, generator=gen).mul(0.02)
    if spread == "wide":  # exponents everywhere: the 4-bit exponent codes do not pay
        tensor *= torch.logspace(-30, 30, numel)
    tensor = tensor.to(dtype)
    raw = memoryview(tensor.view(torch.uint8).numpy()).cast("B")
    elem, rotate = codec.float_layout(dtype)
    prefix, suffix = b"PK-head" * 9, b"tail" * 5
    blob = encoded(codec.encode_planes, raw, elem, rotate, codec.CompressionSettings(),
                   prefix=prefix, suffix=suffix)
    assert codec.decode_planes(blob, 1 << 40, "x") == prefix + raw.tobytes() + suffix


def _format_inputs() -> dict[str, torch.Tensor]:
    """Deterministic tensors of every planed dtype, past one block, from integer arithmetic
    alone (no RNG whose stream a library update could change): random-looking values (raw
    mantissa planes), exponents spread over 60 octaves (escapes, or no 4-bit codes at all),
    and a regular ramp (planes zstd shrinks)."""
    i = np.arange((1 << 20) + 5, dtype=np.uint64)
    z = i * np.uint64(0x9E3779B97F4A7C15)  # splitmix64
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    h = (z ^ (z >> np.uint64(31))) >> np.uint64(40)
    u = h.astype(np.float64) / (1 << 24) - 0.5
    steps = (((i * np.uint64(0x9E3779B1)) >> np.uint64(7)) & np.uint64(0xFFFFFF))
    bases = {"narrow": u * 0.04,
             "wide": u * np.exp2((h % np.uint64(60)).astype(np.float64) - 30),
             "regular": (steps.astype(np.float64) / (1 << 24) - 0.5) * 0.04}
    return {f"{name}-{str(dtype)[6:]}": torch.from_numpy(base).to(dtype)
            for name, base in bases.items()
            for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}


# xxh3-64 of each encoding as statereg 0.1 wrote statereg.planes/2: a faster encoder must
# write the same bytes, or it is a new format (a new descriptor) that older readers refuse.
PLANES_V2_DIGESTS = {
    "narrow-float32": "a597e3a078cdea95",  # 4194324 -> 3327014
    "narrow-bfloat16": "e3d8b52b8c1bf627",  # 2097162 -> 1360029
    "narrow-float16": "ce2b9376ec67f250",  # 2097162 -> 1712630
    "narrow-float64": "a67ee80387070b68",  # 8388648 -> 5575909
    "wide-float32": "0f48945fc6ac4a72",  # 4194324 -> 3764873
    "wide-bfloat16": "9e21c3d667b576bb",  # 2097162 -> 1833620
    "wide-float16": "b161695b16a2255b",  # 2097162 -> 1629770
    "wide-float64": "97e7aedc3f635afe",  # 8388648 -> 3810104
    "regular-float32": "d2162a50d229239b",  # 4194324 -> 416693
    "regular-bfloat16": "d3d3dbeb0ee6a927",  # 2097162 -> 27051
    "regular-float16": "a22b09dcd8db495b",  # 2097162 -> 81951
    "regular-float64": "702572a00be22763",  # 8388648 -> 1562857
}


@pytest.mark.parametrize("little_endian", [True, False], ids=["little-endian", "big-endian"])
@pytest.mark.parametrize("name", sorted(PLANES_V2_DIGESTS))
def test_float_planes_version_2_bytes_do_not_change(name, little_endian, monkeypatch):
    # A big-endian host takes high bytes by shifting, not by reading words one byte on; it
    # must write the same bytes.
    monkeypatch.setattr(codec, "_LITTLE_ENDIAN", little_endian)
    tensor = _format_inputs()[name]
    raw = memoryview(tensor.view(torch.uint8).numpy()).cast("B")
    elem, rotate = codec.float_layout(tensor.dtype)
    blob = encoded(codec.encode_planes, raw, elem, rotate, codec.CompressionSettings(),
                   prefix=b"PPP", suffix=b"SS")
    assert codec.decode_planes(blob, 1 << 40, "x") == b"PPP" + raw.tobytes() + b"SS"
    assert xxhash.xxh3_64_hexdigest(blob) == PLANES_V2_DIGESTS[name]


def test_float_planes_version_1_still_decodes():
    # statereg.planes/1 of 4 fp32 values (1.0, -2.0, 0.5, 3.0), as statereg 0.1 wrote it.
    v1 = bytes.fromhex(
        "5352503104011000000000000000cf45bf90347721d1000400000000000000000400000000000000"
        "0004000000000000000004000000000000000001000000000000000000807f807e80")
    out = codec.decode_planes(v1, 1 << 20, "x")
    assert torch.frombuffer(out, dtype=torch.float32).tolist() == [1.0, -2.0, 0.5, 3.0]


def test_plain_dcp_loads_a_zstd_checkpoint_without_statereg(tmp_path):
    model, opt = trained()
    url = statereg.CheckpointManager(
        spec_for(str(tmp_path / "ck"), {"codec": "zstd", "float_aware": False}),
        model=model, optimizer=opt).save(step=1)
    torch.save(model.state_dict(), tmp_path / "expected.pt")
    script = textwrap.dedent(f"""
        import sys, torch, torch.distributed.checkpoint as dcp
        expected = torch.load({str(tmp_path / "expected.pt")!r})
        state = {{k: torch.zeros_like(v) for k, v in expected.items()}}
        dcp.load(state, checkpoint_id={url + "/model"!r}, no_dist=True)
        assert "statereg" not in sys.modules
        assert all(torch.equal(state[k], v) for k, v in expected.items())
        print("plain DCP read", len(state), "tensors")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "plain DCP read 7 tensors" in done.stdout


def test_plain_dcp_loads_float_planes_with_statereg_registry(tmp_path):
    model, opt = trained()
    url = statereg.CheckpointManager(spec_for(str(tmp_path / "ck"), "zstd"), model=model,
                                     optimizer=opt).save(step=1)
    state = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    reader = FileSystemReader(f"{url}/model", _extension_registry=codec.extension_registry())
    dcp.load(state, storage_reader=reader, no_dist=True)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def save_one_tensor(tmp_path: Path, compression: object) -> tuple[str, Path]:
    """A checkpoint whose model is one fp32 tensor; returns its URL and its data file."""
    model = nn.Linear(64, 64, bias=False)
    url = statereg.CheckpointManager(
        {"storage": {"url": str(tmp_path / "ck"), "compression": compression},
         "components": {"model": {"kind": "model"}}}, model=model).save(step=1)
    data = max((Path(url) / "model").glob("*.distcp"), key=lambda f: f.stat().st_size)
    return url, data


def load_one_tensor(url: str) -> nn.Linear:
    model = nn.Linear(64, 64, bias=False)
    statereg.CheckpointManager({"storage": {"url": str(Path(url).parent)},
                                "components": {"model": {"kind": "model"}}},
                               model=model).load(url, verify="off")
    return model


@pytest.mark.parametrize("compression", ["zstd", {"codec": "zstd", "float_aware": False}])
def test_a_damaged_compressed_item_is_named_not_a_zstd_trace(tmp_path, compression):
    url, data = save_one_tensor(tmp_path, compression)
    blob = bytearray(data.read_bytes())
    for offset in range(40, len(blob), 97):
        blob[offset] ^= 0x5A
    data.write_bytes(bytes(blob))

    with pytest.raises(statereg.CorruptCheckpointError) as caught:
        load_one_tensor(url)  # verify="off": the codec's own checks must catch it
    assert str(data) in str(caught.value) and "'weight'" in str(caught.value)


@pytest.mark.parametrize("content_size", [True, False])
def test_a_decompression_bomb_stops_at_the_item_size(tmp_path, content_size):
    url, data = save_one_tensor(tmp_path, {"codec": "zstd", "float_aware": False})
    # Whoever can write the checkpoint can rewrite it consistently: a 64 MiB frame in place of
    # a 16 KiB tensor, with DCP's metadata pointing at it and verification off.
    bomb = zstandard.ZstdCompressor(write_content_size=content_size).compress(
        bytes(64 << 20))
    data.write_bytes(bomb)
    meta_path = data.parent / ".metadata"
    metadata = load_dcp_metadata(meta_path.read_bytes(), str(meta_path))
    for index, info in metadata.storage_data.items():
        metadata.storage_data[index] = storage_info(info.relative_path, 0, len(bomb),
                                                    info.transform_descriptors)
    meta_path.write_bytes(pickle.dumps(metadata))

    with pytest.raises(statereg.CorruptCheckpointError, match=r"refusing to inflate|inflates past"):
        load_one_tensor(url)


def planes_record(tensor: torch.Tensor) -> bytes:
    """`tensor`'s torch.save record, float-aware encoded as the writer encodes an item."""
    record = io.BytesIO()
    torch.save(tensor, record)
    raw = tensor.view(torch.uint8).numpy().tobytes()
    at = record.getvalue().find(raw)
    prefix, suffix = record.getvalue()[:at], record.getvalue()[at + len(raw):]
    elem, rotate = codec.float_layout(tensor.dtype)
    return encoded(codec.encode_planes, memoryview(raw), elem, rotate,
                   codec.CompressionSettings(), prefix=prefix, suffix=suffix)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_a_planes_item_decodes_straight_into_its_tensor(dtype):
    tensor = torch.randn(300, 700, generator=torch.Generator().manual_seed(1)).to(dtype)
    blob = planes_record(tensor)
    target = torch.zeros_like(tensor)

    def frames(prefix: bytes, suffix: bytes) -> bool:
        return torchsave.frames(prefix, suffix, target)

    view = torchsave.byte_view(target)
    assert codec.decode_into([codec.PLANES_DESCRIPTOR], blob, view, "item", frames)
    assert torch.equal(target.view(torch.uint8), tensor.view(torch.uint8))


def test_an_item_that_does_not_frame_its_tensor_is_left_to_the_full_decode():
    tensor = torch.randn(256, 256, generator=torch.Generator().manual_seed(2))
    blob = planes_record(tensor)
    for target, descriptors in ((torch.zeros(128, 512), [codec.PLANES_DESCRIPTOR]),  # shape
                                (torch.zeros(65536, dtype=torch.int32),  # dtype
                                 [codec.PLANES_DESCRIPTOR]),
                                (torch.zeros(128, 256), [codec.PLANES_DESCRIPTOR]),  # size
                                (torch.zeros(256, 256), [codec.ZSTD_DESCRIPTOR])):
        assert not codec.decode_into(descriptors, blob, torchsave.byte_view(target), "item",
                                     lambda p, s, t=target: torchsave.frames(p, s, t))
        assert not target.any()  # nothing written
    whole = codec.decode_planes(blob, 1 << 30, "item")
    assert torch.equal(torchsave.load(io.BytesIO(whole), 0, len(whole), "item"), tensor)


def test_a_damaged_planes_item_decoded_in_place_names_the_item():
    tensor = torch.randn(256, 256, generator=torch.Generator().manual_seed(3))
    blob = bytearray(planes_record(tensor))
    blob[len(blob) // 2] ^= 0x10  # inside a raw mantissa plane: only the digest can tell
    target = torch.zeros_like(tensor)
    with pytest.raises(statereg.CorruptCheckpointError,
                       match=r"model/weight: float-aware item is damaged \(its digest"):
        codec.decode_into([codec.PLANES_DESCRIPTOR], bytes(blob), torchsave.byte_view(target),
                          "model/weight", lambda p, s: torchsave.frames(p, s, target))


def test_a_slow_item_holds_up_only_its_own_compressing_writer(tmp_path, monkeypatch):
    """Compressing writers take the next item as they finish one, so the writer beside a slow
    item takes every item left. With each file's items fixed first (equal bytes), the slow
    item's file would also hold items queued behind it, and the save would end with one
    writer encoding alone."""
    big = 1 << 20  # floats: 4 MiB, less than the ten small items together (5 MiB)
    model = nn.ParameterDict({"big": nn.Parameter(torch.randn(big)),
                              **{f"small{i}": nn.Parameter(torch.randn(big // 8))
                                 for i in range(10)}})
    smalls_done = []
    all_small_done = threading.Event()
    encode_planes = codec.encode_planes

    def encode(body: memoryview, *args: object, **kwargs: object) -> None:
        if len(body) == 4 * big:
            all_small_done.wait(timeout=10)  # bounded: a fixed split never sets it
        encode_planes(body, *args, **kwargs)
        if len(body) != 4 * big:
            smalls_done.append(len(body))
            if len(smalls_done) == 10:
                all_small_done.set()

    monkeypatch.setattr(codec, "encode_planes", encode)
    spec = {"storage": {"url": str(tmp_path / "ck"), "compression": "zstd", "io_threads": 2},
            "components": {"model": {"kind": "model"}}}
    url = statereg.CheckpointManager(spec, model=model).save(step=1)

    metadata = next(Path(url).rglob(".metadata"))
    files: dict[str, list[str]] = {}
    for index, info in load_dcp_metadata(metadata.read_bytes(), str(metadata)).storage_data.items():
        files.setdefault(info.relative_path, []).append(index.fqn)
    assert sorted(files) == ["__0_0.distcp", "__0_1.distcp"]
    assert sorted(map(sorted, files.values())) == [["big"], sorted(f"small{i}" for i in range(10))]
    other = nn.ParameterDict({name: nn.Parameter(torch.zeros_like(p)) for name, p in model.items()})
    statereg.CheckpointManager(spec, model=other).load(url)
    for name, param in model.items():
        assert torch.equal(param, other[name]), name


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_compressed_components_are_written_one_at_a_time_on_a_local_disk(tmp_path, monkeypatch,
                                                                         compression):
    """Uncompressed, the model's and the optimizer's files are written at the same time (a
    disk write waits on the disk); compressed, one component after the other: encoding is the
    work, and four encoders on the cores of two would only time-slice them."""
    from statereg.engine.layouts.dcp import DCPLayout

    inside, most, second_in = [0], [0], threading.Event()
    lock = threading.Lock()
    write = DCPLayout.write

    def counted(self: DCPLayout, item: object, ctx: object) -> object:
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            if inside[0] == 2:
                second_in.set()
        second_in.wait(timeout=2)  # a second component at the same time comes in at once
        try:
            return write(self, item, ctx)
        finally:
            with lock:
                inside[0] -= 1

    monkeypatch.setattr(DCPLayout, "write", counted)
    model, opt = trained()
    url = statereg.CheckpointManager(spec_for(str(tmp_path / "ck"), compression), model=model,
                                     optimizer=opt).save(step=1)
    assert most[0] == (1 if compression else 2)
    other = Mixed()
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    statereg.CheckpointManager(spec_for(str(tmp_path / "ck")), model=other,
                               optimizer=other_opt).load(url)
    assert_same_state(model, opt, other, other_opt)


def test_a_compressed_load_decodes_float_tensors_in_place(tmp_path, monkeypatch):
    def made(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 384).bfloat16())
        opt = torch.optim.AdamW(model.parameters())
        for param in model.parameters():
            param.grad = torch.randn_like(param)
        opt.step()
        return model, opt

    model, opt = made(0)
    spec = {"storage": {"url": str(tmp_path / "ck"), "compression": "zstd"},
            "components": {"model": {"kind": "model"}, "optimizer": {"kind": "optimizer"}}}
    url = statereg.CheckpointManager(spec, model=model, optimizer=opt).save(step=1)
    planed = [info for path in Path(url).rglob(".metadata")
              for info in load_dcp_metadata(path.read_bytes(), str(path)).storage_data.values()
              if tuple(info.transform_descriptors) == (codec.PLANES_DESCRIPTOR,)]
    assert len(planed) == 6  # two weights and their two Adam moments each
    whole_decodes: list[int] = []
    decode_planes = codec.decode_planes
    monkeypatch.setattr(codec, "decode_planes", lambda blob, bound, source: (
        whole_decodes.append(len(blob)), decode_planes(blob, bound, source))[1])

    other, other_opt = made(1)
    statereg.CheckpointManager(spec, model=other, optimizer=other_opt).load(url)
    assert_same_state(model, opt, other, other_opt)
    assert whole_decodes == []


def test_a_zstd_load_decodes_tensors_in_place(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 33).half())
    spec = {"storage": {"url": str(tmp_path / "ck"),
                        "compression": {"codec": "zstd", "float_aware": False}},
            "components": {"model": {"kind": "model"}}}
    url = statereg.CheckpointManager(spec, model=model).save(step=1)
    whole: list[str] = []
    decode = codec.decode
    monkeypatch.setattr(codec, "decode", lambda descriptors, blob, bound, source: (
        whole.append(source), decode(descriptors, blob, bound, source))[1])

    other = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 33).half())
    statereg.CheckpointManager(spec, model=other).load(url)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 other.state_dict().values(), strict=True))
    assert whole == []  # every item was a tensor: each went from the frame into its tensor


def frame_of(tensor: torch.Tensor, content_size: bool = True) -> bytes:
    record = io.BytesIO()
    torch.save(tensor, record)
    return zstandard.ZstdCompressor(write_checksum=True, write_content_size=content_size
                                    ).compress(record.getvalue())


def test_a_zstd_frame_streams_into_its_tensor_and_checks_its_end():
    tensor = torch.randn(300, 300, generator=torch.Generator().manual_seed(4))
    frame = frame_of(tensor)
    target = torch.zeros_like(tensor)
    stream = codec.frame_stream(frame, 1 << 30, "item")
    assert stream is not None and torchsave.read_into(stream, 0, stream.size, target)
    stream.finish()
    assert torch.equal(target, tensor)

    for at in (len(frame) // 2, len(frame) - 1):  # a block; the checksum at the frame's end
        damaged = bytearray(frame)
        damaged[at] ^= 0x01
        stream = codec.frame_stream(bytes(damaged), 1 << 30, "model/weight")
        with pytest.raises(statereg.CorruptCheckpointError,
                           match="model/weight: a compressed item"):
            torchsave.read_into(stream, 0, stream.size, torch.zeros_like(tensor))
            stream.finish()


def test_a_zstd_frame_without_a_size_or_over_its_bound_is_decoded_whole():
    tensor = torch.randn(1000)
    assert codec.frame_stream(frame_of(tensor, content_size=False), 1 << 30, "item") is None
    assert codec.frame_stream(frame_of(tensor), 1000, "item") is None  # 4000 B > the bound
    assert codec.frame_stream(b"not a frame", 1 << 30, "item") is None


@pytest.mark.parametrize("lie", [-1, 1])
def test_a_zstd_frame_that_misstates_its_size_is_refused(lie):
    tensor = torch.randn(100, 100)
    frame = bytearray(frame_of(tensor))
    descriptor = frame[4]  # after the magic: the frame header descriptor
    assert descriptor & 0x20 and descriptor >> 6 == 1  # one segment, a 2-byte size - 256
    declared = int.from_bytes(frame[5:7], "little") + lie
    frame[5:7] = declared.to_bytes(2, "little")
    stream = codec.frame_stream(bytes(frame), 1 << 30, "model/weight")
    assert stream is not None and stream.size == declared + 256
    with pytest.raises(statereg.CorruptCheckpointError, match="model/weight: a compressed item"):
        torchsave.read_into(stream, 0, stream.size, torch.zeros_like(tensor))
        stream.finish()


def test_a_zstd_frame_stream_reads_forward_only_past_its_head():
    stream = codec.frame_stream(frame_of(torch.randn(1 << 16)), 1 << 30, "item")
    assert stream.read(100) and stream.seek(10) == 10 and len(stream.read(5)) == 5
    stream.seek(200_000)  # forward: decoded and dropped
    with pytest.raises(io.UnsupportedOperation):
        stream.seek(150_000)


def test_a_planes_header_cannot_claim_more_than_the_item():
    raw = memoryview(torch.randn(1000).numpy().view("uint8"))
    blob = encoded(codec.encode_planes, raw, 4, True, codec.CompressionSettings())
    with pytest.raises(statereg.CorruptCheckpointError, match="declares 4000 bytes, more than"):
        codec.decode_planes(blob, 3999, "item")


@pytest.mark.parametrize(("declared", "codec_name"), [
    ("zstd", "zstd"), ("none", "none"), (False, "none"),
    ({"codec": "zstd", "level": 9, "float_aware": False}, "zstd"),
])
def test_compression_shorthands(declared, codec_name):
    spec = statereg.load_spec({"storage": {"url": "x", "compression": declared},
                               "components": {"model": {"kind": "model"}}}, environ={})
    assert spec.storage.compression.codec == codec_name


def test_a_bad_compression_level_names_the_field():
    with pytest.raises(statereg.SpecError, match=r"storage\.compression\.level"):
        statereg.load_spec({"storage": {"url": "x", "compression": {"codec": "zstd",
                                                                    "level": 40}},
                            "components": {"model": {"kind": "model"}}}, environ={})


def test_the_environment_turns_compression_on(tmp_path):
    spec = statereg.load_spec(spec_for(str(tmp_path)),
                              environ={"STATEREG_STORAGE__COMPRESSION": "zstd"})
    assert spec.storage.compression is not None and spec.storage.compression.codec == "zstd"
