"""Finding committed checkpoints (engine/checkpoints.py): a directory counts as a checkpoint
only once its manifest exists and parses; `latest` is a hint, never the only way to find one."""

from __future__ import annotations

import logging
import os
import shutil

import pytest

import statereg


def names(urls: list[str]) -> list[str]:
    return [u.rsplit("/", 1)[-1] for u in urls]


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
    # Listings check manifest.sum too (what load() would use): the damage is named there.
    assert any("step_00000002" in r.getMessage() and "the manifest is damaged" in r.getMessage()
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
