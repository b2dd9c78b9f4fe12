"""One repetition of one peer library's saves and loads, in that library's own virtualenv.

Usage: python field_worker.py JOB.json OUT.json (run by perfsuite/field.py, not by hand).

The peers (Meta's torch-checkpointing, torchsnapshot, megatron-core) pin or drag in versions
of their own, so they live in a separate virtualenv with the same torch; this script runs
there, on the state that field.py dumped as one safetensors file. JOB.json is either

    {"probe": true}  ->  {"peers": {name: {"version": ...} | {"status": "not installed: ..."}}}

or one repetition of one peer:

    {"peer": NAME, "state": "state.safetensors", "root": DIR, "drop_all": bool,
     "check_async": bool}

which measures, exactly as field.py measures its in-process contenders (the driver below is
shared: field.py imports it), a durable sync save, a cold load into preallocated tensors (the
checkpoint's pages evicted first: drop_caches if permitted and asked for, else a sync and
posix_fadvise(DONTNEED) on each file), the same load at once again (warm), and the library's
async save: the training stall and the time until durable. Every load is checked bit for bit;
with `check_async` the async checkpoint is loaded back too, after the loop rewrote every byte
of the live tensors while the save was in flight, so a save that lets the loop's writes reach
the checkpoint is reported as not consistent instead of fast. OUT.json gets seconds and peak
RSS per operation, the version, notes, and `status` ("ok", or why the peer was skipped).

Only torch, numpy, safetensors and the peer are needed here; perfsuite.measure (torch only)
is imported from the folder above this file.
"""

from __future__ import annotations

import errno
import importlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

_BENCHMARKS = str(Path(__file__).resolve().parents[1])  # for perfsuite.measure in the peer venv
if _BENCHMARKS not in sys.path:
    sys.path.insert(0, _BENCHMARKS)
from perfsuite.measure import PageCache, PeakRSS, fresh_dir, peak_rss  # noqa: E402

# Peer name -> (module to import, distribution on the package registry).
PEERS = {
    "torch_checkpointing": ("torch_checkpointing", "torch-checkpointing"),
    "torchsnapshot": ("torchsnapshot", "torchsnapshot"),
    "megatron_core": ("megatron.core.dist_checkpointing", "megatron-core"),
}
ZIPNN = ("zipnn", "zipnn")
Flat = dict[str, torch.Tensor]


# --- the driver shared with field.py -------------------------------------------------------


def fsync_tree(root: Path) -> None:
    """fsync every file under `root` and every folder, for libraries that end a save unsynced
    (the benchmark's saves all end durable, as statereg's and DCP's do)."""
    for folder, _, files in os.walk(root):
        for name in [*files, "."]:
            fd = os.open(Path(folder) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def rewrite_every_byte(live: Flat) -> None:
    """What a training step does to the state during an async save, made exactly undoable:
    a bitwise NOT of every byte (a second call restores the values)."""
    for tensor in live.values():
        tensor.reshape(-1).view(torch.uint8).bitwise_not_()


def matches(live: Flat, expected: Flat) -> bool:
    return all(torch.equal(live[key], expected[key]) for key in expected)


def check_and_clear(live: Flat, expected: Flat, what: str) -> None:
    """A load that left a tensor untouched would be timed too fast: compare every tensor bit
    for bit, then zero them so that the next load has to write every byte again."""
    for key, tensor in expected.items():
        if not torch.equal(live[key], tensor):
            raise AssertionError(f"{what} did not load {key!r} bit-identical")
    for tensor in live.values():
        tensor.zero_()


def restore(live: Flat, expected: Flat) -> None:
    for key, tensor in expected.items():
        live[key].copy_(tensor)


class Contender:
    """One library's saves and loads of the flat state `live` (the tensors it saves, and the
    preallocated tensors it loads into, as load_state_dict would).

    `saves` names each sync save variant (each ends durable); `load` reads a checkpoint that
    a sync or async save wrote at `path` into `live`; the async trio is start (returns a
    handle), staged (returns when the loop may mutate the tensors) and finish (returns when the
    checkpoint is durable). `warm_up_async`: the first async save of a manager (or of a
    process) allocates buffers, starts threads or a process; it is timed apart, so that the
    measured one is a later save, as nearly every save of a training run is."""

    name = ""
    has_async = False
    warm_up_async = False

    def __init__(self, live: Flat) -> None:
        self.live = live
        self.notes: list[str] = []

    def saves(self) -> dict[str, Callable[[Path], None]]:
        raise NotImplementedError

    def load(self, path: Path) -> None:
        raise NotImplementedError

    def async_start(self, path: Path) -> Any:
        raise NotImplementedError

    def async_staged(self, handle: Any) -> None:
        """Most libraries return from async_start once the copy is done: nothing to wait."""

    def async_finish(self, handle: Any) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release managers, processes and buffers."""


@dataclass
class Rep:
    """One repetition of one contender: seconds and peak RSS per operation."""

    seconds: dict[str, float] = field(default_factory=dict)
    peaks: dict[str, PeakRSS] = field(default_factory=dict)
    async_consistent: bool | None = None

    def to_json(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "async_consistent": self.async_consistent,
                "peaks": {op: {"peak_gb": p.peak_gb, "start_gb": p.start_gb}
                          for op, p in self.peaks.items()}}


def _timed(rep: Rep, op: str, operation: Callable[[], Any]) -> Any:
    with peak_rss() as peak:
        start = time.perf_counter()
        result = operation()
        rep.seconds[op] = time.perf_counter() - start
    rep.peaks[op] = peak
    return result


def _async_save(c: Contender, path: Path, rep: Rep, prefix: str) -> None:
    """save(); wait until the loop may mutate (the stall); rewrite every byte as the loop
    would; wait until durable. Undone after, untimed."""
    fresh_dir(path)
    os.sync()
    with peak_rss() as peak:
        start = time.perf_counter()
        handle = c.async_start(path)
        c.async_staged(handle)
        staged = time.perf_counter()
        rewrite_every_byte(c.live)
        c.async_finish(handle)
        done = time.perf_counter()
    rewrite_every_byte(c.live)
    rep.seconds[f"{prefix}stall"] = staged - start
    rep.seconds[f"{prefix}durable"] = done - start
    rep.peaks[f"{prefix}stall"] = rep.peaks[f"{prefix}durable"] = peak


def run_rep(c: Contender, root: Path, evict: Callable[[Path], None], expected: Flat,
            check_async: bool, warm_up: bool) -> Rep:
    """Every operation of one contender, in the order sync save(s), cold load of the last one,
    warm load, async save (when `warm_up`, after a first one reported as async_first_stall);
    with `check_async`, the async checkpoint is loaded back and compared."""
    rep = Rep()
    sync = root / "sync"
    for op, save in c.saves().items():
        fresh_dir(sync)
        os.sync()
        _timed(rep, op, lambda save=save: save(sync))
    evict(sync)
    _timed(rep, "cold_load", lambda: c.load(sync))
    check_and_clear(c.live, expected, f"{c.name} cold load")
    _timed(rep, "warm_load", lambda: c.load(sync))
    check_and_clear(c.live, expected, f"{c.name} warm load")
    restore(c.live, expected)
    fresh_dir(sync)
    if c.has_async:
        if warm_up:
            _async_save(c, root / "async", rep, "async_first_")
            del rep.seconds["async_first_durable"], rep.peaks["async_first_durable"]
        _async_save(c, root / "async", rep, "async_")
        if check_async:
            for tensor in c.live.values():
                tensor.zero_()
            c.load(root / "async")
            rep.async_consistent = matches(c.live, expected)
            restore(c.live, expected)
        fresh_dir(root / "async")
    return rep


# --- the peers -----------------------------------------------------------------------------


def split(flat: Flat) -> dict[str, Flat]:
    """The two items a trainer hands these libraries: model and optimizer state."""
    return {"model": {k: v for k, v in flat.items() if k.startswith("model.")},
            "optim": {k: v for k, v in flat.items() if not k.startswith("model.")}}


class TorchCheckpointing(Contender):
    """Meta's torch_checkpointing (PyPI torch-checkpointing): CheckpointManager.save(path,
    {"model": ..., "optim": ...}) and load(path, into=...), which copies into the given tensors
    in place. Its async save (the default saver) stages into shared memory and writes from a
    background process; the stall ends when `with manager.lock():` (what the loop wraps
    optimizer.step() in) is entered. It writes without fsync: fsync is added to every save."""

    name = "torch_checkpointing"
    has_async = True
    warm_up_async = True

    def __init__(self, live: Flat, scratch: Path) -> None:
        super().__init__(live)
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.config import SyncCheckpointSaverConfig

        storage = self._storage_config(scratch)
        self.sync = CheckpointManager(CheckpointManager.Config(
            save=SyncCheckpointSaverConfig(), storage_config=storage))
        self.asynchronous = CheckpointManager(CheckpointManager.Config(storage_config=storage))

    def _storage_config(self, scratch: Path) -> Any:
        """The default local storage (O_DIRECT writes), unless this filesystem refuses them.

        0.1.x opens with O_DIRECT and falls back only when the open fails; ext4 and XFS accept
        the open and then refuse torch.save's unaligned writes (EINVAL). Its troubleshooting
        guide's remedy is use_direct_io=False; a tiny save tells which applies here."""
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.config import SyncCheckpointSaverConfig
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        default = LocalFileSystemStorageConfig()
        probe = CheckpointManager(CheckpointManager.Config(
            save=SyncCheckpointSaverConfig(), storage_config=default))
        try:
            probe.save(str(fresh_dir(scratch) / "probe"), {"t": {"t": torch.ones(1000)}})
            return default
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self.notes.append("O_DIRECT writes refused here (EINVAL): use_direct_io=False")
            return LocalFileSystemStorageConfig(use_direct_io=False)
        finally:
            probe.close()
            fresh_dir(scratch)

    def saves(self) -> dict[str, Callable[[Path], None]]:
        def save(path: Path) -> None:
            self.sync.save(str(path / "ckpt"), split(self.live))
            fsync_tree(path)

        return {"save": save}

    def load(self, path: Path) -> None:
        self.sync.load(str(path / "ckpt"), into=split(self.live))

    def async_start(self, path: Path) -> Any:
        return path, self.asynchronous.save(str(path / "ckpt"), split(self.live))

    def async_staged(self, handle: Any) -> None:
        with self.asynchronous.lock():
            pass

    def async_finish(self, handle: Any) -> None:
        path, future = handle
        future.result()
        fsync_tree(path)

    def close(self) -> None:
        self.asynchronous.close()
        self.sync.close()


class TorchSnapshot(Contender):
    """torchsnapshot: Snapshot.take(path, app_state) with StateDict items, restore() (reads
    into the existing tensors), async_take() returning once staged, PendingSnapshot.wait().
    It writes without fsync: fsync is added to every save."""

    name = "torchsnapshot"
    has_async = True
    warm_up_async = True

    def _app_state(self) -> dict[str, Any]:
        from torchsnapshot import StateDict

        return {key: StateDict(**value) for key, value in split(self.live).items()}

    def saves(self) -> dict[str, Callable[[Path], None]]:
        from torchsnapshot import Snapshot

        def save(path: Path) -> None:
            Snapshot.take(str(path / "ckpt"), self._app_state())
            fsync_tree(path)

        return {"save": save}

    def load(self, path: Path) -> None:
        from torchsnapshot import Snapshot

        Snapshot(str(path / "ckpt")).restore(self._app_state())

    def async_start(self, path: Path) -> Any:
        from torchsnapshot import Snapshot

        return path, Snapshot.async_take(str(path / "ckpt"), self._app_state())

    def async_finish(self, handle: Any) -> None:
        path, pending = handle
        pending.wait()
        fsync_tree(path)


class MegatronCore(Contender):
    """megatron-core's dist_checkpointing on one process (a world-size-1 gloo group): save and
    load of a flat dict of ShardedTensors (each a whole tensor, replica 0) with the default
    torch_dist strategy, and its async save (save(async_sharded_save=True) scheduled on an
    AsyncCallsQueue, finalized blocking). load() returns the tensors it read into."""

    name = "megatron_core"
    has_async = True
    warm_up_async = True

    def __init__(self, live: Flat, scratch: Path) -> None:
        super().__init__(live)
        import torch.distributed as dist

        if not dist.is_initialized():
            store = dist.FileStore(str(fresh_dir(scratch) / "store"), 1)
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.queue = AsyncCallsQueue()

    def _sharded(self) -> dict[str, Any]:
        from megatron.core.dist_checkpointing import ShardedTensor

        return {key: ShardedTensor.from_rank_offsets(key, tensor, replica_id=0)
                for key, tensor in self.live.items()}

    def saves(self) -> dict[str, Callable[[Path], None]]:
        from megatron.core import dist_checkpointing

        def save(path: Path) -> None:
            dist_checkpointing.save(self._sharded(), str(path))
            fsync_tree(path)

        return {"save": save}

    def load(self, path: Path) -> None:
        from megatron.core import dist_checkpointing

        loaded = dist_checkpointing.load(self._sharded(), str(path))
        for key, tensor in self.live.items():  # in place already; a copy where it was not
            if loaded[key].data_ptr() != tensor.data_ptr():
                tensor.copy_(loaded[key])

    def async_start(self, path: Path) -> Any:
        from megatron.core import dist_checkpointing

        request = dist_checkpointing.save(self._sharded(), str(path), async_sharded_save=True)
        self.queue.schedule_async_request(request)
        return path

    def async_finish(self, handle: Any) -> None:
        self.queue.maybe_finalize_async_calls(blocking=True)
        fsync_tree(handle)

    def close(self) -> None:
        self.queue.close()


def make_peer(name: str, live: Flat, scratch: Path) -> Contender:
    if name == "torch_checkpointing":
        return TorchCheckpointing(live, scratch)
    if name == "torchsnapshot":
        return TorchSnapshot(live)
    if name == "megatron_core":
        return MegatronCore(live, scratch)
    raise ValueError(f"unknown peer {name!r}")


# --- the job -------------------------------------------------------------------------------


def installed(module: str, dist: str) -> dict[str, str]:
    """{"version": ...} if `module` imports here, else {"status": why not}."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # an import can fail in any way (a missing CUDA library, ...)
        try:
            version(dist)
        except PackageNotFoundError:
            return {"status": "not installed: run with --install"}
        return {"status": f"skipped: import failed: {type(exc).__name__}: {exc}"}
    return {"version": version(dist)}


def where_it_failed(exc: BaseException, package: str) -> str:
    """The exception, where it was raised and the innermost frame of the peer's own code."""
    frames = traceback.extract_tb(exc.__traceback__)

    def place(frame: traceback.FrameSummary) -> str:
        return f"{frame.filename.split('site-packages/')[-1]}:{frame.lineno} {frame.name}"

    message = " ".join(str(exc).split())
    text = f"{type(exc).__name__}: {message[:300]}"
    if not frames:
        return text
    text += f" (raised in {place(frames[-1])}"
    own = [f for f in frames if f"site-packages/{package}/" in f.filename]
    if own and own[-1] is not frames[-1]:
        text += f", called from {place(own[-1])}"
    return text + ")"


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    if job.get("probe"):
        found = {name: installed(*PEERS[name]) for name in PEERS}
        found["zipnn"] = installed(*ZIPNN)
        return {"peers": found, "torch": torch.__version__}
    from safetensors.torch import load_file

    name, root = job["peer"], Path(job["root"])
    live = load_file(job["state"])
    expected = {key: tensor.clone() for key, tensor in live.items()}
    cache = PageCache(roots=[root], evict_only=not job["drop_all"])

    def evict(path: Path) -> None:
        cache.roots = [path]
        cache.drop()

    out: dict[str, Any] = {"peer": name, "version": version(PEERS[name][1]), "notes": []}
    peer: Contender | None = None
    try:
        peer = make_peer(name, live, root / "scratch")
        rep = run_rep(peer, root, evict, expected, job["check_async"], peer.warm_up_async)
        out |= {"status": "ok", "rep": rep.to_json()}
    except Exception as exc:  # a peer that cannot run here is skipped with the reason
        package = PEERS[name][0].split(".")[0]
        out["status"] = f"skipped: failed on this machine: {where_it_failed(exc, package)}"
    finally:
        if peer is not None:
            out["notes"] += peer.notes
            try:
                peer.close()
            except Exception as exc:
                out["notes"].append(f"close failed: {type(exc).__name__}: {exc}")
        fresh_dir(root)
    out["page_cache"] = cache.how
    return out


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    result = run_job(job)
    Path(sys.argv[2]).write_text(json.dumps(result))
    print(json.dumps({k: v for k, v in result.items() if k != "rep"}))


if __name__ == "__main__":  # spawned helpers (torch_checkpointing's writer) re-import this
    main()
