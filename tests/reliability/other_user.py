"""Run a function as a real second user (uid/gid 65534, nobody) in a forked child, for the
tests of entries on a shared root that this run cannot read. Tests run as root, which reads
everything: the run under test is the child, and the other user's entries are root's."""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

OTHER = 65534  # nobody

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")


@contextmanager
def shared_root() -> Iterator[str]:
    """A fresh folder every user may write (mode 0777, under the system's temporary folder,
    which the second user can reach), removed afterwards."""
    folder = tempfile.mkdtemp(prefix="statereg-shared-")
    os.chmod(folder, 0o777)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def as_other_user(work: Callable[[], Any]) -> Any:
    """`work()` in a forked child running as uid/gid 65534; its result (pickled back), or
    its error raised here as AssertionError naming the exception and its traceback. Modules
    it needs should be imported already."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        status = 1
        answer = pickle.dumps({"error": "no answer"})
        try:
            os.close(read)
            torch.set_num_threads(1)
            os.setgroups([])
            os.setgid(OTHER)
            os.setuid(OTHER)
            answer = pickle.dumps({"ok": work()})
            status = 0
        except BaseException as exc:  # reported to the parent
            answer = pickle.dumps({"error": f"{type(exc).__name__}: {exc}\n"
                                            f"{traceback.format_exc()}"})
        finally:
            try:
                view = memoryview(answer)
                while view:
                    view = view[os.write(write, view):]
            finally:
                os._exit(status)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 1 << 16):
        chunks.append(chunk)
    os.close(read)
    os.waitpid(pid, 0)
    result = pickle.loads(b"".join(chunks)) if chunks else {"error": "no answer"}
    assert "error" not in result, result["error"]
    return result["ok"]
