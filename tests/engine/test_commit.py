"""The commit protocol: files, then manifest.json, then `latest`; retention only after both.

A directory counts as a checkpoint only once its manifest exists and parses.
"""

from __future__ import annotations

import logging
import os
import shutil
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


def step_dirs(root) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step_"))


def names(urls: list[str]) -> list[str]:
    return [u.rsplit("/", 1)[-1] for u in urls]


@pytest.fixture
def root(tmp_path):
    return tmp_path / "ckpt"


@pytest.fixture
def manager(make_spec, make_model):
    """`manager(save={...}, ...)`: a CheckpointManager over a TinyNet rooted in tmp_path/ckpt."""

    def build(**sections):
        return statereg.CheckpointManager(make_spec("model", **sections), model=make_model())

    return build


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


# -- what counts as committed -------------------------------------------------------------


def test_a_directory_without_manifest_is_not_listed_or_loaded(manager, root):
    mgr = manager()
    mgr.save(step=1)
    shutil.copytree(root / "step_00000001", root / "step_00000002")
    os.remove(root / "step_00000002" / "manifest.json")

    assert names(mgr.list()) == ["step_00000001"]
    assert mgr.latest() == str(root / "step_00000001")
    assert mgr.load().step == 1
    with pytest.raises(statereg.CheckpointNotFoundError, match="never committed"):
        mgr.load(str(root / "step_00000002"))


def test_latest_naming_a_missing_checkpoint_falls_back_to_the_newest_committed(manager, root):
    mgr = manager()
    for step in (1, 2, 3):
        mgr.save(step=step)
    shutil.rmtree(root / "step_00000003")
    assert (root / "latest").read_text() == "step_00000003"

    assert mgr.latest() == str(root / "step_00000002")
    assert mgr.load().step == 2


def test_latest_naming_an_uncommitted_checkpoint_falls_back(manager, root):
    mgr = manager()
    mgr.save(step=1)
    mgr.save(step=2)
    os.remove(root / "step_00000002" / "manifest.json")

    assert mgr.latest() == str(root / "step_00000001")
    assert mgr.peek().step == 1


@pytest.mark.parametrize("content", ["", "garbage", "../step_00000001", "step_1"])
def test_an_unusable_latest_pointer_falls_back_to_the_newest(manager, root, content):
    mgr = manager()
    mgr.save(step=1)
    mgr.save(step=2)
    (root / "latest").write_text(content)

    assert mgr.latest() == str(root / "step_00000002")


def test_no_latest_pointer_at_all_still_finds_the_newest(manager, root):
    mgr = manager()
    mgr.save(step=5)
    mgr.save(step=10)
    os.remove(root / "latest")

    assert mgr.latest() == str(root / "step_00000010")


def test_an_unparsable_manifest_is_skipped_with_a_warning(manager, root, caplog):
    mgr = manager()
    mgr.save(step=1)
    mgr.save(step=2)
    (root / "step_00000002" / "manifest.json").write_text("{not json")

    with caplog.at_level(logging.WARNING, logger="statereg"):
        assert names(mgr.list()) == ["step_00000001"]
    assert any("step_00000002" in r.getMessage() and "not valid JSON" in r.getMessage()
               for r in caplog.records)


def test_an_empty_root_has_no_checkpoints(manager):
    mgr = manager()
    assert mgr.list() == []
    assert mgr.latest() is None
    assert mgr.load() is None
    assert mgr.peek() is None


def test_list_is_ordered_by_step_not_by_save_order(manager):
    mgr = manager()
    for step in (30, 4, 200):
        mgr.save(step=step)

    assert names(mgr.list()) == ["step_00000004", "step_00000030", "step_00000200"]


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


# -- retention ----------------------------------------------------------------------------


def test_keep_last_keeps_the_newest_n_and_deletes_the_rest_from_storage(manager, root):
    mgr = manager(save={"keep_last": 2})
    for step in range(1, 6):
        mgr.save(step=step)

    assert names(mgr.list()) == ["step_00000004", "step_00000005"]
    assert step_dirs(root) == ["step_00000004", "step_00000005"]


def test_without_keep_last_everything_is_kept(manager, root):
    mgr = manager(save={"keep_every": 2})
    for step in range(1, 5):
        mgr.save(step=step)

    assert len(step_dirs(root)) == 4


def test_keep_every_also_keeps_multiples(manager, root):
    mgr = manager(save={"keep_last": 1, "keep_every": 2})
    for step in range(1, 6):
        mgr.save(step=step)

    assert step_dirs(root) == ["step_00000002", "step_00000004", "step_00000005"]


def test_keep_best_keeps_the_lowest_metric_and_best_lists_them_best_first(manager, root):
    mgr = manager(save={"keep_last": 1, "keep_best": {"metric": "loss", "count": 2}})
    for step, loss in zip(range(1, 6), [3.0, 1.0, 2.0, 5.0, 4.0], strict=True):
        mgr.save(step=step, extra={"loss": loss})

    assert step_dirs(root) == ["step_00000002", "step_00000003", "step_00000005"]
    assert names(mgr.best()) == ["step_00000002", "step_00000003"]


def test_keep_best_max_mode_keeps_the_highest(manager, root):
    mgr = manager(save={"keep_last": 1, "keep_best": {"metric": "acc", "mode": "max"}})
    for step, acc in zip(range(1, 5), [0.5, 0.9, 0.7, 0.6], strict=True):
        mgr.save(step=step, extra={"acc": acc})

    assert step_dirs(root) == ["step_00000002", "step_00000004"]
    assert names(mgr.best()) == ["step_00000002"]


def test_keep_best_ignores_checkpoints_without_the_metric(manager, root):
    mgr = manager(save={"keep_last": 1, "keep_best": {"metric": "loss"}})
    mgr.save(step=1)
    mgr.save(step=2, extra={"loss": 9.0})
    mgr.save(step=3)

    assert names(mgr.best()) == ["step_00000002"]
    assert step_dirs(root) == ["step_00000002", "step_00000003"]


def test_best_is_empty_without_keep_best(manager):
    mgr = manager()
    mgr.save(step=1, extra={"loss": 1.0})
    assert mgr.best() == []


def test_retention_never_deletes_the_checkpoint_latest_names(manager, root):
    mgr = manager(save={"keep_last": 1})
    mgr.save(step=10)
    mgr.save(step=5)  # e.g. a rollback: `latest` now names a checkpoint that is not the newest

    latest = (root / "latest").read_text()
    assert latest == "step_00000005"
    assert latest in step_dirs(root)
    assert "step_00000010" in step_dirs(root)


def test_retention_leaves_uncommitted_directories_alone(manager, root):
    mgr = manager(save={"keep_last": 1})
    mgr.save(step=1)
    (root / "step_00000002").mkdir()
    (root / "step_00000002" / "partial.bin").write_bytes(b"...")
    mgr.save(step=3)

    assert step_dirs(root) == ["step_00000002", "step_00000003"]
    assert (root / "step_00000002" / "partial.bin").exists()
