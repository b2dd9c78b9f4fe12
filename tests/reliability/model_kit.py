"""Parts of the model-based test (test_model_based.py): the live state of a trainer, the
declarations, damage done to stored files, an in-process stand-in for SIGKILL, and the CLI
run in-process.

Everything here acts on real storage (local disk, or a real S3 server through the same
filesystem the tests use to look at objects); nothing is mocked but the moment of death.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import stat
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from crash_driver import _clone
from torch import nn

import statereg
import statereg.engine.save_steps
from statereg import cli
from statereg.backends.base import StorageBackend
from statereg.engine.claims import Claim

FROZEN_SEED = 7
COMPONENTS = {"model": {"kind": "model"}, "optimizer": {"kind": "optimizer"},
              "scheduler": {"kind": "scheduler"}}
SAVE_MODES = ("plain", "incremental", "compressed", "async")


class Net(nn.Module):
    """A frozen base (the same bits in every trainer, so incremental saves reuse it) and a
    small trainable head."""

    def __init__(self, head_seed: int) -> None:
        super().__init__()
        self.base = nn.Linear(8, 8, bias=False).requires_grad_(False)
        self.head = nn.Linear(8, 2)
        with torch.no_grad():
            self.base.weight.copy_(torch.randn(8, 8, generator=torch.Generator()
                                               .manual_seed(FROZEN_SEED)))
            gen = torch.Generator().manual_seed(head_seed)
            for p in self.head.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))


class Live:
    """One trainer's live objects: model, AdamW over the head, a StepLR scheduler."""

    def __init__(self, head_seed: int) -> None:
        self.model = Net(head_seed)
        self.optimizer = torch.optim.AdamW(self.model.head.parameters(), lr=0.05)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=2, gamma=0.5)
        self.gen = torch.Generator().manual_seed(head_seed + 1000)

    def objects(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler}

    def train(self) -> None:
        """One optimizer step: the head and the optimizer state change, the base does not."""
        loss = self.model.head(self.model.base(torch.randn(4, 8, generator=self.gen))).pow(2)
        self.optimizer.zero_grad()
        loss.mean().backward()
        self.optimizer.step()
        self.scheduler.step()

    def snapshot(self) -> dict[str, Any]:
        return {"model": _clone(self.model.state_dict()),
                "optimizer": _clone(self.optimizer.state_dict()),
                "scheduler": _clone(self.scheduler.state_dict())}


def declaration(url: str, options: dict[str, Any], mode: str = "plain",
                retention: dict[str, Any] | None = None) -> dict[str, Any]:
    """A run's declaration: `mode` is one of SAVE_MODES; `retention` the save rules."""
    storage: dict[str, Any] = {"url": url, "options": options}
    save: dict[str, Any] = dict(retention or {})
    if mode == "compressed":
        storage["compression"] = "zstd"
    if mode == "incremental":
        save["incremental"] = True
    if mode == "async":
        save["async"] = "thread"
    return {"storage": storage, "components": COMPONENTS, "save": save}


# -- the store, seen from outside statereg ---------------------------------------------------


@dataclass
class Root:
    """A checkpoint root and the filesystem that reaches its objects directly (to look at
    them and damage them): local disk, or the S3 server's own bucket."""

    url: str
    options: dict[str, Any]
    fs: Any
    path: str  # the root for `fs`
    local: bool

    def full(self, relative: str) -> str:
        return f"{self.path}/{relative}"

    def fingerprint(self) -> tuple[Any, ...]:
        """Every object under the root with its type, size and version: equal fingerprints
        mean equal contents (a load reads nothing else)."""
        if self.local:
            found = []
            for top, dirs, files in os.walk(self.path):
                for name in sorted(dirs + files):
                    st = os.lstat(os.path.join(top, name))
                    found.append((os.path.relpath(os.path.join(top, name), self.path),
                                  stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns,
                                  st.st_ino))
            return tuple(sorted(found))
        self.fs.invalidate_cache()
        try:
            listed = self.fs.find(self.path, detail=True)
        except FileNotFoundError:
            return ()
        return tuple(sorted((p, info.get("size"), info.get("ETag")) for p, info in
                            listed.items()))

    def read(self, relative: str) -> bytes:
        self.fs.invalidate_cache()
        return self.fs.cat_file(self.full(relative))

    def write(self, relative: str, data: bytes) -> None:
        if self.local:
            full = self.full(relative)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(full)
            with open(full, "wb") as f:
                f.write(data)
        else:
            self.fs.pipe_file(self.full(relative), data)
            self.fs.invalidate_cache()

    def exists(self, relative: str) -> bool:
        if self.local:
            return os.path.lexists(self.full(relative))
        self.fs.invalidate_cache()
        return self.fs.exists(self.full(relative))

    def remove(self, relative: str) -> None:
        if self.local:
            os.unlink(self.full(relative))
        else:
            self.fs.rm_file(self.full(relative))
            self.fs.invalidate_cache()

    def destroy(self) -> None:
        """Remove the whole root (after an example)."""
        if self.local:
            import shutil

            shutil.rmtree(self.path, ignore_errors=True)
        else:
            self.fs.invalidate_cache()
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(self.path, recursive=True)
            self.fs.invalidate_cache()

    # -- damage ---------------------------------------------------------------------------

    def flip(self, relative: str, where: float) -> None:
        """Change one byte. Not an XOR: a second flip at the same place must not restore the
        file, which the model (which records damage, never repair) would then call damaged
        while `verify` rightly passes it (seed 3004)."""
        data = bytearray(self.read(relative))
        if data:
            at = min(int(where * len(data)), len(data) - 1)
            data[at] = (data[at] + 1) % 256
        self.write(relative, bytes(data))

    def truncate(self, relative: str, where: float) -> None:
        data = self.read(relative)
        self.write(relative, data[: min(int(where * len(data)), len(data) - 1)])

    def replace(self, relative: str, how: str, target: str | None = None) -> str:
        """Replace `relative` (which may not exist) with a link, a FIFO or garbage; object
        stores have neither links nor FIFOs, so they get garbage. Returns what was done."""
        if not self.local or how == "garbage":
            self.write(relative, b"\x00not what statereg wrote\xff{")
            return "garbage"
        full = self.full(relative)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(full)
        if how == "link":
            os.symlink(self.full(target) if target else full + ".nowhere", full)
        else:
            os.mkfifo(full)
        return how


# -- a process kill between the steps of a save ------------------------------------------------


class Killed(SystemExit):
    """Stands for SIGKILL at a kill point: statereg's own error handling lets SystemExit
    through (engine/world.py caught), so nothing after the point runs for this save."""


# What each point leaves is what the same point of tests/reliability/crash_driver.py leaves
# (the SIGKILLed child), except that the process lives on; its claim is left on storage,
# no longer renewed, and reads as "an earlier save of this process that ended": stale, as a
# dead process's claim is.
KILL_POINTS = ("before_first_file", "mid_tensor_file", "between_components",
               "after_tensor_files", "after_manifest_before_latest", "mid_retention")
COMMITTED_POINTS = ("after_manifest_before_latest", "mid_retention")


@contextlib.contextmanager
def killed_at(point: str, backend: StorageBackend, victim: str) -> Iterator[threading.Event]:
    """While inside, the save of checkpoint `victim` through `backend` dies at `point`.
    The event is set once the point was reached (a point never reached kills nothing)."""
    fired = threading.Event()

    def die() -> None:
        fired.set()
        raise Killed(point)

    def in_victim(path: str) -> bool:
        return path.startswith(f"{victim}/") and "/.claim-" not in path

    original_open, original_bytes = backend.open_write, backend.write_bytes
    original_remove = backend.remove_file
    original_commit = statereg.engine.save_steps.commit
    original_release = Claim.release

    def open_write(path: str, on_done: Any = None) -> Any:
        if fired.is_set():
            die()  # a dead process writes nothing more (DCP's other writer threads)
        if point == "before_first_file" and in_victim(path):
            die()
        if point == "between_components" and path.startswith(f"{victim}/optimizer/"):
            die()
        writer = original_open(path, on_done)
        if point == "mid_tensor_file" and in_victim(path) and path.endswith(".distcp"):
            write = writer.write

            def half_then_die(data: Any) -> int:
                view = memoryview(data).cast("B")
                write(view[: max(1, len(view) // 2)])
                with contextlib.suppress(Exception):
                    writer._sink.flush()
                die()
                return 0

            writer.write = half_then_die
        return writer

    def write_bytes(path: str, data: bytes) -> Any:
        if point == "after_manifest_before_latest" and path == "latest":
            die()
        return original_bytes(path, data)

    def remove_file(path: str) -> Any:
        done = original_remove(path)
        # Retention uncommits the checkpoints it deletes (manifest first), then deletes
        # their files: dying after the first uncommit leaves the rest half done.
        if point == "mid_retention" and path.endswith("/manifest.json") \
                and not path.startswith(f"{victim}/"):
            die()
        return done

    def commit(*args: Any, **kwargs: Any) -> Any:
        if point == "after_tensor_files":
            die()
        return original_commit(*args, **kwargs)

    def release(self: Claim) -> None:
        if fired.is_set():  # a dead process removes nothing: its claim stays, unrenewed
            self._stop_renewing()
            return
        original_release(self)

    backend.open_write = open_write  # type: ignore[method-assign]
    backend.write_bytes = write_bytes  # type: ignore[method-assign]
    backend.remove_file = remove_file  # type: ignore[method-assign]
    statereg.engine.save_steps.commit = commit
    Claim.release = release  # type: ignore[method-assign]
    try:
        yield fired
    finally:
        for name in ("open_write", "write_bytes", "remove_file"):
            backend.__dict__.pop(name, None)
        statereg.engine.save_steps.commit = original_commit
        Claim.release = original_release  # type: ignore[method-assign]


@contextlib.contextmanager
def paused_at_first_file(backend: StorageBackend, victim: str,
                         ) -> Iterator[tuple[threading.Event, threading.Event]]:
    """While inside, the save of `victim` stops before its first data file (claimed, its
    base named in the claim) until `go` is set; `there` is set when it stops. Every writer
    thread of the save stops at its first file, so nothing changes on storage meanwhile."""
    there, go = threading.Event(), threading.Event()
    original_open = backend.open_write

    def open_write(path: str, on_done: Any = None) -> Any:
        if path.startswith(f"{victim}/") and "/.claim-" not in path and not go.is_set():
            there.set()
            go.wait(60)
        return original_open(path, on_done)

    backend.open_write = open_write  # type: ignore[method-assign]
    try:
        yield there, go
    finally:
        backend.__dict__.pop("open_write", None)


# -- the CLI, in-process ---------------------------------------------------------------------


@dataclass(frozen=True)
class CliRun:
    argv: tuple[str, ...]
    code: int
    out: str
    err: str


def run_cli(*argv: str) -> CliRun:
    """`statereg ARGV` in this process. The CLI turns every StateregError into one line and
    an exit code; an exception that escapes it is what a user sees as a traceback: it is
    returned as exit code -1 with the traceback on stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(argv))
        except SystemExit as exc:  # argparse
            code = exc.code if isinstance(exc.code, int) else 2
        except BaseException as exc:  # DCP's CheckpointException is not an Exception
            if isinstance(exc, KeyboardInterrupt):
                raise
            code = -1
            traceback.print_exc()
    return CliRun(tuple(argv), code, out.getvalue(), err.getvalue())


def options_args(options: dict[str, Any]) -> list[str]:
    return ["--options", json.dumps(options)] if options else []
