"""Test-only driver: run a real save and SIGKILL this process at a chosen point.

The point comes from the STATEREG_CRASH_AT environment variable. `arm()` wraps a few
backend and engine functions so that, when the save reaches the point, the process writes
the point's name to a marker file (proof that it got there) and sends itself SIGKILL: no
timing, no sleeps, no chance to clean up. A point inside a file's bytes ("mid") writes the
first half of the bytes it was given, flushed to the OS, before dying.

Standalone: STATEREG_CRASH_AT=mid_tensor_file python tests/reliability/crash_driver.py ROOT
saves step 1, then dies while saving step 2. The tests fork it from a warm process instead
(see conftest.py), which saves importing torch once per kill.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import nn

import statereg
import statereg.engine.save_steps
from statereg.backends.base import StorageBackend
from statereg.backends.checksum import HashingWriter
from statereg.backends.local import LocalBackend

ENV = "STATEREG_CRASH_AT"
VICTIM = "step_00000002"  # the save that is killed; step 1 is saved complete before it


@dataclass(frozen=True)
class Point:
    """A kill point: its name, the step `load()` must return after it, and what `ls` lists."""

    name: str
    loads: int | None
    listed: tuple[int, ...]
    keep_last: int | None = None
    async_save: bool = False


POINTS = [
    Point("before_first_file", 1, (1,)),
    Point("mid_tensor_file", 1, (1,)),
    Point("mid_dcp_metadata", 1, (1,)),
    Point("between_components", 1, (1,)),
    Point("after_tensor_files", 1, (1,)),
    Point("mid_manifest", 1, (1,)),
    Point("after_manifest_before_latest", 2, (1, 2)),
    Point("mid_latest", 2, (1, 2)),
    Point("mid_retention", 2, (2,), keep_last=1),
    Point("async_background_write", 1, (1,), async_save=True),
    Point("first_save_mid_tensor_file", None, ()),
]
BY_NAME = {p.name: p for p in POINTS}

SINGLE_COMPONENTS = {
    "model": {"kind": "model"},
    "optimizer": {"kind": "optimizer"},
    "scheduler": {"kind": "scheduler"},
    "rng": {"kind": "rng"},
}
# Two ranks: no per-rank state, so a single process can load what two ranks saved.
RANKS_COMPONENTS = {k: v for k, v in SINGLE_COMPONENTS.items() if k != "rng"}


class TinyState:
    """A small model, AdamW and a scheduler; `trained(step)` is the same bits everywhere."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=2, gamma=0.5)

    @classmethod
    def trained(cls, step: int) -> TinyState:
        state = cls()
        gen = torch.Generator().manual_seed(step)
        for _ in range(step):
            loss = state.model(torch.randn(4, 8, generator=gen)).pow(2).mean()
            state.optimizer.zero_grad()
            loss.backward()
            state.optimizer.step()
            state.scheduler.step()
        return state

    def objects(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler}

    def snapshot(self) -> dict[str, Any]:
        return {
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optimizer": _clone(self.optimizer.state_dict()),
            "scheduler": _clone(self.scheduler.state_dict()),
        }


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def declaration(url: str, options: dict[str, Any], components: dict[str, Any],
                keep_last: int | None = None, async_save: bool = False) -> dict[str, Any]:
    save: dict[str, Any] = {"async": "thread" if async_save else "off"}
    if keep_last is not None:
        save["keep_last"] = keep_last
    return {"storage": {"url": url, "options": options}, "components": components,
            "save": save}


# -- the kill ------------------------------------------------------------------------------


_DYING = threading.Lock()


def _die(point: str, marker: str) -> None:
    _DYING.acquire()  # one thread reports and kills; any other reaching a point waits here
    with open(marker, "w") as f:
        f.write(point)
        f.flush()
        os.fsync(f.fileno())
    os.kill(os.getpid(), signal.SIGKILL)


def _write_half_and_die(writer: HashingWriter, data: Any, point: str, marker: str) -> None:
    view = memoryview(data).cast("B")
    # The real file on local disk; on object stores a buffer, or a part not yet sent.
    sink = writer._sink
    sink.write(view[: max(1, len(view) // 2)])
    if callable(getattr(sink, "fileno", None)) and not isinstance(sink, io.BytesIO):
        sink.flush()
        os.fsync(sink.fileno())
    _die(point, marker)


def arm(point: str, marker: str, rank: int = 0) -> None:
    """Make the next save die at `point` (patching classes of this process only)."""
    victim = "step_00000001" if point.startswith("first_save") else VICTIM

    def in_victim(path: str) -> bool:
        return path.startswith(f"{victim}/") and "/.claim-" not in path

    def remote(backend: StorageBackend) -> bool:
        return not isinstance(backend, LocalBackend)

    original_write = HashingWriter.write
    main_returned = threading.Event()
    arm.main_returned = main_returned  # type: ignore[attr-defined]

    def write(self: HashingWriter, data: Any) -> int:
        path = self.path
        if point in ("mid_tensor_file", "first_save_mid_tensor_file") and in_victim(path) \
                and path.endswith(".distcp") and not isinstance(self._sink, io.BytesIO):
            _write_half_and_die(self, data, point, marker)  # object stores: _arm_multipart
        if point == "mid_dcp_metadata" and in_victim(path) and path.endswith("/.metadata"):
            _write_half_and_die(self, data, point, marker)
        if point == "mid_manifest" and path.startswith(f"{victim}/manifest.json"):
            _write_half_and_die(self, data, point, marker)
        if point == "mid_latest" and path.startswith("latest"):
            _write_half_and_die(self, data, point, marker)
        if point == "async_background_write" and in_victim(path) \
                and threading.current_thread() is not threading.main_thread():
            main_returned.wait(30)  # save() has returned: the loop would be training now
            _write_half_and_die(self, data, point, marker)
        if point == "rank1_mid_file" and rank == 1 and in_victim(path):
            _write_half_and_die(self, data, point, marker)
        return original_write(self, data)

    HashingWriter.write = write  # type: ignore[method-assign]

    # Every class that defines open_write: a store may write its files its own way (S3's
    # part uploads).
    for cls in {StorageBackend, LocalBackend, *StorageBackend.__subclasses__()}:
        if "open_write" not in cls.__dict__:
            continue
        original_open = cls.open_write

        def open_write(self: StorageBackend, path: str, on_done: Any = None,
                       _original: Any = original_open) -> HashingWriter:
            if point == "before_first_file" and in_victim(path):
                _die(point, marker)
            if point == "between_components" and path.startswith(f"{victim}/optimizer/"):
                _die(point, marker)
            return _original(self, path, on_done)

        cls.open_write = open_write  # type: ignore[method-assign]

    for cls in {StorageBackend, LocalBackend, *StorageBackend.__subclasses__()}:
        if "create_bytes" not in cls.__dict__:
            continue
        original_create = cls.create_bytes

        def create_bytes(self: StorageBackend, path: str, data: bytes,
                         _original: Any = original_create) -> Any:
            # One PUT on object stores: dying "mid" the manifest means before it arrives.
            if point == "mid_manifest" and path == f"{victim}/manifest.json" and remote(self):
                _die(point, marker)
            return _original(self, path, data)

        cls.create_bytes = create_bytes  # type: ignore[method-assign]

    for cls in (StorageBackend, LocalBackend):
        original_bytes = cls.write_bytes

        def write_bytes(self: StorageBackend, path: str, data: bytes,
                        _original: Any = original_bytes) -> Any:
            if point == "after_manifest_before_latest" and path == "latest":
                _die(point, marker)
            return _original(self, path, data)

        cls.write_bytes = write_bytes  # type: ignore[method-assign]

    for cls in (StorageBackend, LocalBackend):
        original_remove = cls.remove_tree

        def remove_tree(self: StorageBackend, path: str, _original: Any = original_remove,
                        ) -> None:
            # Retention has removed step 1's manifest and is about to remove its files.
            if point == "mid_retention" and path == "step_00000001":
                _die(point, marker)
            return _original(self, path)

        cls.remove_tree = remove_tree  # type: ignore[method-assign]

    original_commit = statereg.engine.save_steps.commit

    def commit(*args: Any, **kwargs: Any) -> Any:
        if point == "after_tensor_files":
            _die(point, marker)
        return original_commit(*args, **kwargs)

    statereg.engine.save_steps.commit = commit

    if point in ("mid_tensor_file", "first_save_mid_tensor_file"):
        _arm_multipart(victim, point, marker)


def _arm_multipart(victim: str, point: str, marker: str) -> None:
    """On S3, "mid-file" is a multipart upload with a part sent and no completion."""
    try:
        import s3fs
    except ImportError:
        return
    from statereg.backends.s3 import S3Backend

    S3Backend.upload_options = {"chunksize": 256}  # tiny parts; never completed
    original = s3fs.S3FileSystem._call_s3

    async def call_s3(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        out = await original(self, method, *args, **kwargs)
        if method == "upload_part" and f"/{victim}/" in f"/{kwargs.get('Key', '')}":
            _die(point, marker)
        return out

    s3fs.S3FileSystem._call_s3 = call_s3


# -- what a child process runs --------------------------------------------------------------


def single(url: str, options: dict[str, Any], point: str, marker: str) -> None:
    """Save step 1 (unless the point is in the first save), arm, then save step 2 and die."""
    torch.set_num_threads(1)
    spec = BY_NAME[point]
    first = point.startswith("first_save")
    if not first:
        state = TinyState.trained(1)
        decl = declaration(url, options, SINGLE_COMPONENTS, spec.keep_last)
        statereg.CheckpointManager(decl, **state.objects()).save(step=1)
    arm(point, marker)
    step = 1 if first else 2
    state = TinyState.trained(step)
    decl = declaration(url, options, SINGLE_COMPONENTS, spec.keep_last, spec.async_save)
    mgr = statereg.CheckpointManager(decl, **state.objects())
    mgr.save(step=step)
    arm.main_returned.set()  # type: ignore[attr-defined]
    mgr.wait()
    raise SystemExit(f"the save finished: kill point {point!r} was never reached")


def ranks(rank: int, world: int, init_file: str, url: str, options: dict[str, Any],
          marker: str) -> None:
    """One rank of a 2-rank job: save step 1, then rank 1 dies mid-file saving step 2."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    decl = declaration(url, options, RANKS_COMPONENTS)
    statereg.CheckpointManager(decl, **TinyState.trained(1).objects()).save(step=1)
    arm("rank1_mid_file", marker, rank)
    statereg.CheckpointManager(decl, **TinyState.trained(2).objects()).save(step=2)
    raise SystemExit(f"rank {rank}: the save finished: rank 1 was never killed")


def main() -> None:
    point = os.environ[ENV]
    root = sys.argv[1]
    options = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    single(root, options, point, os.path.join(os.path.dirname(root) or ".", "crash-marker"))


if __name__ == "__main__":
    main()


# -- concurrent savers -----------------------------------------------------------------------


def save_at_barrier(url: str, options: dict[str, Any], steps: list[int], seed: int,
                    barrier: Any, results: Any) -> None:
    """Wait for the other saver, then save each of `steps` with this saver's state (`seed`),
    reporting ("committed", step, seed) or ("refused", step, error type, message)."""
    torch.set_num_threads(1)
    state = TinyState.trained(seed)
    mgr = statereg.CheckpointManager(declaration(url, options, SINGLE_COMPONENTS),
                                     **state.objects())
    barrier.wait(60)
    for step in steps:
        try:
            mgr.save(step=step, extra={"seed": seed})
        except statereg.StateregError as exc:
            results.put(("refused", step, type(exc).__name__, str(exc)))
        else:
            results.put(("committed", step, seed, ""))
