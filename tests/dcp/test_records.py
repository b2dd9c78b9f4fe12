"""statereg's tensor records: torch.save's bytes, CRC-32s computed by statereg
(statereg/dcp/torchsave: write.py, crc_stream.py, templates.py, crcs.py)."""

from __future__ import annotations

import io
import struct
import subprocess
import sys
import textwrap
import threading
import warnings
import zipfile

import pytest
import torch
import xxhash

from statereg.backends.kernel import available_memory
from statereg.dcp import torch_private, torchsave
from statereg.dcp.torchsave import crc_stream, crcs, layout, templates
from statereg.errors import StateregError
from statereg.process_state import BytesBounded


def torch_save_bytes(tensor: torch.Tensor) -> bytes:
    out = io.BytesIO()
    torch.save(tensor, out)
    return out.getvalue()


def record_bytes(tensor: torch.Tensor, sliced: bool = True, crcs: bool = True) -> bytes:
    out = io.BytesIO()
    torchsave.save_record(tensor, out, sliced=sliced, crcs=crcs)
    return out.getvalue()


def torch_save_bytes_without_crcs(tensor: torch.Tensor) -> bytes:
    """What torch.save writes with its process-wide CRC-32 option off."""
    out = io.BytesIO()
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(tensor, out)
    finally:
        torch.serialization.set_crc32_options(True)
    return out.getvalue()


TENSORS = {
    "fp32": lambda: torch.randn(64, 33),
    "bf16": lambda: torch.randn(1000).bfloat16(),
    "fp16 across slices": lambda: torch.randn(3 * layout.SLICE // 2 + 5).half(),
    "fp32 three slices and a bit": lambda: torch.randn(3 * layout.SLICE // 4 + 1),
    "one slice exactly": lambda: torch.randn(layout.SLICE // 4),
    "scalar": lambda: torch.tensor(2.5, dtype=torch.float64),
    "empty": lambda: torch.zeros(0),
    "empty 2-d": lambda: torch.zeros(0, 7, dtype=torch.int64),
    "bool": lambda: torch.rand(17) > 0.5,
    "uint8": lambda: torch.arange(255, dtype=torch.uint8),
    "complex": lambda: torch.randn(9, dtype=torch.complex64),
    "float8": lambda: torch.randn(40).to(torch.float8_e4m3fn),
    "uint16": lambda: torch.arange(30).to(torch.uint16),
    # A payload that begins like a data descriptor whose sizes are zero: told apart by size.
    "descriptor look-alike": lambda: torch.tensor([0x08074B50, 0, 0, 0], dtype=torch.int32),
}


@pytest.mark.parametrize("path", ["as chosen", "through CrcRecords"])
@pytest.mark.parametrize("sliced", [True, False], ids=["sliced", "whole"])
@pytest.mark.parametrize("name", list(TENSORS))
def test_records_equal_torch_save_byte_for_byte_and_pass_zip_checks(name, sliced, path,
                                                                    monkeypatch):
    if path != "as chosen":  # no templates
        monkeypatch.setattr(templates, "TEMPLATED_UP_TO", -1)
    tensor = TENSORS[name]()
    ours = record_bytes(tensor, sliced)
    assert ours == torch_save_bytes(tensor)
    archive = zipfile.ZipFile(io.BytesIO(ours))
    assert archive.testzip() is None
    assert all(member.CRC != 0 for member in archive.infolist() if member.file_size)
    back = torch.load(io.BytesIO(ours), weights_only=True)
    assert back.dtype == tensor.dtype
    as_bytes = [t.reshape(-1).view(torch.uint8).tolist() for t in (back, tensor)]
    assert as_bytes[0] == as_bytes[1]


@pytest.mark.parametrize("path", ["as chosen", "through CrcRecords"])
@pytest.mark.parametrize("name", list(TENSORS))
def test_records_without_crcs_are_torch_saves_with_its_crc_option_off(name, path, monkeypatch):
    # The memory tier's records (IOPolicy.record_crcs False): what torch.save writes under
    # set_crc32_options(False), for any data of a layout, and torch.load reads them.
    if path != "as chosen":
        monkeypatch.setattr(templates, "TEMPLATED_UP_TO", -1)
    monkeypatch.setattr(templates, "_templates", BytesBounded())
    first = TENSORS[name]()
    tensors = [first] + [first.logical_not() if first.dtype == torch.bool
                         else other_data(first, seed) for seed in range(3)]
    for tensor in tensors:
        ours = record_bytes(tensor, crcs=False)
        assert ours == torch_save_bytes_without_crcs(tensor)
        assert all(member.CRC == 0 for member in zipfile.ZipFile(io.BytesIO(ours)).infolist())
        back = torch.load(io.BytesIO(ours), weights_only=True)
        assert back.reshape(-1).view(torch.uint8).tolist() == \
            tensor.reshape(-1).view(torch.uint8).tolist()
    if path == "as chosen":  # written from a template of the CRC-less record
        assert [key[-1] for key in templates._templates] == [False]
    assert record_bytes(tensors[1]) == torch_save_bytes(tensors[1])  # and with CRC-32s


@pytest.mark.parametrize("written", ["without CRC-32s", "with CRC-32s"])
@pytest.mark.parametrize("name", list(TENSORS))
def test_adding_crcs_to_a_record_gives_torch_saves_bytes(name, written, record_code):
    # What a drain from memory does to each tensor record (engine/transfer.py): the record
    # read in place (other bytes around it), every byte of it through the hasher, in order.
    # Through statereg's own CRC-32s, and (`record_code`) through torch.load and torch.save.
    tensor = TENSORS[name]()
    record = (torch_save_bytes(tensor) if written == "with CRC-32s"
              else torch_save_bytes_without_crcs(tensor))
    stream = io.BytesIO(b"before" + record + b"after")
    out, read = io.BytesIO(), xxhash.xxh3_64()
    torchsave.add_crcs(stream, len(b"before"), len(record), out, read)
    assert out.getvalue() == torch_save_bytes(tensor)
    assert read.intdigest() == xxhash.xxh3_64(record).intdigest()


@pytest.mark.parametrize("damage", ["end of central directory", "a data descriptor",
                                    "the serialization id", "cut short"])
def test_adding_crcs_to_a_record_not_laid_out_as_torch_saves_raises(damage):
    record = bytearray(record_bytes(torch.randn(300), crcs=False))
    if damage == "end of central directory":
        record[-22:-18] = b"XXXX"
    elif damage == "a data descriptor":
        at = record.index(layout.DESCRIPTOR)
        record[at + 8:at + 12] = b"\xff\xff\xff\x7f"  # its sizes no longer the member's
    elif damage == "the serialization id":
        at = record.rindex(b"serialization_id", 0, record.index(layout.CENTRAL))
        start = record.index(layout.DESCRIPTOR, at) - 40
        record[start:start + 1] = b"x"
    else:
        record = record[:len(record) // 2] + record[-100:]
    with pytest.raises(torchsave.RecordError):
        torchsave.add_crcs(io.BytesIO(bytes(record)), 0, len(record), io.BytesIO(),
                         xxhash.xxh3_64())


def test_the_template_probe_covers_records_without_crcs(monkeypatch):
    # A template whose CRC-less record differed from torch's writer's keeps templates off.
    real_write = templates.Template.write

    def crc_less_differs(self, tensor, out, sliced):
        real_write(self, tensor, out, sliced)
        if not self.crcs:
            out.write(b"!")

    monkeypatch.setattr(templates, "_templates_usable", None)
    monkeypatch.setattr(templates, "_templates", BytesBounded())
    monkeypatch.setattr(templates.Template, "write", crc_less_differs)
    with pytest.warns(RuntimeWarning, match="records are written without templates"):
        assert not templates.templates_checked()
    tensor = torch.randn(9, 9)
    assert record_bytes(tensor, crcs=False) == torch_save_bytes_without_crcs(tensor)


def test_this_torch_passes_the_probe():
    # Otherwise every save silently pays torch's slower CRC-32 (still correct bytes).
    assert torch_private.ZIP_WRITER_AVAILABLE
    assert crc_stream.writer_checked()


def test_a_process_wide_crc_switch_is_neither_needed_nor_changed():
    # Another thread's torch.save must keep its CRCs while statereg writes without torch's:
    # statereg never flips torch's process-wide switch; its own records carry CRCs anyway.
    tensor = torch.randn(500)
    assert crc_stream.writer_checked()  # the probe ran before the switch was turned off
    torch.serialization.set_crc32_options(False)
    try:
        ours = record_bytes(tensor)
        assert not torch.serialization.get_crc32_options()
    finally:
        torch.serialization.set_crc32_options(True)
    assert ours == torch_save_bytes(tensor)


def test_records_written_from_many_threads_at_once_are_all_right(record_code):
    tensors = [torch.randn(5000 + i % 2) for i in range(16)]  # two templates, eight uses
    results: dict[int, bytes] = {}

    def write(i: int) -> None:
        results[i] = record_bytes(tensors[i])

    threads = [threading.Thread(target=write, args=(i,)) for i in range(len(tensors))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(results[i] == torch_save_bytes(t) for i, t in enumerate(tensors))


def other_data(tensor: torch.Tensor, seed: int) -> torch.Tensor:
    """A tensor of `tensor`'s layout (dtype, shape, strides, storage) with other bytes."""
    other = tensor.clone()
    raw = torch.empty(0, dtype=torch.uint8).set_(other.untyped_storage(), 0,
                                                 (other.untyped_storage().nbytes(),))
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(seed)))
    if raw.numel() >= 8 and seed % 2:  # the payload starts like a data descriptor
        raw[:4] = torch.tensor(list(layout.DESCRIPTOR), dtype=torch.uint8)
    return other


@pytest.mark.parametrize("sliced", [True, False], ids=["sliced", "whole"])
@pytest.mark.parametrize("name", list(TENSORS))
def test_a_layouts_template_writes_torch_saves_bytes_for_any_data(name, sliced, monkeypatch):
    # The template is made from the first record of a layout; every later tensor of that
    # layout, whatever its bytes (one that starts like a descriptor too), gets torch.save's.
    monkeypatch.setattr(templates, "_templates", BytesBounded())
    first = TENSORS[name]()
    assert record_bytes(first, sliced) == torch_save_bytes(first)
    for seed in range(4):
        # A bool holds 0 or 1 only: other_data's random bytes would not be one.
        other = first.logical_not() if first.dtype == torch.bool else other_data(first, seed)
        assert record_bytes(other, sliced) == torch_save_bytes(other), seed


def _count_torchs_writer(monkeypatch) -> list[tuple[int, ...]]:
    """From an empty template cache, the shapes whose records torch's writer made (a miss)."""
    made: list[tuple[int, ...]] = []
    real = crc_stream.save_crc_records

    def counted(tensor, out, sliced, crcs=True):
        made.append(tuple(tensor.shape))
        real(tensor, out, sliced, crcs)

    monkeypatch.setattr(templates, "_templates", BytesBounded())
    monkeypatch.setattr(crc_stream, "save_crc_records", counted)
    return made


def test_only_a_layouts_first_record_runs_torchs_writer(monkeypatch):
    assert templates.templates_checked()  # the probe's own records are not counted
    made = _count_torchs_writer(monkeypatch)
    tensors = [torch.randn(64, 3), torch.randn(64, 3), torch.randn(3, 64), torch.randn(64, 3)]
    assert [record_bytes(t) for t in tensors] == [torch_save_bytes(t) for t in tensors]
    assert made == [(64, 3), (3, 64)]
    big = torch.randn(templates.TEMPLATED_UP_TO // 4 + 1)  # past the limit: no template
    assert record_bytes(big) == torch_save_bytes(big)
    assert made[-1] == tuple(big.shape) and len(templates._templates) == 2


def test_a_model_of_thousands_of_distinct_small_shapes_keeps_every_template(monkeypatch):
    # 20,000 small tensors of distinct sizes (benchmarks/bench_small_tensors.py): a cap of
    # 4,096 templates had every save miss nearly every layout, running torch's writer again.
    assert templates.templates_checked()
    made = _count_torchs_writer(monkeypatch)
    tensors = [torch.randn(n) for n in range(1, 5001)]
    for _ in range(2):  # two saves of the same model
        for tensor in tensors:
            torchsave.save_record(tensor, io.BytesIO())
    assert len(made) == 5000  # the first save's, once per layout
    assert record_bytes(tensors[-1]) == torch_save_bytes(tensors[-1])
    # The bound is on bytes: past it the templates are forgotten and made again.
    monkeypatch.setattr(templates, "_TEMPLATE_BYTES_KEPT", 10 * (templates._TEMPLATE_OVERHEAD
                                                                 + 2048))
    for n in range(5001, 5101):  # layouts not seen yet
        torchsave.save_record(torch.randn(n), io.BytesIO())
    assert 0 < len(templates._templates) <= 10


def test_a_torch_whose_records_hold_more_data_dependent_bytes_gets_no_templates(monkeypatch):
    # The probe writes a second tensor of each probe's layout through its template: were the
    # records to depend on the data anywhere else, templates would stay off for the process.
    real_write = templates.Template.write

    def other_bytes(self, tensor, out, sliced):
        real_write(self, tensor, out, sliced)
        out.write(b"!")

    monkeypatch.setattr(templates, "_templates_usable", None)
    monkeypatch.setattr(templates, "_templates", BytesBounded())
    monkeypatch.setattr(templates.Template, "write", other_bytes)
    with pytest.warns(RuntimeWarning, match="records are written without templates"):
        assert not templates.templates_checked()
    tensors = [torch.randn(7, 7), torch.randn(7, 7)]
    assert [record_bytes(t) for t in tensors] == [torch_save_bytes(t) for t in tensors]
    assert templates._templates == {}


def test_a_record_not_shaped_as_expected_keeps_its_layout_on_the_plain_path(monkeypatch):
    assert templates.templates_checked()

    def unexpected(self, record, payload, crcs=True):  # e.g. a torch writing two storages
        raise layout.Unexpected("one storage record and a serialization id")

    monkeypatch.setattr(templates, "_templates", BytesBounded())
    monkeypatch.setattr(templates.Template, "__init__", unexpected)
    tensors = [torch.randn(7, 7), torch.randn(7, 7)]
    assert [record_bytes(t) for t in tensors] == [torch_save_bytes(t) for t in tensors]
    assert list(templates._templates.values()) == [None]


def test_this_torch_passes_the_template_probe():
    # Otherwise every save pays torch's pickler and CrcRecords for every tensor again.
    assert templates.templates_checked()


@pytest.mark.parametrize("change", ["names missing", "bytes differ"])
def test_a_torch_whose_writer_differs_gets_torch_save_itself(monkeypatch, change):
    monkeypatch.setattr(crc_stream, "_checked", None)
    if change == "names missing":
        monkeypatch.setattr(torch_private, "ZIP_WRITER_AVAILABLE", False)
    else:  # the writer records drives aligns storages otherwise than torch.save's
        monkeypatch.setattr(torch_private, "zip_writer_without_crc",
                            lambda buffer: torch._C.PyTorchFileWriter(buffer, False, 4096))
    with pytest.warns(RuntimeWarning, match="every record is written by torch.save itself"):
        assert not crc_stream.writer_checked()

    def refused(*args):
        raise AssertionError("the CRC-less writer ran after the probe failed")

    monkeypatch.setattr(torch_private, "zip_writer_without_crc", refused)
    tensor = torch.randn(300)
    assert record_bytes(tensor) == torch_save_bytes(tensor)


class FailingSink(io.RawIOBase):
    """Fails the first write of at least `at` bytes (a full disk under the payload)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at
        self.kept = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if len(view) >= self.at:
            raise OSError(28, "No space left on device")
        self.kept += view
        return len(view)


@pytest.mark.parametrize("sliced", [True, False], ids=["sliced", "whole"])
def test_a_failing_stream_raises_its_error_and_the_next_record_is_whole(sliced, record_code):
    # torch's writer, dropped unfinished, would write its end of file from a destructor: a
    # second error there aborts the process. The error is the stream's, and nothing breaks.
    tensor = torch.randn(1 << 18)
    with pytest.raises(OSError, match="No space left"):
        torchsave.save_record(tensor, FailingSink(at=64 * 1024), sliced=sliced)
    assert record_bytes(tensor) == torch_save_bytes(tensor)


@pytest.mark.parametrize("pieces, expected", [
    ([b"garbage that is no zip header!"], "a local header"),
    # No data descriptor (flag bit 3 clear), yet a size: only empty records come so.
    ([struct.pack("<4s2B4HL2L2H", b"PK\x03\x04", 0, 0, 0, 0, 0, 0, 0, 5, 5, 0, 0)],
     "an empty record"),
])
def test_pieces_out_of_order_are_a_statereg_error_naming_what_was_expected(pieces, expected):
    sink = io.BytesIO()
    stream = crc_stream.CrcRecords(sink, payload=4)
    with pytest.raises(StateregError, match=f"did not write {expected}.*Report this"):
        for piece in pieces:
            stream.write(piece)
    with pytest.raises(StateregError, match="the central directory"):
        crc_stream.CrcRecords(sink, payload=4).finish()


def test_without_isal_the_standard_library_crc_writes_the_same_bytes():
    script = textwrap.dedent("""
        import io, sys, zlib
        sys.modules["isal"] = sys.modules["isal.isal_zlib"] = None
        import torch
        from statereg.dcp import torchsave
        from statereg.dcp.torchsave import layout
        assert layout.crc32 is zlib.crc32
        t = torch.randn(70000)
        a, b = io.BytesIO(), io.BytesIO()
        torch.save(t, a); torchsave.save_record(t, b)
        print(a.getvalue() == b.getvalue())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"


class DigestSink(io.RawIOBase):
    """Keeps only the digest and length of what is written."""

    def __init__(self) -> None:
        super().__init__()
        self.hasher = xxhash.xxh3_64()
        self.length = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.hasher.update(view)
        self.length += len(view)
        return len(view)


@pytest.mark.skipif((available_memory() or 0) < 10 << 30,
                    reason="needs a 4 GiB tensor and room beside it")
def test_a_record_past_4_gib_is_zip64_and_still_torch_saves_bytes():
    # Past 4 GiB miniz writes zip64 records: the extra field in two pieces, 24-byte data
    # descriptors, for this record and every one after it (an embedding of 128k x 8k fp32).
    tensor = torch.ones((1 << 32) + 4096, dtype=torch.uint8)
    theirs, ours = DigestSink(), DigestSink()
    torch.save(tensor, theirs)
    torchsave.save_record(tensor, ours)
    assert ours.length == theirs.length > 1 << 32
    assert ours.hasher.intdigest() == theirs.hasher.intdigest()


class Marked(torch.Tensor):
    """A tensor subclass (its records carry its class)."""


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
@pytest.mark.parametrize("kind", ["parameter", "quantized", "subclass"])
def test_tensors_other_than_plain_ones_are_written_by_torch_save(monkeypatch, kind):
    tensor = {"parameter": lambda: torch.nn.Parameter(torch.randn(40)),
              "quantized": lambda: torch.quantize_per_tensor(torch.randn(40), 0.1, 0,
                                                             torch.qint8),
              "subclass": lambda: torch.randn(40).as_subclass(Marked)}[kind]()

    def refused(*args):
        raise AssertionError("records wrote a tensor it has not been checked against")

    monkeypatch.setattr(torch_private, "zip_writer_without_crc", refused)
    assert record_bytes(tensor) == torch_save_bytes(tensor)


def test_a_process_that_turned_crcs_off_before_its_first_save_keeps_torch_save(monkeypatch):
    monkeypatch.setattr(crc_stream, "_checked", None)
    torch.serialization.set_crc32_options(False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # what the process asked for: nothing to warn of
            assert not crc_stream.writer_checked()
        tensor = torch.randn(300)
        assert record_bytes(tensor) == torch_save_bytes(tensor)
    finally:
        torch.serialization.set_crc32_options(True)


def test_this_torch_passes_the_add_crcs_probe():
    # Otherwise every drain from memory pays torch.load and torch.save for every record.
    assert crcs.crcs_checked()


def test_a_torch_whose_serialization_id_folds_otherwise_gets_crcs_from_torch(monkeypatch):
    # A torch that forms the id's second half another way: the probe notices, warns once,
    # and every record is then torch.load'ed and torch.save'd, torch.save's bytes still.
    monkeypatch.setattr(crcs, "_crcs_usable", None)
    monkeypatch.setattr(crcs, "hash_combine", lambda seed, value: seed)
    with pytest.warns(RuntimeWarning, match="CRC-32s are added by torch.load and torch.save"):
        assert not crcs.crcs_checked()
    tensor = torch.randn(300)
    record = torch_save_bytes_without_crcs(tensor)
    out = io.BytesIO()
    torchsave.add_crcs(io.BytesIO(record), 0, len(record), out, xxhash.xxh3_64())
    assert out.getvalue() == torch_save_bytes(tensor)
