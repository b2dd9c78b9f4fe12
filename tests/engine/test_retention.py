"""Retention (engine/retention.py): keep_last, keep_every and keep_best after each commit;
never the checkpoint `latest` names, never an uncommitted directory."""

from __future__ import annotations

import pytest
import torch

import statereg


def step_dirs(root) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step_"))


def names(urls: list[str]) -> list[str]:
    return [u.rsplit("/", 1)[-1] for u in urls]


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


def test_a_lower_step_saved_later_is_kept_but_resume_goes_by_step(manager, root):
    mgr = manager(save={"keep_last": 1})
    mgr.save(step=10)
    mgr.save(step=5)  # e.g. a rollback: a lower step saved after a higher one

    # Step order, not save order: `latest` keeps naming the higher step, and load() resumes
    # from it; retention never deletes the checkpoint the save just wrote.
    assert (root / "latest").read_text() == "step_00000010"
    assert step_dirs(root) == ["step_00000005", "step_00000010"]
    assert mgr.load().step == 10
    assert mgr.load(step=5).step == 5


def test_retention_leaves_uncommitted_directories_alone(manager, root):
    mgr = manager(save={"keep_last": 1})
    mgr.save(step=1)
    (root / "step_00000002").mkdir()
    (root / "step_00000002" / "partial.bin").write_bytes(b"...")
    mgr.save(step=3)

    assert step_dirs(root) == ["step_00000002", "step_00000003"]
    assert (root / "step_00000002" / "partial.bin").exists()


def data_file(root, step: int):
    return sorted((root / f"step_{step:08d}" / "model").glob("*.distcp"))[0]


@pytest.mark.parametrize("damage", ["truncated", "deleted"])
def test_a_damaged_newer_checkpoint_never_pushes_an_intact_older_one_out(manager, root,
                                                                         damage, caplog):
    """Issue 25, case 1: step 2's data file is truncated or deleted; saving step 3 keeps the
    intact step 1 (keep_last counts only intact checkpoints) and leaves damaged step 2 for
    the user (gc reports it); list() and a resume skip step 2."""
    mgr = manager(save={"keep_last": 2})
    mgr.save(step=1)
    mgr.save(step=2)
    target = data_file(root, 2)
    if damage == "truncated":
        target.write_bytes(target.read_bytes()[:-7])
    else:
        target.unlink()

    mgr.save(step=3)

    assert step_dirs(root) == ["step_00000001", "step_00000002", "step_00000003"]
    assert (root / "step_00000002" / "manifest.json").exists()  # never deleted either
    assert names(mgr.list()) == ["step_00000001", "step_00000003"]
    assert str(target.relative_to(root)) in caplog.text
    mgr.save(step=4)  # now two intact newer ones: step 1 goes, damaged step 2 stays
    assert step_dirs(root) == ["step_00000002", "step_00000003", "step_00000004"]
    statereg.verify(str(root / "step_00000003"))
    with pytest.raises(statereg.CorruptCheckpointError, match=target.name):
        statereg.verify(str(root / "step_00000002"))


def test_a_resume_skips_a_checkpoint_with_a_missing_file_by_its_listing(manager, root,
                                                                       make_model):
    mgr = manager(save={"keep_last": 5})
    mgr.save(step=1)
    expected = {k: v.clone() for k, v in mgr._objects["model"].state_dict().items()}
    with torch.no_grad():
        for p in mgr._objects["model"].parameters():
            p.add_(1.0)
    mgr.save(step=2)
    data_file(root, 2).unlink()

    fresh = statereg.CheckpointManager(mgr.spec, model=make_model(seed=7))
    assert fresh.load().step == 1
    assert names([fresh.latest()]) == ["step_00000001"]
    got = fresh._objects["model"].state_dict()
    assert all(torch.equal(got[k], v) for k, v in expected.items())


def test_when_every_checkpoint_is_damaged_a_resume_names_the_newest_damage(manager, root):
    mgr = manager(save={"keep_last": 5})
    mgr.save(step=1)
    mgr.save(step=2)
    data_file(root, 1).unlink()
    data_file(root, 2).write_bytes(b"")

    with pytest.raises(statereg.CorruptCheckpointError,
                       match=r"step_00000002/model/__0_0\.distcp has 0 bytes"):
        manager().load()


def test_keep_best_and_keep_every_count_only_intact_checkpoints(manager, root):
    mgr = manager(save={"keep_last": 1, "keep_every": 2,
                        "keep_best": {"metric": "loss", "count": 1}})
    for step, loss in ((1, 1.0), (2, 9.0), (3, 2.0)):
        mgr.save(step=step, extra={"loss": loss})
    data_file(root, 1).write_bytes(b"x")  # the best one is damaged
    mgr.save(step=5, extra={"loss": 8.0})

    # Best among intact ones is step 3 (loss 2.0): kept; damaged step 1 is neither counted
    # nor deleted; milestone 2 stays.
    assert step_dirs(root) == ["step_00000001", "step_00000002", "step_00000003",
                               "step_00000005"]
    assert names(mgr.best()) == ["step_00000003"]
