"""The memory tier on a node shared with another local user (issue 27): each user's memory
checkpoints live in a root only that user owns (`<shm>/statereg-<uid>`, 0700, files 0600),
and a tree another user made or linked there is refused before anything is read, written or
deleted, so the job never writes into, nor deletes from, storage.url through it.

Run as root: the other user is a forked child that drops to uid/gid 65534 (nobody). The
shared-memory folder is a fresh 1777 folder under /dev/shm, as /dev/shm itself is.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from other_user import OTHER, as_other_user
from tier_trainee import Trainee

from statereg.backends.registry import open_backend
from statereg.engine.checkpoints import list_committed
from statereg.errors import StorageError

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")

MINE = f"statereg-{os.geteuid()}"
COMPONENTS = {"model": {"kind": "model"}, "optimizer": {"kind": "optimizer"}}


@pytest.fixture(autouse=True)
def shm(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh shared-memory folder, mode 1777 like /dev/shm, on the real tmpfs."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    folder = Path(tempfile.mkdtemp(prefix="statereg-private-", dir=base))
    folder.chmod(0o1777)
    monkeypatch.setenv("STATEREG_SHM_DIR", str(folder))
    monkeypatch.setenv("STATEREG_NODE", "node0")
    monkeypatch.setenv("STATEREG_RUN_ID", "run7")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def tiered(url: str) -> dict[str, Any]:
    return {"storage": {"url": url}, "components": COMPONENTS,
            "tiers": {"memory": {"every": 2, "keep_last": 2},
                      "durable": {"every": 4, "keep_last": 2}}}


def trained(steps: int, url: str) -> tuple[Trainee, Any]:
    trainee = Trainee()
    mgr = trainee.manager(tiered(url))
    for step in range(1, steps + 1):
        trainee.step(step)
        mgr.save(step)
    mgr.wait()
    return trainee, mgr


def test_another_user_can_read_no_memory_checkpoint(shm: Path, tmp_path: Path) -> None:
    """Files 0600, folders 0700, the user's root 0700: uid 65534 reads nothing, lists
    nothing, not even identity.json (which names storage.url)."""
    _, mgr = trained(4, str(tmp_path / "durable"))
    memory = mgr._tiers.memory
    root = shm / MINE
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    paths = [root, *root.rglob("*")]
    files = [p for p in paths if p.is_file()]
    assert any(p.name == "identity.json" for p in files)
    assert any(p.suffix == ".distcp" for p in files)
    assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in files} == {"0o600"}
    assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in paths if p.is_dir()} == {"0o700"}

    def try_all() -> dict[str, str]:
        seen = {}
        for path in [*map(str, files), memory.root]:
            try:
                if os.path.isdir(path):
                    os.listdir(path)
                else:
                    with open(path, "rb") as stream:
                        stream.read(1)
                seen[path] = "read"
            except PermissionError:
                seen[path] = "denied"
        return seen

    seen = as_other_user(try_all)
    mgr.close()
    assert set(seen.values()) == {"denied"}, seen


def durable_with_checkpoints(tmp_path: Path) -> tuple[str, list[str]]:
    """A durable root holding two committed checkpoints of this job (no memory tier)."""
    url = str(tmp_path / "durable")
    trainee = Trainee()
    with trainee.manager({"storage": {"url": url}, "components": COMPONENTS}) as mgr:
        for step in (4, 8):
            trainee.step(step)
            mgr.save(step)
    return url, sorted(p.name for p in Path(url).iterdir())


def files_under(url: str) -> dict[str, bytes]:
    return {str(p.relative_to(url)): p.read_bytes() for p in Path(url).rglob("*")
            if p.is_file()}


@pytest.mark.parametrize("attack", ["link to storage.url", "folders of its own"])
def test_a_tree_made_first_by_another_user_is_refused_and_deletes_nothing(
        shm: Path, tmp_path: Path, attack: str) -> None:
    """uid 65534 makes this user's root before the job starts: as a link to the job's
    storage.url, or as folders of its own with the run's identity folder linked to
    storage.url. The job is refused at construction, naming the owner and
    $STATEREG_SHM_DIR, and storage.url is left as it was (byte for byte)."""
    url, names = durable_with_checkpoints(tmp_path)
    before = files_under(url)
    os.chmod(tmp_path, 0o755)  # the link's target only needs to exist

    def plant() -> str:
        mine = shm / MINE
        if attack == "link to storage.url":
            os.symlink(url, mine)
        else:
            (mine / "node0" / "run7").mkdir(parents=True)
            os.chmod(mine, 0o777)
            os.chmod(mine / "node0", 0o777)
            os.chmod(mine / "node0" / "run7", 0o777)
            os.symlink(url, mine / "node0" / "run7" / "ws1-0000000000000000")
        return str(mine)

    planted = as_other_user(plant)
    with pytest.raises(StorageError) as refused:
        trained(8, url)
    text = str(refused.value)
    assert f"memory tier: {planted} " in text
    assert f"uid {OTHER}" in text
    assert "$STATEREG_SHM_DIR" in text
    assert ("is a symbolic link" if attack == "link to storage.url"
            else f"is owned by uid {OTHER}, not by this user") in text
    assert sorted(p.name for p in Path(url).iterdir()) == names
    assert files_under(url) == before
    # statereg ls (a read-only open of the memory root) is refused the same way.
    with pytest.raises(StorageError, match=f"uid {OTHER}"):
        open_backend("shm://run7").list_dir("")


def test_another_user_cannot_relink_a_running_jobs_folders(shm: Path, tmp_path: Path) -> None:
    """Once the job's root exists, uid 65534 can neither swap a link in for the run folder
    nor rename the root away (the shared-memory folder is sticky); a restarted job resumes
    from memory, and storage.url keeps every checkpoint its retention keeps."""
    url = str(tmp_path / "durable")
    _, mgr = trained(8, url)
    run = mgr._tiers.memory.root
    mgr.close()
    os.chmod(tmp_path, 0o755)

    def relink() -> dict[str, str]:
        tried = {}
        for name, act in [("rename the run folder", lambda: os.rename(run, run + ".gone")),
                          ("link the run folder", lambda: os.symlink(url, run + ".x")),
                          ("rename the user's root",
                           lambda: os.rename(shm / MINE, shm / "stolen"))]:
            try:
                act()
                tried[name] = "done"
            except PermissionError:
                tried[name] = "denied"
        return tried

    assert set(as_other_user(relink).values()) == {"denied"}
    restored = Trainee(seed=1)
    with restored.manager(tiered(url)) as again:
        result = again.load()
    assert result is not None and result.step == 8 and result.path.startswith("shm://")
    assert [c.step for c in list_committed(open_backend(url))] == [4, 8]


def test_another_users_job_works_beside_this_one_in_its_own_root(
        shm: Path, tmp_path: Path) -> None:
    """Both users run the same script (same run id, node and shm folder) at once: the other
    user's job saves and resumes from memory in `statereg-65534`, this one's is untouched."""
    _, mgr = trained(4, str(tmp_path / "durable"))  # open: it holds its folder meanwhile
    theirs = Path(tempfile.mkdtemp(prefix="statereg-other-durable-"))
    os.chown(theirs, OTHER, OTHER)
    # Everything the child runs is imported here first (it may not read the interpreter's
    # folder): a resume from memory.
    warm = Trainee()
    with warm.manager(tiered(str(tmp_path / "warm"))) as warm_mgr:
        warm_mgr.load()

    def their_job() -> dict[str, Any]:
        trainee, job = trained(4, str(theirs / "durable"))
        job.close()
        again = Trainee(seed=1)
        with again.manager(tiered(str(theirs / "durable"))) as resumed:
            result = resumed.load()
        same = all(torch.equal(a, b) for a, b in zip(again.tensors().values(),
                                                     trainee.tensors().values(), strict=True))
        return {"step": result.step, "path": result.path, "root": resumed._tiers.memory.root,
                "same": same}

    try:
        got = as_other_user(their_job)
    finally:
        shutil.rmtree(theirs, ignore_errors=True)
    assert got["step"] == 4 and got["path"].startswith("shm://run7/") and got["same"]
    assert got["root"].startswith(f"{shm}/statereg-{OTHER}/node0/run7/")
    assert stat.S_IMODE((shm / f"statereg-{OTHER}").stat().st_mode) == 0o700
    assert [c.step for c in list_committed(mgr._tiers.memory)] == [2, 4]
    mgr.close()
