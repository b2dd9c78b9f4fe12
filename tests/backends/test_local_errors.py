"""A local root that refuses writes says why: a read-only filesystem or missing permission,
not "check the credentials in storage.options" (which only means something for object
stores), and what was saved before still loads."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from unwritable import unwritable

import statereg
from statereg.backends.registry import open_backend
from statereg.errors import StorageError

SPEC = {"components": {"model": {"kind": "model"}}}


def manager(root: Path, model: torch.nn.Module) -> statereg.CheckpointManager:
    return statereg.CheckpointManager({**SPEC, "storage": {"url": str(root)}}, model=model)


@pytest.fixture
def read_only_root(tmp_path: Path) -> Iterator[Path]:
    """A real read-only filesystem (a tmpfs mounted ro), where this user may mount one."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1M", "tmpfs",
                              str(folder)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


def test_a_read_only_filesystem_is_named_as_such(read_only_root: Path) -> None:
    with pytest.raises(StorageError) as refused:
        manager(read_only_root / "ck", torch.nn.Linear(2, 2)).save(1)
    text = str(refused.value)
    assert "Read-only file system" in text
    assert "The filesystem is mounted read-only: save to a writable root" in text
    assert "credentials" not in text


def test_a_folder_this_user_may_not_write_says_to_check_permissions_and_keeps_the_last(
        tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    mgr = manager(tmp_path, model)
    mgr.save(1)
    saved = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1)
    with unwritable(tmp_path), pytest.raises(StorageError) as refused:
        mgr.save(2)
    text = str(refused.value)
    assert "This user may not write there: check the folder's owner and permissions" in text
    assert "credentials" not in text
    restored = torch.nn.Linear(4, 4)
    result = manager(tmp_path, restored).load()
    assert result is not None and result.step == 1
    assert torch.equal(restored.weight, saved)


def test_an_error_about_the_entry_itself_does_not_blame_access(tmp_path: Path) -> None:
    # Issue 41, item 3: deleting a folder as a file is no outage and no credentials problem.
    backend = open_backend(str(tmp_path))
    (tmp_path / "folder").mkdir()
    with pytest.raises(StorageError) as refused:
        backend.remove_file("folder")
    text = str(refused.value)
    assert "Is a directory" in text
    assert "credentials" not in text and "reachable" not in text


def test_a_local_failure_never_blames_credentials(tmp_path: Path) -> None:
    # A local folder has no credentials: an I/O error names the filesystem instead.
    import errno

    backend = open_backend(str(tmp_path))
    with pytest.raises(StorageError) as failed, backend._storage_op("delete", "x"):
        raise OSError(errno.EIO, "Input/output error")
    text = str(failed.value)
    assert "Input/output error" in text and "check the disk" in text
    assert "credentials" not in text
