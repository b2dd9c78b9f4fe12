"""Retention (engine/retention.py): keep_last, keep_every and keep_best after each commit;
never the checkpoint `latest` names, never an uncommitted directory."""

from __future__ import annotations


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
