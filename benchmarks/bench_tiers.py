"""Memory-first tiers (issue 16, docs/tiers.md): the "Measure" list, in one run, as ratios.

Run by hand (not a test):  .venv/bin/python benchmarks/bench_tiers.py --gb 1 --reps 3
The memory tier lives in a fresh folder under /dev/shm ($STATEREG_SHM_DIR points at it); the
S3 figures use tests/storage_servers.py's moto server on 127.0.0.1. Each row is the median
of --reps repetitions (after untimed warm-up saves where a row saves: one, or for the
memory tier keep_last + 1, so retention has retired a checkpoint whose pages saves reuse).

- save into memory: with `save.async: thread`, the time save() takes at a memory step (the
  training stall) and until mgr.wait() returns (committed in memory); a synchronous memory
  save (both at once); all against a plain memory copy of the state (copy_ into
  preallocated buffers); a local-disk save for scale. Each timed save and copy follows one
  untimed training step, as a save does in a loop (a copy timed after the previous save's
  wait() instead, with the cores idle, took 1.3x longer here).
- restore after a process crash: a new CheckpointManager (a restarted trainer; the tmpfs
  files outlive the process either way) loads from memory, against a load from local disk
  with the checkpoint's pages evicted (fsync, then posix_fadvise DONTNEED on every file) and
  against a load from the S3 server. Every read of storage.url during the memory restore is
  counted (read_bytes, open_read, open_blocks): the bytes and calls must be 0. Its floor:
  the same data files read and hashed with nothing else (`read_and_hash`).
- drain: the background copy of a memory checkpoint to storage.url (from the end of save()
  to mgr.wait()) against copy_checkpoint (`statereg cp`) of the same checkpoint to a fresh
  root of the same store, alternating; to local disk and to the S3 server.
- training loop: real forward, backward and AdamW steps, with a memory checkpoint every
  --every steps (synchronous, and with save.async: thread, the last write waited for)
  against none; and the steps each failure loses (see `steps_lost`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import xxhash
from perfsuite.workload import linear_stack

import statereg
from statereg.backends.base import StorageBackend
from statereg.backends.registry import open_backend
from statereg.backends.shm import node_name
from statereg.engine.checkpoints import list_committed
from statereg.engine.transfer import copy_checkpoint
from statereg.tiers.report import memory_roots

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from storage_servers import new_bucket, s3_options, start_server

COMPONENTS = {"model": {"kind": "model"}, "optimizer": {"kind": "optimizer"}}
NEVER = 10**9  # a durable cadence that never comes (a multiple of every memory cadence)
KEEP_LAST = 2  # tiers.memory.keep_last of every tiered run here


def median(seconds: list[float]) -> float:
    return statistics.median(seconds)


def row(seconds: list[float], nbytes: int | None = None, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"median_s": round(median(seconds), 4),
                           "seconds": [round(s, 4) for s in seconds]}
    if nbytes:
        out["gb_per_s"] = round(nbytes / median(seconds) / 1e9, 3)
    return out | extra


def timed(operation: Callable[[], Any], reps: int,
          before: Callable[[], Any] | None = None) -> list[float]:
    seconds = []
    for _ in range(reps):
        if before is not None:
            before()
        start = time.perf_counter()
        operation()
        seconds.append(time.perf_counter() - start)
    return seconds


def evict(root: Path) -> None:
    """Push the files under `root` out of the page cache (no privileges needed, and only
    these files: the other jobs on the machine keep their cache)."""
    os.sync()
    for folder, _, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def read_and_hash(paths: list[str], threads: int = 2,
                  piece: int = 1 << 20) -> Callable[[], None]:
    """The floor of a restore from memory: each file read into a buffer allocated (and its
    pages touched) beforehand, as a restore reads into live tensors, and hashed with xxh3 a
    1 MiB piece at a time as it arrives (the piece still in cache); the files spread over
    `threads` threads, as the memory backend's readers are. No parsing, no checks."""
    buffers = {p: bytearray(os.path.getsize(p)) for p in paths}

    def read(some: list[str]) -> None:
        for path in some:
            view = memoryview(buffers[path])
            with open(path, "rb", buffering=0) as stream:
                for at in range(0, len(view), piece):
                    got = stream.readinto(view[at:at + piece])
                    xxhash.xxh3_64_intdigest(view[at:at + got])

    def run() -> None:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, [paths[i::threads] for i in range(threads)]))

    run()
    return run


class CountedReads:
    """Counts every read of a backend: bytes of read_bytes, calls of each read method."""

    def __init__(self, backend: StorageBackend) -> None:
        self.bytes = self.calls = 0
        read_bytes, open_read, open_blocks = (backend.read_bytes, backend.open_read,
                                              backend.open_blocks)

        def counted_read_bytes(path: str, limit: int | None = None) -> bytes:
            data = read_bytes(path, limit)
            self.calls += 1
            self.bytes += len(data)
            return data

        def counted(method: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                self.calls += 1
                return method(*args, **kwargs)
            return call

        backend.read_bytes = counted_read_bytes  # type: ignore[method-assign]
        backend.open_read = counted(open_read)  # type: ignore[method-assign]
        backend.open_blocks = counted(open_blocks)  # type: ignore[method-assign]


def tiered(url: str, every: int, durable_every: int, options: dict[str, Any] | None = None,
           ) -> dict[str, Any]:
    return {"storage": {"url": url, "options": options or {}}, "components": COMPONENTS,
            "tiers": {"memory": {"every": every, "keep_last": KEEP_LAST},
                      "durable": {"every": durable_every}}}


def plain(url: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"storage": {"url": url, "options": options or {}}, "components": COMPONENTS}


@contextmanager
def s3_server(work: Path, enabled: bool) -> Iterator[tuple[str, dict[str, Any]] | None]:
    """A bucket on moto's server on 127.0.0.1 (the test suite's), or None when disabled."""
    if not enabled:
        yield None
        return
    import fsspec

    logs = work / "s3-server"
    logs.mkdir()
    server = start_server("moto_server", ["-m", "moto.server", "-H", "127.0.0.1", "-p",
                                          "{port}"], logs, "/moto-api/")
    try:
        options = s3_options(server.endpoint)
        fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
        yield f"s3://{new_bucket(fs)}", options
    finally:
        server.stop()


class Bench:
    """One run: the state, the folders, the S3 bucket, and the results."""

    def __init__(self, args: argparse.Namespace, work: Path, shm: Path,
                 s3: tuple[str, dict[str, Any]] | None) -> None:
        self.args, self.work, self.shm, self.s3 = args, work, shm, s3
        torch.manual_seed(0)
        self.model, self.optimizer = linear_stack(args.gb, args.width)
        self.tensors = [*self.model.state_dict().values()]
        self.tensors += [v for s in self.optimizer.state.values() for v in s.values() if v.dim()]
        self.nbytes = sum(t.nbytes for t in self.tensors)
        self.rows: dict[str, dict[str, Any]] = {}
        self.step = 0
        width = self.model[0].in_features
        self.batch = torch.randn(args.batch, width, generator=torch.Generator().manual_seed(1))

    def train_step(self) -> None:
        """One forward, backward and AdamW step (it writes the whole state in place)."""
        self.model(self.batch).square().mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def manager(self, spec: dict[str, Any], run: str) -> statereg.CheckpointManager:
        os.environ["STATEREG_RUN_ID"] = run
        return statereg.CheckpointManager(spec, model=self.model, optimizer=self.optimizer)

    def next_step(self) -> int:
        self.step += 1
        return self.step

    # -- save into memory ------------------------------------------------------------------

    def warm_up(self, mgr: statereg.CheckpointManager) -> None:
        """Untimed saves until the memory tier is in its steady state: the first save pays
        first-save costs (DCP plans), until keep_last + 1 saves retention has retired no
        checkpoint whose tmpfs pages a save writes over (shm.py, `recycle`), and the first
        write over each retired file maps it, which later saves reuse (mappings.py)."""
        for _ in range(2 * (KEEP_LAST + 1)):
            mgr.save(self.next_step())
            mgr.wait()

    def save_rows(self) -> None:
        reps = self.args.reps
        buffers = [torch.empty_like(t) for t in self.tensors]

        def copy() -> None:
            for dst, src in zip(buffers, self.tensors, strict=True):
                dst.copy_(src)

        copy()
        self.rows["memory_copy"] = row(timed(copy, reps, self.train_step), self.nbytes)
        buffers.clear()
        with self.manager(tiered(str(self.work / "never-drained"), 1, NEVER), "save") as mgr:
            self.warm_up(mgr)
            seconds = timed(lambda: mgr.save(self.next_step()), reps, self.train_step)
        self.rows["memory_save"] = row(seconds, self.nbytes)
        # save.async: thread: the loop waits for the staging copy; the write commits behind.
        spec = tiered(str(self.work / "never-drained-async"), 1, NEVER)
        spec["save"] = {"async": "thread"}
        stalls, commits = [], []
        with self.manager(spec, "save-async") as mgr:
            self.warm_up(mgr)
            for _ in range(reps):
                self.train_step()
                started = time.perf_counter()
                mgr.save(self.next_step())
                stalls.append(time.perf_counter() - started)
                mgr.wait()
                commits.append(time.perf_counter() - started)
        self.rows["memory_save_async_stall"] = row(stalls, self.nbytes)
        self.rows["memory_save_async_committed"] = row(commits, self.nbytes)
        with self.manager(plain(str(self.work / "disk")), "disk") as mgr:
            mgr.save(self.next_step())
            self.rows["disk_save"] = row(timed(lambda: mgr.save(self.next_step()), reps),
                                         self.nbytes)

    # -- restore after a crash -------------------------------------------------------------

    def restore_rows(self) -> None:
        reps = self.args.reps
        seconds, reads = [], []
        for _ in range(reps):  # a restarted trainer: a new manager, then load()
            mgr = self.manager(tiered(str(self.work / "never-drained"), 1, NEVER), "save")
            reads.append(CountedReads(mgr._backend))
            start = time.perf_counter()
            result = mgr.load()
            seconds.append(time.perf_counter() - start)
            assert result is not None and result.path.startswith("shm://"), result
            mgr.close()
        self.rows["restore_memory"] = row(
            seconds, self.nbytes, durable_bytes_read=sum(r.bytes for r in reads),
            durable_reads=sum(r.calls for r in reads))
        memory = memory_roots("shm://save")[0]
        newest = list_committed(memory)[-1]
        files = [memory.full_path(f"{newest.name}/{f.path}") for f in newest.manifest.files
                 if f.path.endswith(".distcp")]
        self.rows["restore_floor"] = row(timed(read_and_hash(files), reps), self.nbytes)
        self.forget_memory("save")
        disk = self.work / "disk"
        with self.manager(plain(str(disk)), "disk") as mgr:
            self.rows["restore_disk_cold"] = row(timed(mgr.load, reps, lambda: evict(disk)),
                                                 self.nbytes)
        if self.s3 is not None:
            url, options = self.s3
            with self.manager(plain(f"{url}/restore", options), "s3") as mgr:
                mgr.save(self.next_step())
                self.rows["restore_s3"] = row(timed(mgr.load, reps), self.nbytes)
            open_backend(url, options).remove_tree("restore")

    def forget_memory(self, run: str) -> None:
        """Free the tmpfs a finished section's run holds (the next sections need it)."""
        shutil.rmtree(self.shm / f"statereg-{os.geteuid()}" / node_name() / run)

    # -- drain -----------------------------------------------------------------------------

    def drain_rows(self, store: str, url: str, options: dict[str, Any] | None) -> None:
        """Drains to `url` against copy_checkpoint of the same memory checkpoint to fresh
        roots beside it, alternating, after one untimed drain."""
        drains, copies, stalls = [], [], []
        spec = tiered(f"{url}/drained", 1, 1, options)
        with self.manager(spec, f"drain-{store}") as mgr:
            memory = memory_roots(f"shm://drain-{store}")[0]
            for rep in range(self.args.reps + 1):
                step = self.next_step()
                started = time.perf_counter()
                mgr.save(step)
                saved = time.perf_counter()
                mgr.wait()
                done = time.perf_counter()
                name = f"step_{step:08d}"
                # Untimed: no copy outlives its rep (moto keeps objects in memory), and the
                # drain and the copy each start right after a delete of the same size.
                open_backend(f"{url}/drained", options).remove_tree(name)
                target = open_backend(f"{url}/copied-{rep}", options)
                start = time.perf_counter()
                copy_checkpoint(memory, name, target)
                copied = time.perf_counter() - start
                target.remove_tree(name)
                if rep:
                    stalls.append(saved - started)
                    drains.append(done - saved)
                    copies.append(copied)
        self.rows[f"drain_{store}"] = row(drains, self.nbytes)
        self.rows[f"cp_{store}"] = row(copies, self.nbytes)
        self.rows[f"memory_save_draining_{store}"] = row(stalls, self.nbytes)
        self.forget_memory(f"drain-{store}")

    # -- a training loop -------------------------------------------------------------------

    def train_rows(self) -> None:
        args = self.args

        def train(mgr: statereg.CheckpointManager | None, first: int) -> None:
            for step in range(first, first + args.steps):
                self.train_step()
                if mgr is not None:
                    mgr.save(step)  # saves to memory when step % every == 0

        never = NEVER // args.every * args.every
        spec = tiered(str(self.work / "train-durable"), args.every, never)
        spec_async = tiered(str(self.work / "train-durable-async"), args.every, never)
        spec_async["save"] = {"async": "thread"}
        plain_s, tiered_s, async_s = [], [], []
        with self.manager(spec, "train") as mgr, \
                self.manager(spec_async, "train-async") as mgr_async:
            for manager in (mgr, mgr_async):  # the steady state of a long loop, as warm_up
                for _ in range(KEEP_LAST + 1):
                    self.step = (self.step // args.every + 1) * args.every
                    manager.save(self.step)
                    manager.wait()
            for _ in range(args.reps):  # alternate, so drift in the machine hits all alike
                start = time.perf_counter()
                train(None, 0)
                plain_s.append(time.perf_counter() - start)
                for manager, seconds in ((mgr, tiered_s), (mgr_async, async_s)):
                    first = (self.step // args.every + 1) * args.every + 1
                    start = time.perf_counter()
                    train(manager, first)
                    manager.wait()  # the last save's write is part of the loop's cost
                    seconds.append(time.perf_counter() - start)
                    self.step = first + args.steps
        self.forget_memory("train")
        self.forget_memory("train-async")
        self.rows["train_no_checkpoint"] = row(plain_s, steps=args.steps)
        self.rows["train_memory_every"] = row(tiered_s, steps=args.steps, every=args.every)
        self.rows["train_memory_every_async"] = row(async_s, steps=args.steps, every=args.every)

    def run(self) -> None:
        sections: list[tuple[str, Callable[[], None]]] = [
            ("save into memory", self.save_rows), ("restore", self.restore_rows),
            ("drain to local disk",
             lambda: self.drain_rows("local", str(self.work / "durable"), None))]
        if self.s3 is not None:
            url, options = self.s3
            sections.append(("drain to S3",
                              lambda: self.drain_rows("s3", f"{url}/durable", options)))
        sections.append(("training loop", self.train_rows))
        for name, section in sections:
            log(f"{name} ...")
            section()


def log(message: str) -> None:
    print(f"[bench_tiers {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def steps_lost(every: int, restore_s: float, step_s: float) -> float:
    """Expected steps of work a failure costs with a complete copy every `every` steps: a
    failure at a uniformly random moment loses on average every / 2 steps done since the
    last copy, and the restart spends restore_s reading it back, restore_s / step_s steps
    of training not done (the job's start-up, the same for every tier, is left out)."""
    return every / 2 + restore_s / step_s


def summary(rows: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """The ratios the issue states its targets in."""
    m = {name: r["median_s"] for name, r in rows.items()}
    step_s = m["train_no_checkpoint"] / args.steps
    out: dict[str, Any] = {
        "stall_over_copy": m["memory_save_async_stall"] / m["memory_copy"],
        "committed_over_copy": m["memory_save_async_committed"] / m["memory_copy"],
        "sync_save_over_copy": m["memory_save"] / m["memory_copy"],
        "disk_save_over_copy": m["disk_save"] / m["memory_copy"],
        "restore_disk_cold_over_memory": m["restore_disk_cold"] / m["restore_memory"],
        "restore_memory_over_floor": m["restore_memory"] / m["restore_floor"],
        "durable_bytes_read_in_memory_restore": rows["restore_memory"]["durable_bytes_read"],
        "durable_reads_in_memory_restore": rows["restore_memory"]["durable_reads"],
        "drain_over_cp_throughput_local": m["cp_local"] / m["drain_local"],
        "training_slowdown_pct": 100 * (m["train_memory_every"] / m["train_no_checkpoint"] - 1),
        "training_slowdown_async_pct": 100 * (m["train_memory_every_async"]
                                              / m["train_no_checkpoint"] - 1),
        "step_s": step_s,
        "steps_lost_memory": steps_lost(args.every, m["restore_memory"], step_s),
    }
    durable_restore = m.get("restore_s3", m["restore_disk_cold"])
    out["steps_lost_durable"] = steps_lost(args.durable_every, durable_restore, step_s)
    out["steps_lost_durable_restores_from"] = "s3" if "restore_s3" in m else "disk_cold"
    if "restore_s3" in m:
        out["restore_s3_over_memory"] = m["restore_s3"] / m["restore_memory"]
        out["drain_over_cp_throughput_s3"] = m["cp_s3"] / m["drain_s3"]
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def markdown(result: dict[str, Any]) -> str:
    rows, s = result["rows"], result["summary"]
    lines = ["| row | median s | GB/s | reps (s) |", "|---|---|---|---|"]
    for name, r in rows.items():
        rate = r.get("gb_per_s", "-")
        lines.append(f"| {name} | {r['median_s']:.3f} | {rate} | "
                     f"{', '.join(f'{x:.3f}' for x in r['seconds'])} |")
    lines += ["", "| ratio | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in s.items()]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0, help="state size (weights + Adam)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="training steps per repetition")
    parser.add_argument("--every", type=int, default=10, help="memory cadence in the loop")
    parser.add_argument("--durable-every", type=int, default=500,
                        help="durable cadence for the steps-lost figure (not run)")
    parser.add_argument("--batch", type=int, default=64, help="rows per training step")
    parser.add_argument("--no-s3", action="store_true", help="skip the S3 server rows")
    parser.add_argument("--shm", default="/dev/shm",
                        help="tmpfs for the memory tier (a fresh folder is made in it)")
    parser.add_argument("--dir", default=None, help="local disk folder (default: a temp dir)")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: a 2 MB state of narrow layers, 1 repetition, 2 "
                             "steps with a memory save after each, batch 2, no S3 server")
    args = parser.parse_args(argv)
    args.width = 2048
    if args.quick:
        args.gb, args.reps, args.steps, args.every, args.batch = 0.002, 1, 2, 1, 2
        args.width, args.no_s3 = 256, True
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not os.path.isdir(args.shm):
        raise SystemExit(f"--shm {args.shm} does not exist: give a tmpfs folder")
    stats = os.statvfs(args.shm)
    shm_size = stats.f_blocks * stats.f_frsize
    work = Path(tempfile.mkdtemp(prefix="statereg-bench-tiers-", dir=args.dir))
    shm = Path(tempfile.mkdtemp(prefix="statereg-bench-tiers-", dir=args.shm))
    os.environ["STATEREG_SHM_DIR"] = str(shm)
    started = time.perf_counter()
    try:
        with s3_server(work, not args.no_s3) as s3:
            bench = Bench(args, work, shm, s3)
            bench.run()
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"cores": os.cpu_count(), "kernel": platform.release(),
                    "torch": torch.__version__, "statereg": statereg.__version__,
                    "shm": args.shm, "shm_size_bytes": shm_size},
        "state_bytes": bench.nbytes,
        "rows": bench.rows,
        "summary": summary(bench.rows, args),
        "elapsed_s": round(time.perf_counter() - started, 1),
    }
    print(f"state: {bench.nbytes / 1e9:.2f} GB; {args.shm}: {shm_size / 2**30:.1f} GiB tmpfs; "
          f"{os.cpu_count()} cores; {result['elapsed_s']} s")
    print(markdown(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

