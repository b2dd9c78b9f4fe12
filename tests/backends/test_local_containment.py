"""Local disk keeps what a checkpoint points at inside its root: no read, write or delete goes
through a symbolic link below the root, and nothing but a regular file is ever read (a FIFO or
a device is refused at once, never waited on).

Each test checks that nothing outside the root was read, changed or deleted.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import statereg
from statereg.backends.local import LocalBackend

pytestmark = pytest.mark.timeout(30)  # a read that blocks on a FIFO fails instead of hanging

OUTSIDE = b"bytes that live outside the checkpoint root\n"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    root.mkdir()
    return root


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory beside the root, with one file in it."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "data.distcp").write_bytes(OUTSIDE)
    (elsewhere / "manifest.json").write_bytes(b"{}")
    return elsewhere


def within(seconds: float, operation: Callable[[], Any]) -> Any:
    """Run `operation` in a thread; fail (never hang) if it has not returned in time."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = operation()
        except BaseException as exc:  # re-raised in the test's thread
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the operation blocked for more than {seconds} s"
    if "error" in result:
        raise result["error"]
    return result["value"]


def refused(kind: str, where: str) -> str:
    return rf"^{re.escape(where)} is {re.escape(kind)}, not a regular file inside the checkpoint"


def test_a_step_directory_linked_out_of_the_root_is_never_read(root, outside):
    (root / "step_00000001").symlink_to(outside, target_is_directory=True)
    backend = LocalBackend(str(root))
    where = f"{root}/step_00000001"

    with pytest.raises(statereg.CorruptCheckpointError, match=refused("a symbolic link", where)):
        backend.read_bytes("step_00000001/manifest.json")
    with (pytest.raises(statereg.CorruptCheckpointError, match=refused("a symbolic link", where)),
          backend.open_read("step_00000001/data.distcp")):
        pass
    with pytest.raises(statereg.CorruptCheckpointError, match=refused("a symbolic link", where)):
        backend.list_dir("step_00000001")
    with pytest.raises(statereg.CorruptCheckpointError, match=refused("a symbolic link", where)):
        backend.exists("step_00000001/manifest.json")

    assert backend.list_dir("") == []  # the link is no checkpoint of this root
    assert [(f.path, f.kind) for f in backend.walk("")] == [("step_00000001", "symlink")]
    assert [(f.path, f.kind) for f in backend.walk("step_00000001")] == [
        ("step_00000001", "symlink")]


def test_nothing_is_written_through_a_linked_step_directory(root, outside):
    (root / "step_00000001").symlink_to(outside, target_is_directory=True)
    backend = LocalBackend(str(root))
    message = (rf"^exclusive write refused for {re.escape(str(root))}/step_00000001/\.claim-0: "
               rf"{re.escape(str(root))}/step_00000001 is a symbolic link")

    with pytest.raises(statereg.StorageError, match=message):
        backend.create_bytes("step_00000001/.claim-0", b"claim")
    with pytest.raises(statereg.StorageError, match=r"create refused .* is a symbolic link"):
        backend.write_bytes("step_00000001/manifest.json", b"{}")
    with pytest.raises(statereg.StorageError, match=r"mkdir refused .* is a symbolic link"):
        backend.makedirs("step_00000001/model")

    assert sorted(p.name for p in outside.iterdir()) == ["data.distcp", "manifest.json"]
    assert (outside / "manifest.json").read_bytes() == b"{}"


def test_a_file_left_as_a_link_is_replaced_never_written_through(root, outside):
    (root / "step_00000001").mkdir()
    (root / "step_00000001" / "data.distcp").symlink_to(outside / "data.distcp")
    backend = LocalBackend(str(root))

    with pytest.raises(statereg.StorageError, match=r"create failed .*data\.distcp"):
        backend.open_write("step_00000001/data.distcp")  # O_NOFOLLOW: the open itself fails
    (root / "latest").symlink_to(outside / "data.distcp")
    backend.write_bytes("latest", b"step_00000001")  # a rename replaces the link itself

    assert (root / "latest").read_bytes() == b"step_00000001"
    assert not (root / "latest").is_symlink()
    assert (outside / "data.distcp").read_bytes() == OUTSIDE


def test_deleting_a_linked_step_directory_removes_the_link_only(root, outside):
    (root / "step_00000001").symlink_to(outside, target_is_directory=True)
    backend = LocalBackend(str(root))

    backend.remove_tree("step_00000001")

    assert not os.path.lexists(root / "step_00000001")
    assert (outside / "data.distcp").read_bytes() == OUTSIDE
    assert (outside / "manifest.json").exists()


def test_deleting_a_tree_never_recurses_into_a_linked_directory(root, outside):
    step = root / "step_00000001"
    (step / "model").mkdir(parents=True)
    (step / "model" / "__0_0.distcp").write_bytes(b"mine")
    (step / "model" / "shards").symlink_to(outside, target_is_directory=True)
    (step / "model" / "linked.distcp").symlink_to(outside / "data.distcp")
    backend = LocalBackend(str(root))

    with pytest.raises(statereg.StorageError, match=r"delete refused .* is a symbolic link"):
        backend.remove_tree("step_00000001/model/shards/data.distcp")
    backend.remove_file("step_00000001/model/linked.distcp")
    backend.remove_tree("step_00000001")

    assert not step.exists()
    assert (outside / "data.distcp").read_bytes() == OUTSIDE
    assert sorted(p.name for p in outside.iterdir()) == ["data.distcp", "manifest.json"]


def test_a_data_file_linked_to_a_file_outside_the_root_is_refused(root, outside):
    (root / "step_00000001" / "model").mkdir(parents=True)
    (root / "step_00000001" / "model" / "__0_0.distcp").symlink_to(outside / "data.distcp")
    backend = LocalBackend(str(root))
    where = f"{root}/step_00000001/model/__0_0.distcp"

    with pytest.raises(statereg.CorruptCheckpointError, match=refused("a symbolic link", where)):
        backend.read_bytes("step_00000001/model/__0_0.distcp")
    with (pytest.raises(statereg.CorruptCheckpointError, match=refused("a symbolic link", where)),
          backend.open_read("step_00000001/model/__0_0.distcp", size=len(OUTSIDE))):
        pass
    assert [(f.path, f.size, f.kind) for f in backend.walk("step_00000001")] == [
        ("step_00000001/model/__0_0.distcp", 0, "symlink")]
    assert backend.list_dir("step_00000001/model") == []


def test_a_link_to_dev_zero_is_refused_at_once(root):
    (root / "step_00000001").mkdir()
    (root / "step_00000001" / "__0_0.distcp").symlink_to("/dev/zero")
    backend = LocalBackend(str(root))

    with pytest.raises(statereg.CorruptCheckpointError, match="is a symbolic link"):
        within(5, lambda: backend.read_bytes("step_00000001/__0_0.distcp"))


@pytest.mark.parametrize("name", ["step_00000001/model/__0_0.distcp",
                                  "step_00000001/manifest.json", "latest"])
def test_a_fifo_is_refused_at_once_never_waited_on(root, name):
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(root / name)  # no writer: a plain open() for reading would block forever
    backend = LocalBackend(str(root))
    where = f"{root}/{name}"

    with pytest.raises(statereg.CorruptCheckpointError,
                       match=refused("a named pipe (FIFO)", where)):
        within(5, lambda: backend.read_bytes(name))
    with pytest.raises(statereg.CorruptCheckpointError,
                       match=refused("a named pipe (FIFO)", where)):
        within(5, lambda: backend.read_bytes(name, limit=64))

    def open_it() -> None:
        with backend.open_read(name):
            pass

    with pytest.raises(statereg.CorruptCheckpointError, match="a named pipe"):
        within(5, open_it)
    assert [(f.path, f.kind) for f in within(5, lambda: backend.walk(""))] == [(name, "fifo")]
    backend.remove_tree(name.split("/", 1)[0])  # deleting a FIFO does not open it
    assert not os.path.lexists(root / name)


def test_a_root_that_is_itself_a_link_is_used_as_given(tmp_path, outside):
    # The user chose the root: a link to the real disk (e.g. /checkpoints -> /mnt/nvme) works.
    (tmp_path / "chosen").symlink_to(outside, target_is_directory=True)
    backend = LocalBackend(str(tmp_path / "chosen"))

    assert backend.read_bytes("data.distcp") == OUTSIDE
    assert [f.path for f in backend.walk("")] == ["data.distcp", "manifest.json"]
    assert backend.list_dir("") == ["data.distcp", "manifest.json"]
