"""The forkserver that every test's child processes fork from: the distributed harness's
ranks and the reliability drivers' children alike.

multiprocessing runs one forkserver per process, and whoever starts it first decides what it
imports before forking. When the harness started it with its own list, every reliability
child of the same session (a full run reaches tests/distributed first) imported s3fs, the
crash driver and torch._dynamo afresh, most of a second of CPU per child; when a reliability
test started it, ranks imported FSDP each. Both start it here, with what either needs.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import multiprocessing.forkserver
import os
import threading
from typing import Any

_TESTS = os.path.dirname(os.path.abspath(__file__))

# torch._dynamo: the first optimizer of a process imports it (half a second of CPU).
# crash_driver (tests/reliability): the module the reliability children run.
# integrations.trainees (tests/integrations): the Trainer and Accelerate runs; it imports
# transformers and accelerate, about 2.5 s of CPU once here instead of in every rank.
PRELOAD = ["torch", "torch._dynamo", "torch.distributed.fsdp", "statereg.manager", "s3fs",
           "crash_driver", "integrations.trainees"]

_STARTED = False
# A forkserver child's exit status arrives as 8 bytes on a pipe, and Popen.poll is not
# thread-safe: start() in one thread polls every other running child (multiprocessing's
# _cleanup), and when it and that child's own join() both find the pipe readable, the one
# that reads second meets EOF and records exit code 255 (the drills run two trainers at a
# time from two threads). Every start and status read holds this lock.
_STATUS = threading.RLock()


class _Child(multiprocessing.context.ForkServerProcess):
    """A forkserver Process whose status is read by one thread at a time."""

    def start(self) -> None:
        with _STATUS:
            super().start()

    def join(self, timeout: float | None = None) -> None:
        multiprocessing.connection.wait([self.sentinel], timeout)  # waits without reading
        with _STATUS:
            super().join(0)

    def is_alive(self) -> bool:
        with _STATUS:
            return super().is_alive()

    @property
    def exitcode(self) -> int | None:
        with _STATUS:
            return super().exitcode


class _Context(multiprocessing.context.ForkServerContext):
    Process = _Child


def forkserver_context() -> Any:
    """The forkserver multiprocessing context, its server started with PRELOAD imported:
    a child starts in milliseconds, not seconds."""
    global _STARTED
    context = _Context()
    if not _STARTED:
        context.set_forkserver_preload(PRELOAD)
        # Python 3.11's forkserver ignores the parent's sys.path when it preloads; the
        # environment reaches it, so the drivers' directories go in through PYTHONPATH.
        previous = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [os.path.join(_TESTS, "reliability"), _TESTS, *([previous] if previous else [])])
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            if previous is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = previous
        _STARTED = True
    return context
