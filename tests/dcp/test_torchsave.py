"""Reading a tensor's bytes in place from a torch.save record, and declining what is not plain."""

from __future__ import annotations

import io
import pickle
import shutil
import subprocess
import zipfile

import pytest
import torch
import xxhash

from statereg.dcp import torchsave
from statereg.dcp.torchsave import read
from statereg.process_state import BytesBounded


def record(tensor: torch.Tensor, lead: bytes = b"lead") -> tuple[io.BytesIO, int, int]:
    """A stream holding `lead` then torch.save(tensor): (stream, offset, length)."""
    stream = io.BytesIO()
    stream.write(lead)
    torch.save(tensor, stream)
    return stream, len(lead), stream.tell() - len(lead)


@pytest.mark.parametrize("tensor", [
    torch.randn(64, 33), torch.randn(1000).bfloat16(), torch.tensor(2.5, dtype=torch.float64),
    torch.arange(12, dtype=torch.int64).reshape(3, 4), torch.rand(17) > 0.5,
    torch.randn(3, 5).half(),
], ids=["fp32", "bf16", "scalar", "int64", "bool", "fp16"])
def test_plain_records_are_read_in_place_bit_exact(tensor):
    stream, offset, length = record(tensor)
    target = torch.full_like(tensor, 0)
    assert torchsave.read_into(stream, offset, length, target)
    assert torch.equal(target.view(torch.uint8) if tensor.dtype == torch.bool else target,
                       tensor.view(torch.uint8) if tensor.dtype == torch.bool else tensor)


# Payloads inside the first 4 KiB read, across its end, and far past it.
@pytest.mark.parametrize("numel", [1, 200, 700, 1000, 1100, 1 << 18])
def test_a_read_feeds_the_hasher_every_byte_of_the_record_once(numel):
    tensor = torch.randn(numel)
    stream, offset, length = record(tensor)
    target, hasher = torch.zeros(numel), xxhash.xxh3_64()
    assert torchsave.read_into(stream, offset, length, target, hasher)
    assert torch.equal(target, tensor)
    assert hasher.intdigest() == xxhash.xxh3_64_intdigest(
        stream.getvalue()[offset:offset + length])


@pytest.mark.parametrize("numel", [200, 1 << 18])
def test_a_record_whose_descriptor_disagrees_is_declined(numel):
    stream, offset, length = record(torch.randn(numel))
    data = bytearray(stream.getvalue())
    at = data.index(b"PK\x07\x08", offset + numel * 4)  # the payload's data descriptor
    data[at + 8:at + 12] = (numel * 4 + 4).to_bytes(4, "little")  # its compressed size
    assert not torchsave.read_into(io.BytesIO(bytes(data)), offset, length, torch.zeros(numel))


def test_a_stream_that_ends_inside_a_records_tail_raises_eof():
    # The payload read in full, the record's end missing: EOFError, which the reader reports
    # as a damaged file; never True with a hasher that saw fewer bytes than the record.
    tensor = torch.randn(1 << 16)
    stream, offset, length = record(tensor)
    cut = io.BytesIO(stream.getvalue()[:offset + length - 10])
    with pytest.raises(EOFError):
        torchsave.read_into(cut, offset, length, torch.zeros(1 << 16), xxhash.xxh3_64())


@pytest.mark.parametrize("case", ["transposed", "offset view", "other dtype", "other shape",
                                  "target not contiguous"])
def test_records_that_are_not_the_plain_case_are_declined_untouched(case):
    stored = torch.randn(6, 4)
    target = torch.zeros(6, 4)
    if case == "transposed":
        stored = torch.randn(4, 6).t()
    elif case == "offset view":
        stored = torch.randn(30)[6:30].view(6, 4)
    elif case == "other dtype":
        target = torch.zeros(6, 4, dtype=torch.float64)
    elif case == "other shape":
        target = torch.zeros(4, 6)
    else:
        target = torch.zeros(4, 6).t()
    stream, offset, length = record(stored)
    assert not torchsave.read_into(stream, offset, length, target)
    assert not target.any()


def test_a_record_with_a_foreign_global_is_declined_without_running_it():
    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('ran')",))

    stream = io.BytesIO()
    torch.save({"t": torch.zeros(2), "x": Boom()}, stream, pickle_module=pickle)
    target = torch.ones(2)
    assert not torchsave.read_into(stream, 0, stream.tell(), target)
    assert target.tolist() == [1.0, 1.0]


def test_damaged_or_truncated_records_are_declined():
    tensor = torch.randn(4096)
    stream, offset, length = record(tensor)
    data = bytearray(stream.getvalue())
    data[offset:offset + 4] = b"XXXX"  # the first local header's signature
    assert not torchsave.read_into(io.BytesIO(bytes(data)), offset, length, torch.zeros(4096))

    # A stream that ends early has lost the record's central directory: declined too, and
    # the reader's torch.load fallback reports the damage.
    whole = stream.getvalue()
    assert not torchsave.read_into(io.BytesIO(whole[:offset + 2000]), offset, length,
                                   torch.zeros(4096))


def test_the_payload_is_found_from_the_record_head_alone(monkeypatch):
    tensor = torch.randn(300, 7)
    stream, offset, length = record(tensor)

    def no_central_directory(*args: object) -> None:
        raise AssertionError("the head walk should have found the payload")

    monkeypatch.setattr(read.zipfile, "ZipFile", no_central_directory)
    target = torch.zeros(300, 7)
    assert torchsave.read_into(stream, offset, length, target)
    assert torch.equal(target, tensor)


def test_a_layout_is_walked_once_and_a_record_that_starts_otherwise_is_walked_again(
        monkeypatch):
    # Records of one layout start with the same bytes: the walk's answer is kept and reused
    # for a record whose head starts with them; any other head (damage in its pickle, the
    # header of a record of another storage) is walked afresh and declined if it must be.
    monkeypatch.setattr(read, "_walks", BytesBounded())
    walked = []
    real = read._walk_head

    def counted(head, dtype, shape):
        walked.append(len(head))
        return real(head, dtype, shape)

    monkeypatch.setattr(read, "_walk_head", counted)
    tensors = [torch.randn(300, 7) for _ in range(3)]
    for tensor in tensors:
        stream, offset, length = record(tensor)
        target = torch.zeros(300, 7)
        assert torchsave.read_into(stream, offset, length, target)
        assert torch.equal(target, tensor)
    assert len(walked) == 1
    stream, offset, length = record(torch.randn(300, 7))
    data = bytearray(stream.getvalue())
    pickled = data.index(b"_rebuild_tensor_v2", offset)
    data[pickled] ^= 0x01  # the record now rebuilds with another function: not plain
    target = torch.zeros(300, 7)
    assert not torchsave.read_into(io.BytesIO(bytes(data)), offset, length, target)
    assert len(walked) == 2 and not target.any()


def test_a_record_whose_head_read_ends_inside_its_descriptor_is_read_in_place():
    # The reader's first read (4 KB) holds all of a small tensor's payload, but for a few
    # sizes not all of the data descriptor after it: that one is read on, not declined.
    tensor = torch.randn(845)  # lead + payload end 12 bytes before the first read's end
    stream, offset, length = record(tensor)
    start, nbytes = read._walk_head(stream.getvalue()[offset:offset + read._HEAD_BYTES],
                                    tensor.dtype, tuple(tensor.shape))
    assert 0 < read._HEAD_BYTES - (start + nbytes) < read.DESCRIPTOR64.size
    target, hasher = torch.zeros(845), xxhash.xxh3_64()
    assert torchsave.read_into(stream, offset, length, target, hasher)
    assert torch.equal(target, tensor)
    assert hasher.intdigest() == xxhash.xxh3_64_intdigest(stream.getvalue()[offset:])


def test_a_model_of_thousands_of_distinct_small_shapes_is_walked_once(monkeypatch):
    # 20,000 small tensors of distinct sizes (benchmarks/bench_small_tensors.py): a cap of
    # 4,096 walks had each load walk nearly every record again. The bound is on bytes.
    assert read.reads_checked()  # the probe's own walks are not counted
    monkeypatch.setattr(read, "_walks", BytesBounded())
    walked = []
    real = read._walk_head

    def counted(head, dtype, shape):
        walked.append(shape)
        return real(head, dtype, shape)

    monkeypatch.setattr(read, "_walk_head", counted)
    records = [(tensor, *record(tensor)) for tensor in map(torch.randn, range(1, 5001))]
    for _ in range(2):  # two loads
        for tensor, stream, offset, length in records:
            target = torch.empty_like(tensor)
            assert torchsave.read_into(stream, offset, length, target)
            assert torch.equal(target, tensor)
    assert len(walked) == 5000
    monkeypatch.setattr(read, "_WALK_BYTES_KEPT", 10 * (read._WALK_OVERHEAD + 1024))
    for tensor in map(torch.randn, range(5001, 5101)):  # layouts not seen yet
        assert torchsave.read_into(*record(tensor), torch.empty_like(tensor))
    assert 0 < len(read._walks) <= 10


def test_a_head_the_walk_cannot_follow_is_read_through_the_central_directory():
    tensor = torch.randn(64)
    stream, offset, length = record(tensor)
    data = bytearray(stream.getvalue())
    descriptor = data.index(b"PK\x07\x08", offset)  # the one after data.pkl
    data[descriptor + 8] ^= 0xFF  # its compressed size no longer matches the pickle
    target = torch.zeros(64)
    assert torchsave.read_into(io.BytesIO(bytes(data)), offset, length, target)
    assert torch.equal(target, tensor)


def test_statereg_records_pass_zip_integrity_checks_and_equal_torch_save(tmp_path,
                                                                          record_code):
    # docs/compatibility.md: each tensor item of a .distcp file is the torch.save zip of that
    # tensor, byte for byte, CRC-32s included, so standard zip tools find nothing wrong.
    import torch.distributed.checkpoint as dcp

    from statereg.backends import FileRecorder, open_backend
    from statereg.dcp.metadata import load_dcp_metadata
    from statereg.dcp.writer import BackendWriter

    state = {"w": torch.randn(129, 65), "h": torch.randn(4000).bfloat16(),
             "i": torch.arange(77, dtype=torch.int32), "extra": {"step": 1}}
    writer = BackendWriter(open_backend(str(tmp_path)), "ckpt", FileRecorder(), thread_count=2)
    dcp.save(state, storage_writer=writer, no_dist=True)
    metadata = load_dcp_metadata((tmp_path / "ckpt" / ".metadata").read_bytes(), ".metadata")

    checked = set()
    for index, info in metadata.storage_data.items():
        if index.fqn not in ("w", "h", "i"):
            continue
        data = (tmp_path / "ckpt" / info.relative_path).read_bytes()
        item = data[info.offset:info.offset + info.length]
        archive = zipfile.ZipFile(io.BytesIO(item))
        assert archive.testzip() is None
        if shutil.which("unzip"):  # Info-ZIP, where installed, agrees
            (tmp_path / f"{index.fqn}.zip").write_bytes(item)
            tested = subprocess.run(["unzip", "-tq", str(tmp_path / f"{index.fqn}.zip")],
                                    capture_output=True, text=True, timeout=60)
            assert tested.returncode == 0 and "No errors detected" in tested.stdout, tested
        assert all(member.CRC != 0 for member in archive.infolist() if member.file_size)
        expected = io.BytesIO()
        torch.save(state[index.fqn], expected)
        assert item == expected.getvalue()
        checked.add(index.fqn)
    assert checked == {"w", "h", "i"}


def test_testzip_reports_a_record_whose_crc_is_zero():
    # What statereg 0.1 wrote (crc32 left out): the check above would catch it.
    stream, offset, length = record(torch.randn(100))
    data = bytearray(stream.getvalue()[offset:offset + length])
    archive = zipfile.ZipFile(io.BytesIO(bytes(data)))
    payload = next(m for m in archive.infolist() if m.filename.endswith("data/0"))
    for at in _central_headers(bytes(data)):
        name_len = int.from_bytes(data[at + 28:at + 30], "little")
        if data[at + 46:at + 46 + name_len].decode() == payload.filename:
            data[at + 16:at + 20] = bytes(4)
    assert zipfile.ZipFile(io.BytesIO(bytes(data))).testzip() == payload.filename


def _central_headers(data: bytes) -> list[int]:
    found, at = [], data.find(b"PK\x01\x02")
    while at >= 0:
        found.append(at)
        at = data.find(b"PK\x01\x02", at + 4)
    return found


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128, torch.uint16,
                                   torch.float8_e4m3fn, torch.bool])
def test_bounded_load_reads_every_storage_class_torch_save_names(dtype: torch.dtype) -> None:
    """Complex dtypes have their own storage classes, and dtypes without one (uint16, float8)
    are saved as torch.storage.UntypedStorage: the size bound must know them all."""
    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3).to(dtype)
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    loaded = torchsave.load(buffer, 0, len(buffer.getvalue()), "record")
    assert loaded.dtype == dtype
    assert torch.equal(loaded.view(torch.uint8), tensor.view(torch.uint8))


@pytest.mark.parametrize("reader", ["bounded load", "payload walk"])
def test_records_without_crcs_are_read(reader: str) -> None:
    """Memory checkpoints' records carry no CRC-32s (torchsave/crc_stream.py): the size bound reads
    data.pkl as stored, where zipfile would refuse its zero CRC-32, and the walk finds the
    payload."""

    tensor = torch.randn(40, 3)
    buffer = io.BytesIO()
    torchsave.save_record(tensor, buffer, crcs=False)
    data = buffer.getvalue()
    with pytest.raises(zipfile.BadZipFile, match="Bad CRC-32"):
        zipfile.ZipFile(io.BytesIO(data)).read("archive/data.pkl")
    if reader == "bounded load":
        loaded = torchsave.load(buffer, 0, len(data), "record")
    else:
        loaded = torch.empty_like(tensor)
        assert torchsave.read_into(buffer, 0, len(data), loaded)
    assert torch.equal(loaded.view(torch.uint8), tensor.view(torch.uint8))


def test_this_torch_passes_the_read_probe():
    # Otherwise every load goes through torch.load and a copy (still the same values).
    assert read.reads_checked()


def test_a_torch_whose_records_the_walk_misreads_is_read_by_torch_load(monkeypatch):
    # A torch that lays a record out otherwise, where the walk still finds a payload: the
    # probe compares with torch.load, warns once, and every record goes to torch.load.
    real = read._walked

    def shifted(head, dtype, shape):
        start, nbytes = real(head, dtype, shape)
        return start + 4, nbytes

    monkeypatch.setattr(read, "_reads_usable", None)
    monkeypatch.setattr(read, "_walked", shifted)
    with pytest.warns(RuntimeWarning, match="every record is read by torch.load"):
        assert not read.reads_checked()
    tensor = torch.randn(300)
    stream, offset, length = record(tensor)
    assert not torchsave.read_into(stream, offset, length, torch.zeros(300))
    assert torch.equal(torchsave.load(stream, offset, length, "record"), tensor)
