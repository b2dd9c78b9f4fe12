"""save.incremental: unchanged tensors are referenced, not rewritten, and everything still holds."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.filesystem import _StorageInfo

import statereg
import statereg.cli
from statereg.dcp.metadata import load_dcp_metadata


class FineTune(nn.Module):
    """A frozen 4 MiB base and a trainable 1 MiB head."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.base = nn.Linear(1024, 1024, bias=False).requires_grad_(False)
        self.head = nn.Linear(1024, 256)


def run(url: str, seed: int = 0, compression: str | None = None,
        **save: object) -> tuple[FineTune, torch.optim.Optimizer, statereg.CheckpointManager]:
    model = FineTune(seed)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    storage = {"url": url} if compression is None else {"url": url, "compression": compression}
    spec = {"storage": storage,
            "components": {"model": {"kind": "model"}, "optimizer": {"kind": "optimizer"}},
            "save": {"incremental": True, **save}}
    return model, opt, statereg.CheckpointManager(spec, model=model, optimizer=opt)


def step(model: FineTune, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model.head(model.base(torch.randn(8, 1024))).square().mean().backward()
    opt.step()


def saved_twice(root: str) -> tuple[FineTune, torch.optim.Optimizer, str]:
    """Two trained, incremental saves under `root`; returns the model, optimizer, second URL."""
    model, opt, mgr = run(root)
    step(model, opt)
    mgr.save(step=1)
    step(model, opt)
    return model, opt, mgr.save(step=2)


def data_bytes(checkpoint: str) -> int:
    return sum(f.stat().st_size for f in Path(checkpoint).rglob("*.distcp"))


def trainable_bytes(model: FineTune, opt: torch.optim.Optimizer) -> int:
    params = sum(p.nbytes for p in model.parameters() if p.requires_grad)
    moments = sum(v.nbytes for s in opt.state.values() for v in s.values())
    return params + moments


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    state = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for param, entries in opt.state_dict()["state"].items():
        state.update({f"opt.{param}.{k}": v.clone() for k, v in entries.items()})
    return state


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_frozen_base_is_written_once_and_every_checkpoint_loads(tmp_path, compression):
    # Compressed, the writers share one queue of the items left after the references, and
    # the files go around the page cache: the same holds.
    root = str(tmp_path / "run")
    model, opt, mgr = run(root, compression=compression)
    sizes, states = [], []
    for n in (1, 2, 3):
        step(model, opt)
        url = mgr.save(step=n)
        sizes.append(data_bytes(url))
        states.append(snapshot(model, opt))

    assert sizes[0] > model.base.weight.nbytes  # the first save writes everything
    for later in sizes[1:]:  # then only what trained
        assert later <= 1.01 * trainable_bytes(model, opt)
    for n, expected in zip((1, 2, 3), states, strict=True):
        other, other_opt, other_mgr = run(root, seed=99)
        other_mgr.load(step=n, verify="full")
        assert_same(snapshot(other, other_opt), expected)
    manifest = statereg.verify(f"{root}/step_00000003")
    assert [r.path.split("/")[0] for r in manifest.references] == ["step_00000001"]


def test_retention_keeps_the_files_a_kept_checkpoint_references(tmp_path, capsys):
    root = str(tmp_path / "run")
    model, opt, mgr = run(root, keep_last=1)
    for n in (1, 2, 3):
        step(model, opt)
        mgr.save(step=n)
    expected = snapshot(model, opt)

    assert mgr.list() == [f"{root}/step_00000003"]
    assert not (Path(root) / "step_00000001" / "manifest.json").exists()
    assert statereg.cli.main(["ls", root]) == 0
    assert "step_00000001" not in capsys.readouterr().out
    other, other_opt, other_mgr = run(root, seed=99)
    other_mgr.load(verify="full")
    assert_same(snapshot(other, other_opt), expected)


def test_damage_to_a_referenced_file_is_named(tmp_path):
    root = str(tmp_path / "run")
    *_, url = saved_twice(root)
    (reference,) = statereg.verify(url).references
    target = Path(root) / reference.path
    blob = bytearray(target.read_bytes())
    blob[len(blob) // 2] ^= 1
    target.write_bytes(bytes(blob))

    with pytest.raises(statereg.CorruptCheckpointError, match=reference.path):
        statereg.verify(url)


def test_plain_dcp_reads_an_incremental_checkpoint_on_local_disk(tmp_path):
    root = str(tmp_path / "run")
    model, _, url = saved_twice(root)
    state = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load(state, checkpoint_id=f"{url}/model", no_dist=True)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_cp_brings_the_referenced_files_along(tmp_path):
    root = str(tmp_path / "run")
    model, opt, url = saved_twice(root)
    expected = snapshot(model, opt)

    assert statereg.cli.main(["cp", url, str(tmp_path / "copy")]) == 0
    statereg.verify(str(tmp_path / "copy" / "step_00000002"))
    other, other_opt, other_mgr = run(str(tmp_path / "copy"), seed=99)
    other_mgr.load(verify="full")
    assert_same(snapshot(other, other_opt), expected)


def test_metadata_pointing_outside_the_root_is_refused(tmp_path):
    root = str(tmp_path / "run")
    *_, mgr = run(root)
    url = mgr.save(step=1)
    meta_path = Path(url) / "model" / ".metadata"
    metadata = load_dcp_metadata(meta_path.read_bytes(), str(meta_path))
    for index, info in metadata.storage_data.items():
        metadata.storage_data[index] = _StorageInfo("../../../outside.distcp", info.offset,
                                                    info.length, info.transform_descriptors)
    meta_path.write_bytes(pickle.dumps(metadata))

    *_, other_mgr = run(root, seed=99)
    # By step: a resume would skip step 1 already, its `.metadata` no longer has the size
    # its manifest records.
    with pytest.raises(statereg.CorruptCheckpointError, match="outside the checkpoint root"):
        other_mgr.load(step=1, verify="off")


def test_gc_keeps_files_that_committed_checkpoints_reference(tmp_path):
    root = str(tmp_path / "run")
    model, opt, mgr = run(root, keep_last=1)
    for n in (1, 2):
        step(model, opt)
        mgr.save(step=n)
    expected = snapshot(model, opt)

    assert statereg.cli.main(["gc", root, "--delete", "--grace", "0"]) == 0
    other, other_opt, other_mgr = run(root, seed=99)
    other_mgr.load(verify="full")
    assert_same(snapshot(other, other_opt), expected)


def test_retention_removes_an_emptied_folder_as_a_folder_without_a_warning(tmp_path, caplog):
    # Issue 41, item 3: the retired step 1 keeps its frozen model file (step 4 references
    # it); its optimizer/ folder, emptied by the first retention, was then "deleted" as a
    # file (EISDIR) on every save, with a warning that blamed the credentials.
    root = tmp_path / "run"
    model, opt, mgr = run(str(root), keep_last=1)
    with caplog.at_level("WARNING", logger="statereg"):
        for n in (1, 2, 3, 4):
            step(model, opt)
            mgr.save(step=n)
    assert [r.message for r in caplog.records if r.levelname == "WARNING"] == []
    assert not (root / "step_00000001" / "optimizer").exists()
    assert list((root / "step_00000001" / "model").iterdir())  # still referenced
    assert mgr.list() == [f"{root}/step_00000004"]
