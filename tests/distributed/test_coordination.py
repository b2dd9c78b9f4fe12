"""Coordination on many ranks: disagreement fails fast, one rank's failure fails every rank,
nothing is committed, and async saves commit the state as of save() (with early_return, once
the loop waited for wait_staged() before changing it), on local disk and on an object store."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from torch import nn

import statereg
from statereg.backends import register_backend
from statereg.backends.local import LocalBackend


class FlakyDiskBackend(LocalBackend):
    """Local disk whose DCP data writes fail on rank 1 while `broken` is set (a full disk)."""

    schemes = ("flaky",)
    broken = False

    def _open_filesystem(self, url: str, options: dict) -> tuple:
        return super()._open_filesystem(url.removeprefix("flaky://"), options)

    def open_write(self, path: str, on_done=None):
        if FlakyDiskBackend.broken and dist.get_rank() == 1 and path.endswith(".distcp"):
            with self._storage_op("create", path):
                raise OSError(28, "No space left on device", path)
        return super().open_write(path, on_done)


def _spec(url: str, options: dict[str, Any] | None = None, **save: object) -> dict:
    return {"storage": {"url": url, "options": options or {}},
            "components": {"model": {"kind": "model"}, "rng": {"kind": "rng"}},
            "save": save}


def mismatched_keys(rank: int, world: int, root: Path) -> None:
    layers = [nn.Linear(4, 4), nn.Linear(4, 4)] + ([nn.Linear(4, 2)] if rank == 1 else [])
    mgr = statereg.CheckpointManager(_spec(str(root)), model=nn.Sequential(*layers))
    started = time.monotonic()
    with pytest.raises(statereg.SpecError) as info:
        mgr.save(step=1)
    assert time.monotonic() - started < 30  # an error, not a hang in a DCP collective
    message = str(info.value)
    assert "rank 1 differs from rank 0" in message
    assert "'2.weight'" in message and "'2.bias'" in message


def test_ranks_with_different_keys_fail_fast_naming_rank_and_keys(tmp_path: Path) -> None:
    run_ranks(2, mismatched_keys, tmp_path, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt" / "step_00000001").exists()


def one_rank_fails_mid_write(rank: int, world: int, root: Path) -> None:
    register_backend(FlakyDiskBackend)
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    mgr = statereg.CheckpointManager(_spec(f"flaky://{root}"), model=model)
    mgr.save(step=1)
    good = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    FlakyDiskBackend.broken = True
    with pytest.raises(statereg.StateregError) as info:
        mgr.save(step=2)
    FlakyDiskBackend.broken = False
    assert "No space left on device" in str(info.value)
    # The failing rank raises its own StorageError; the others name the rank that failed.
    if rank == 1:
        assert isinstance(info.value, statereg.StorageError)
        assert "step_00000002/model/__1_0.distcp" in str(info.value)
    else:
        assert "rank 1" in str(info.value)
    dist.barrier()
    assert not (root / "step_00000002" / "manifest.json").exists()
    assert (root / "latest").read_text() == "step_00000001"
    assert [u.rsplit("/", 1)[-1] for u in mgr.list()] == ["step_00000001"]
    assert mgr.load().step == 1
    for key, value in good.items():
        assert torch.equal(model.state_dict()[key], value)
    mgr.save(step=2)  # the next save succeeds, over the failed one's leftovers
    assert mgr.load().step == 2


def test_a_rank_failing_mid_write_fails_every_rank_and_commits_nothing(tmp_path: Path) -> None:
    run_ranks(2, one_rank_fails_mid_write, tmp_path, tmp_path / "ckpt")


def async_save_keeps_pre_update_values(rank: int, world: int, url: str, options: dict,
                                       save: dict) -> None:
    torch.manual_seed(0)
    model = nn.Linear(256, 256)
    mgr = statereg.CheckpointManager(_spec(url, options, **save), model=model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for step in (1, 2):
        handle = mgr.save(step=step)
        assert handle == f"{url}/step_{step:08d}"  # still the URL, as a str
        handle.wait_staged()  # early_return: the copy is done; otherwise returns at once
        with torch.no_grad():  # the loop goes on at once, mutating weights in place
            model.weight.mul_(-3.0)
            model.bias.zero_()
        mgr.wait()
        fresh = nn.Linear(256, 256)
        statereg.CheckpointManager(_spec(url, options), model=fresh).load(step=step)
        for key, value in before.items():
            assert torch.equal(fresh.state_dict()[key], value), (step, key)
        before = {k: v.clone() for k, v in model.state_dict().items()}
    mgr.close()


@pytest.mark.parametrize(("store", "save"), [
    ("local", {"async": "thread"}),
    ("s3", {"async": "thread"}),
    ("local", {"async": "thread", "early_return": True}),
], indirect=["store"], ids=["local-thread", "s3-thread", "local-early_return"])
def test_async_save_commits_the_state_as_of_save_on_every_rank(store, save: dict,
                                                               tmp_path: Path) -> None:
    run_ranks(2, async_save_keeps_pre_update_values, tmp_path, store.url, store.options, save)
    statereg.verify(f"{store.url}/step_00000002", store.options)


def staging_failure_is_raised_later(rank: int, world: int, root: Path) -> None:
    # Rank 1's weights have no data (meta device), so copying them to host buffers fails
    # in the background, after save() has returned.
    model = nn.Linear(64, 64, device="meta" if rank == 1 else "cpu")
    spec = _spec(str(root), **{"async": "thread", "early_return": True})
    mgr = statereg.CheckpointManager(spec, model=model)
    # The failing rank raises its own error; the other names rank 1 and what failed.
    failure = NotImplementedError if rank == 1 else statereg.StateregError
    match = "Cannot copy out of meta tensor" if rank == 1 else "rank 1: NotImplementedError"

    handle = mgr.save(step=1)
    with pytest.raises(failure, match=match):
        handle.wait_staged()
    with pytest.raises(failure, match=match):
        mgr.wait()
    mgr.save(step=2)
    with pytest.raises(failure, match=match):
        mgr.save(step=3)  # raises the pending save's failure before it starts
    assert mgr.list() == []
    assert not (root / "latest").exists()

    if rank == 1:
        model.to_empty(device="cpu")
    mgr.save(step=4)
    mgr.wait()
    assert [u.rsplit("/", 1)[-1] for u in mgr.list()] == ["step_00000004"]
    mgr.close()


def test_a_failure_of_background_staging_is_raised_by_wait_staged_wait_and_next_save(
        tmp_path: Path) -> None:
    run_ranks(2, staging_failure_is_raised_later, tmp_path, tmp_path / "ckpt")


def logs_once(rank: int, world: int, root: Path) -> None:
    import logging

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("statereg")
    logger.addHandler(Keep(logging.INFO))
    logger.setLevel(logging.INFO)
    spec = {"storage": {"url": str(root)}, "components": {"model": {"kind": "model"}}}
    with statereg.CheckpointManager(spec, model=nn.Linear(4, 4)) as mgr:
        assert mgr.load() is None
        mgr.save(step=1)
        mgr.load()
    if rank == 0:
        assert any(m.endswith(": starting fresh") for m in records), records
        assert any(m.startswith("saved ") and f"on {world} rank(s)" in m for m in records)
        assert any(m.startswith("loaded ") and f"on {world} rank(s)" in m for m in records)
    else:
        assert records == [], records  # one line per job, not one per rank


def test_save_and_load_log_once_per_job_with_the_rank_count(tmp_path: Path) -> None:
    run_ranks(2, logs_once, tmp_path, tmp_path / "ckpt")
