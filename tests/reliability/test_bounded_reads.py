"""Every reader goes through the verified read path, and every read is bounded by what the
manifest records (issue 14).

- export-hf, cp (as is and recompressed), verify and load on a flipped byte, a truncated
  file or a damaged compressed item: a CorruptCheckpointError naming the file (and the item
  where one is read), one line from the CLI, exit status 1, never a traceback;
- a zip bomb inside an uncompressed .distcp item (a 1 MB record whose data.pkl inflates to
  1 GiB, with metadata, digests and manifest rewritten to match, as an attacker with write
  access would) is refused before torch.load inflates anything;
- verify and cp read a file in bounded blocks: the peak memory of verifying a 256 MiB file
  stays far below the file's size.
"""

from __future__ import annotations

import io
import pickle
import re
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import xxhash
from reliability_kit import rewrite_manifest
from torch import nn

import statereg
from statereg.cli import main as cli
from statereg.dcp.metadata import ITEM_CHECKSUMS, load_dcp_metadata


def save_model(root: Path, compression: str, width: int = 32) -> str:
    storage = {"url": str(root), "io_threads": 1}
    if compression != "none":
        storage["compression"] = compression
    spec = {"storage": storage, "components": {"model": {"kind": "model"}}}
    torch.manual_seed(0)
    return statereg.CheckpointManager(spec, model=nn.Linear(width, width, bias=False)).save(
        step=1)


def damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0x10
    else:
        del data[len(data) // 2:]
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_every_reader_names_a_damaged_file_in_one_line(tmp_path, compression, how, capsys):
    url = save_model(tmp_path / "ck", compression)
    data_file = Path(url) / "model" / "__0_0.distcp"
    damage(data_file, how)
    item = f"{data_file} (item 'weight')"
    commands = {
        "export-hf": ["export-hf", url, str(tmp_path / "hf")],
        "cp": ["cp", url, str(tmp_path / "copy")],
        "cp --compression": ["cp", url, str(tmp_path / "recompressed"), "--compression",
                             "none" if compression == "zstd" else "zstd"],
        "verify": ["verify", url],
    }
    for what, argv in commands.items():
        assert cli(argv) == 1, what
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.count("\n") == 1, f"{what}: {err}"
        assert str(data_file) in err, f"{what}: {err}"
        if what in ("export-hf", "cp --compression"):  # these read items, not whole files
            assert item in err, f"{what}: {err}"
    assert not (tmp_path / "copy" / "step_00000001" / "manifest.json").exists()
    assert not (tmp_path / "recompressed" / "step_00000001" / "manifest.json").exists()
    with pytest.raises(statereg.CorruptCheckpointError, match=f"^{re.escape(str(data_file))}"):
        statereg.export_hf(url, tmp_path / "hf2")
    spec = {"storage": {"url": str(tmp_path / "ck")}, "components": {"model": {"kind": "model"}}}
    mgr = statereg.CheckpointManager(spec, model=nn.Linear(32, 32, bias=False))
    with pytest.raises(statereg.CorruptCheckpointError, match=re.escape(str(data_file))):
        mgr.load(url)


def bomb_record(inflated: int) -> bytes:
    """A torch.save-shaped zip whose data.pkl is `inflated` bytes deflated to about a
    thousandth of that: torch's zip reader would inflate it whole before unpickling."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        info = zipfile.ZipInfo("archive/data.pkl")
        info.compress_type = zipfile.ZIP_DEFLATED
        with archive.open(info, "w", force_zip64=True) as member:
            block = bytes(1 << 20)
            for _ in range(inflated >> 20):
                member.write(block)
        archive.writestr("archive/byteorder", "little")
        archive.writestr("archive/version", "3\n")
    return out.getvalue()


def peak_since_reset() -> int:
    """This process's peak resident memory (VmHWM) in bytes since `reset_peak()`."""
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) * 1024


def reset_peak() -> int:
    """Reset VmHWM to the current resident memory (Linux clear_refs 5); returns it."""
    Path("/proc/self/clear_refs").write_text("5")
    return peak_since_reset()


def test_a_zip_bomb_in_an_uncompressed_item_is_refused_before_it_allocates(tmp_path):
    url = save_model(tmp_path / "ck", "none", width=4)
    directory = Path(url) / "model"
    record = bomb_record(1 << 30)
    assert len(record) < 2 << 20
    metadata = load_dcp_metadata((directory / ".metadata").read_bytes(), "metadata")
    (index, info), = metadata.storage_data.items()
    info.offset, info.length = 0, len(record)
    getattr(metadata, ITEM_CHECKSUMS)[index] = xxhash.xxh3_64_intdigest(record)
    rewrite_manifest(url, {}, {"model/__0_0.distcp": record,
                               "model/.metadata": pickle.dumps(metadata)})
    statereg.verify(url)  # every checksum matches: only the bounded decode stands in the way

    spec = {"storage": {"url": str(tmp_path / "ck")}, "components": {"model": {"kind": "model"}}}
    model = nn.Linear(4, 4, bias=False)
    before = model.weight.detach().clone()
    resident = reset_peak()
    for load in (lambda: statereg.CheckpointManager(spec, model=model).load(url),
                 lambda: statereg.export_hf(url, tmp_path / "hf")):
        with pytest.raises(statereg.CorruptCheckpointError,
                           match=r"__0_0\.distcp \(item 'weight'\).*member 'archive/data\.pkl' "
                                 r"is compressed"):
            load()
    assert peak_since_reset() - resident < 128 << 20
    assert torch.equal(model.weight, before)


def peak_growth(call: Callable[[], object]) -> int:
    """How many bytes this process's resident memory peaked above where it stood when `call`
    started. A whole-file read maps fresh pages (an allocation that large is its own mmap,
    returned to the system when freed), so it shows here however much ran before."""
    resident = reset_peak()
    call()
    return peak_since_reset() - resident


def test_verify_and_cp_read_in_bounded_blocks(tmp_path):
    size = 256 << 20
    url = save_model(tmp_path / "ck", "none", width=8192)  # one 256 MiB tensor, freed again
    assert (Path(url) / "model" / "__0_0.distcp").stat().st_size > size
    copy = tmp_path / "copy"
    exits: list[int] = []
    for what, call in {"verify": lambda: statereg.verify(url),
                       "cp": lambda: exits.append(cli(["cp", url, str(copy)]))}.items():
        grown = peak_growth(call)
        assert grown < size // 4, f"{what}: peak memory grew by {grown >> 20} MiB"
    assert exits == [0]
    statereg.verify(str(copy / "step_00000001"))


def test_a_damaged_safetensors_header_is_damage_not_a_different_model(tmp_path):
    spec = {"storage": {"url": str(tmp_path)},
            "components": {"model": {"kind": "model", "format": "safetensors"}}}
    url = statereg.CheckpointManager(spec, model=nn.Linear(4, 4)).save(step=1)
    path = next((Path(url) / "model").glob("*.safetensors"))
    data = path.read_bytes()
    at = data.index(b'"shape":[4,4]') + len(b'"shape":[')
    path.write_bytes(data[:at] + b"5" + data[at + 1:])  # the header now says [5,4]
    model = nn.Linear(4, 4)
    before = model.weight.detach().clone()
    # Named as damage of that file: by its checksum, or by the header check that now reads
    # each entry's shape against its byte range before the file is read whole.
    with pytest.raises(statereg.CorruptCheckpointError,
                       match=re.escape(f"{path}: ") + r"(checksum|tensor 'weight' .* damaged)"):
        statereg.CheckpointManager(spec, model=model).load(url)
    assert torch.equal(model.weight, before)


@pytest.mark.parametrize("store", ["s3"], indirect=True)
def test_verify_on_an_object_store_fetches_a_file_in_bounded_blocks(store):
    """One whole-object GET per file is what a load wants; verify and cp must not hold a
    file in memory there either: they fetch it a block at a time (ranged GETs)."""
    size = 128 << 20
    spec = {"storage": {"url": store.url, "options": store.options, "io_threads": 1},
            "components": {"model": {"kind": "model"}}}
    torch.manual_seed(0)
    url = statereg.CheckpointManager(spec, model=nn.Linear(4096, 8192, bias=False)).save(
        step=1)
    statereg.read_manifest(url, store.options)  # connected: only verify's reading counts
    grown = peak_growth(lambda: statereg.verify(url, store.options))
    assert grown < size // 4, f"verify: peak memory grew by {grown >> 20} MiB"


def test_a_reader_checks_its_metadata_once_and_a_malformed_one_every_time(tmp_path,
                                                                           monkeypatch):
    # DCP asks the reader for `.metadata` again after statereg did: the same bytes, parsed
    # afresh (DCP sets fields on the object) but checked field by field only the first time.
    from statereg.backends.registry import open_backend
    from statereg.dcp import metadata as dcp_metadata
    from statereg.dcp.reader import BackendReader
    from statereg.errors import CorruptCheckpointError

    statereg.CheckpointManager({"storage": {"url": str(tmp_path)}, "components": {
        "model": {"kind": "model"}}}, model=nn.Linear(3, 2)).save(step=1)
    backend = open_backend(str(tmp_path), {})
    checks = []
    real = dcp_metadata._metadata_defect
    monkeypatch.setattr(dcp_metadata, "_metadata_defect",
                        lambda metadata: checks.append(1) or real(metadata))
    reader = BackendReader(backend, "step_00000001/model")
    first, second = reader.read_metadata(), reader.read_metadata()
    assert first is not second and first.state_dict_metadata.keys() == {"weight", "bias"}
    assert len(checks) == 1

    malformed = first
    malformed.state_dict_metadata = list(malformed.state_dict_metadata)
    (tmp_path / "step_00000001" / "model" / ".metadata").write_bytes(pickle.dumps(malformed))
    reader = BackendReader(backend, "step_00000001/model")
    for _ in range(2):
        with pytest.raises(CorruptCheckpointError, match="state_dict_metadata is not a dict"):
            reader.read_metadata()
