"""statereg.list_checkpoints and statereg.latest: a run's checkpoints found without a
declaration, by a process that did not write them."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from torch import nn

import statereg
from statereg.errors import CheckpointNotFoundError, CorruptCheckpointError

SAVER = textwrap.dedent("""
    import sys
    from torch import nn
    import statereg

    spec = {"storage": {"url": sys.argv[1]},
            "components": {"model": {"kind": "model"}, "rng": {"kind": "rng"}}}
    with statereg.CheckpointManager(spec, model=nn.Linear(4, 3)) as mgr:
        for step in (10, 20, 30):
            mgr.save(step=step, tokens_seen=step * 64, extra={"eval_loss": 3.0 / step})
""")


@pytest.fixture(scope="module")
def saved_elsewhere(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root three checkpoints were saved to by another process."""
    root = tmp_path_factory.mktemp("listing") / "run"
    done = subprocess.run([sys.executable, "-c", SAVER, str(root)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return root


def _damage_newest(root: Path, tmp_path: Path) -> Path:
    """A copy of the root whose newest checkpoint lost bytes of a tensor file."""
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(root, copy)
    victim = next((copy / "step_00000030" / "model").glob("*.distcp"))
    victim.write_bytes(victim.read_bytes()[:-1])
    return copy


def test_latest_is_the_newest_checkpoint_another_process_saved(saved_elsewhere: Path) -> None:
    found = statereg.latest(saved_elsewhere)
    assert found is not None
    assert (found.step, found.tokens_seen, found.extra) == (30, 30 * 64, {"eval_loss": 0.1})
    assert found.path == str(saved_elsewhere / "step_00000030")
    assert found.name == "step_00000030" and found.components == ("model", "rng")
    assert found.damage is None
    assert found.total_bytes == found.manifest.total_bytes > 0
    # What it returns is what a load takes.
    model = nn.Linear(4, 3)
    spec = {"storage": {"url": str(saved_elsewhere)}, "components": {"model": {"kind": "model"}}}
    with statereg.CheckpointManager(spec, model=model) as mgr:
        assert mgr.load(found.path).step == 30


def test_list_checkpoints_is_every_committed_one_oldest_first(saved_elsewhere: Path) -> None:
    listed = statereg.list_checkpoints(str(saved_elsewhere))
    assert [c.step for c in listed] == [10, 20, 30]
    best = min(listed, key=lambda c: c.extra["eval_loss"])
    assert best.name == "step_00000030"


def test_a_damaged_newest_checkpoint_is_skipped_when_intact_and_named_when_not(
    saved_elsewhere: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    root = _damage_newest(saved_elsewhere, tmp_path)
    with caplog.at_level(logging.WARNING, logger="statereg"):
        found = statereg.latest(root)
    assert found is not None and found.step == 20
    assert any("step_00000030" in r.getMessage() for r in caplog.records)
    assert [c.step for c in statereg.list_checkpoints(root)] == [10, 20]

    newest = statereg.latest(root, intact=False)
    assert newest is not None and newest.step == 30
    assert newest.damage is not None and "model/" in newest.damage
    listed = statereg.list_checkpoints(root, intact=False)
    assert [(c.step, c.damage is None) for c in listed] == [(10, True), (20, True), (30, False)]


def test_a_root_of_damaged_checkpoints_only_raises_rather_than_looking_empty(
    saved_elsewhere: Path, tmp_path: Path,
) -> None:
    root = _damage_newest(saved_elsewhere, tmp_path)
    for name in ("step_00000010", "step_00000020"):
        victim = next((root / name / "model").glob("*.distcp"))
        victim.write_bytes(victim.read_bytes()[:-1])
    with pytest.raises(CorruptCheckpointError, match="step_00000030"):
        statereg.latest(root)


def test_an_empty_root_has_no_latest_and_a_missing_one_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert statereg.latest(tmp_path / "empty") is None
    assert statereg.list_checkpoints(tmp_path / "empty") == []
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        statereg.latest(tmp_path / "misspelled")


def test_the_read_api_imports_no_torch(saved_elsewhere: Path) -> None:
    code = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None
        import statereg
        print(statereg.latest({str(saved_elsewhere)!r}).step,
              len(statereg.list_checkpoints({str(saved_elsewhere)!r})))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["30", "3"]


def test_storage_options_reach_the_store(request: pytest.FixtureRequest,
                                         tmp_path: Path) -> None:
    """On S3 (a local test server) the endpoint and keys come as keyword options."""
    from tests.conftest import make_store

    store = make_store("s3", request, tmp_path)
    spec = {"storage": {"url": store.url, "options": store.options},
            "components": {"model": {"kind": "model"}}}
    with statereg.CheckpointManager(spec, model=nn.Linear(4, 3)) as mgr:
        mgr.save(step=7)
    found = statereg.latest(store.url, **store.options)
    assert found is not None and found.path == f"{store.url}/step_00000007"
    assert [c.step for c in statereg.list_checkpoints(store.url, **store.options)] == [7]
