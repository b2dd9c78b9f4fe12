"""Publishing (engine/publish.py): files, then manifest.sum and manifest.json, then `latest`;
a save that fails before its manifest commits nothing."""

from __future__ import annotations

import threading

import pytest
import torch

import statereg


class Stats:
    """A custom component: a counter and, when asked, a value that cannot be pickled."""

    def __init__(self, poison: object = None) -> None:
        self.count = torch.arange(4.0)
        self.poison = poison

    def state_dict(self) -> dict:
        state: dict = {"count": self.count}
        if self.poison is not None:
            state["poison"] = self.poison
        return state

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


class PickleFailsOffMainThread:
    """Pickles fine on the main thread and fails on any other, like a write that hits a full disk
    in one of DCP's writer threads but not in the caller's."""

    def __reduce__(self):
        if threading.current_thread() is not threading.main_thread():
            raise OSError("No space left on device")
        return (PickleFailsOffMainThread, ())


class FailsInWriterThread:
    """A custom component with two such values: DCP puts one in each of its two write buckets,
    so whichever bucket its extra writer thread takes fails and the caller's thread succeeds."""

    def state_dict(self) -> dict:
        return {"a": PickleFailsOffMainThread(), "b": PickleFailsOffMainThread()}

    def load_state_dict(self, state: dict) -> None:
        pass


def names(urls: list[str]) -> list[str]:
    return [u.rsplit("/", 1)[-1] for u in urls]


# -- order of writes ----------------------------------------------------------------------


def test_manifest_is_written_after_every_file_and_latest_after_the_manifest(manager, root):
    url = manager().save(step=7)

    ckpt = root / "step_00000007"
    assert url == str(ckpt)
    manifest_time = (ckpt / "manifest.json").stat().st_mtime_ns
    files = [p for p in ckpt.rglob("*") if p.is_file() and p.name != "manifest.json"]
    assert {p.relative_to(ckpt).as_posix() for p in files} == {
        f.path for f in statereg.read_manifest(url).files
    } | {"manifest.sum"}  # the manifest's own checksum, written just before it
    assert all(p.stat().st_mtime_ns <= manifest_time for p in files)
    assert (root / "latest").stat().st_mtime_ns >= manifest_time
    assert (root / "latest").read_text() == "step_00000007"


def test_manifest_records_every_file_with_its_size(manager, root):
    url = manager().save(step=1, tokens_seen=1024, extra={"loss": 0.5})

    manifest = statereg.read_manifest(url)
    assert manifest.step == 1
    assert manifest.tokens_seen == 1024
    assert manifest.extra == {"loss": 0.5}
    for record in manifest.files:
        assert (root / "step_00000001" / record.path).stat().st_size == record.size
    assert set(manifest.components["model"].files) == {f.path for f in manifest.files}


def test_no_temporary_files_are_left_behind(manager, root):
    manager().save(step=1)
    leftovers = [p.name for p in root.rglob("*") if ".tmp" in p.name]
    assert leftovers == []


# -- interrupted saves --------------------------------------------------------------------


def test_a_save_that_fails_while_writing_commits_nothing(make_spec, make_model, root):
    stats = Stats()
    spec = make_spec("model", components={"stats": {"kind": "custom", "format": "dcp"}},
                     storage={"io_threads": 1})
    mgr = statereg.CheckpointManager(spec, model=make_model(), stats=stats)
    mgr.save(step=1)

    stats.poison = lambda: None  # cannot be pickled: the write fails after the model is written
    with pytest.raises(BaseException):  # noqa: B017 - the error type is specified elsewhere
        mgr.save(step=2)

    assert not (root / "step_00000002" / "manifest.json").exists()
    assert names(mgr.list()) == ["step_00000001"]
    assert (root / "latest").read_text() == "step_00000001"
    stats.poison = None
    assert mgr.load().step == 1


def test_a_write_failing_in_a_writer_thread_commits_nothing(make_spec, make_model, root):
    spec = make_spec("model", components={"stats": {"kind": "custom", "format": "dcp"}},
                     storage={"io_threads": 2})
    mgr = statereg.CheckpointManager(spec, model=make_model(), stats=FailsInWriterThread())

    with pytest.raises(BaseException, match="No space left on device"):
        mgr.save(step=1)
    assert mgr.list() == []
    assert not (root / "step_00000001" / "manifest.json").exists()


def test_leftovers_of_an_interrupted_save_of_the_same_step_are_cleared(manager, root):
    leftover = root / "step_00000003"
    (leftover / "model").mkdir(parents=True)
    (leftover / "model" / "__0_0.distcp").write_bytes(b"half written")
    (leftover / "stale.bin").write_bytes(b"x" * 10)

    mgr = manager()
    url = mgr.save(step=3)

    assert not (leftover / "stale.bin").exists()
    assert (leftover / "manifest.json").is_file()
    on_disk = {p.relative_to(leftover).as_posix() for p in leftover.rglob("*") if p.is_file()}
    assert on_disk == {f.path for f in statereg.read_manifest(url).files} | {
        "manifest.json", "manifest.sum"}
    statereg.verify(url)
    assert mgr.load().step == 3


def test_saving_an_already_committed_step_raises_and_changes_nothing(manager, root):
    mgr = manager()
    url = mgr.save(step=4)
    before = (root / "step_00000004" / "manifest.json").read_bytes()

    with pytest.raises(statereg.CheckpointExistsError) as info:
        mgr.save(step=4)

    assert str(root / "step_00000004") in str(info.value)
    assert "already a committed checkpoint" in str(info.value)
    assert (root / "step_00000004" / "manifest.json").read_bytes() == before
    statereg.verify(url)


def test_checkpoint_exists_error_is_a_file_exists_error():
    assert issubclass(statereg.CheckpointExistsError, FileExistsError)
    assert issubclass(statereg.CheckpointExistsError, statereg.StateregError)
