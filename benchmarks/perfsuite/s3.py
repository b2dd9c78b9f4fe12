"""statereg on an S3-compatible store against Amazon's s3torchconnector, DCP on s3fs and the
raw clients' floors, on one SeaweedFS server, interleaved in one run (issue 43).

Run by hand (see benchmarks/README.md; the figures go to benchmarks/results/s3.md and the end
of docs/performance.md):

    cd benchmarks && ../.venv/bin/python -m perfsuite.s3 --install --reps 3 --dir /var/tmp
    cd benchmarks && ../.venv/bin/python -m perfsuite.s3 --quick       # smoke test

--install creates the benchmark venv (--bench-venv, default /tmp/statereg-s3-bench) and pip
installs benchmarks/requirements-s3.txt into it (s3torchconnector, obstore: never statereg's
dependencies). That venv sees the main .venv's packages through a .pth file, so torch,
statereg, s3fs and boto3 are the very same; a run started with the main venv's python
re-executes itself with the benchmark venv's python whenever that venv exists. Without it the
contenders it holds are reported "not installed: run with --install".

The server is tests/storage_servers.py's SeaweedFS (`weed server -s3`, every port on
127.0.0.1, its data under --dir), started and stopped here. Two shapes of state, each a module
of fp32 tensors whose parameters are the preallocated destinations of every load:

- `large`: --gb (1.0) in --tensors (100) equal tensors;
- `small`: --small-tensors (20,000) tensors of 4-64 KB (log-uniform), per-object overhead.

Contenders, each in its own prefix of one bucket, in an order rotated every repetition:

- statereg: `s3://` sync save (a manager's later save), cold load into the live tensors
  (verified as read, the default), and `async: thread` stall (until save() returns) and
  commit (until wait() returns); its first async save is reported apart;
- s3torchconnector: dcp.save / dcp.load with its S3StorageWriter / S3StorageReader (CRT);
- dcp_fsspec: dcp.save / dcp.load with torch's FsspecWriter / FsspecReader on s3fs;
- obstore (floor): obstore.put / obstore.get of statereg's own checkpoint files, 8 at once;
- boto3 (floor): s3transfer multipart upload / ranged download of the same files.

Every load is checked bit for bit against the state (xxh3 of each tensor); a mismatch fails
the run. Reported per operation: median of --reps with min-max, GB/s of the state's bytes,
client CPU-s (this process, all threads), peak RSS and its growth during the operation.
Then issue 43's bars, evaluated on this one run. Writes s3.json and s3.md to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import fsspec
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch import nn

import statereg
from perfsuite.measure import GB, machine_info, peak_rss, tensor_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from storage_servers import (
    REPO,
    S3_KEY,
    S3_SECRET,
    WEED,
    new_bucket,
    s3_options,
    seaweedfs_args,
    start_server,
    wait_for_bucket_creation,
)

BENCH = Path(__file__).resolve().parents[1]
REQUIREMENTS = BENCH / "requirements-s3.txt"
DEFAULT_VENV = "/tmp/statereg-s3-bench"
NOT_INSTALLED = "not installed: run with --install"
REGION = "us-east-1"
IO_THREADS = 8  # statereg's default on object stores; the peers get as many writer threads
MiB = 1 << 20
CONTENDERS = ("statereg", "s3torchconnector", "dcp_fsspec", "obstore", "boto3")
FLOORS = ("obstore", "boto3")
OP_LABELS = {
    "save": "sync save",
    "load": "cold load into live tensors",
    "async_stall": "async save: training stall",
    "async_commit": "async save: until committed",
    "async_first_stall": "async save: stall of the first save",
    "put": "raw put of statereg's files",
    "get": "raw get of statereg's files",
}


def log(message: str) -> None:
    print(f"[s3 {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- the benchmark venv --------------------------------------------------------------------


def install_env(venv: Path, install_log: Path) -> str:
    """Create `venv` seeing this interpreter's site-packages and pip install the peers; "ok"
    or why it failed (pip's last error line)."""
    python = venv / "bin" / "python"
    if not python.exists():
        log(f"creating the benchmark venv {venv}")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; "
                              "print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    # addsitedir, not a bare path: the main venv's own .pth files (statereg's editable
    # install) must run too.
    Path(purelib, "statereg-main-venv.pth").write_text(
        f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    command = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-r",
               str(REQUIREMENTS)]
    log(f"pip install -r {REQUIREMENTS.name} (into {venv})")
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=1800,
                          env={k: v for k, v in os.environ.items()
                               if not k.startswith("PYTHON")})
    install_log.parent.mkdir(parents=True, exist_ok=True)
    install_log.write_text(f"$ {shlex.join(command)}\n{done.stdout}{done.stderr}\n")
    if done.returncode == 0:
        return "ok"
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    return f"install failed: {(errors or ['pip exit ' + str(done.returncode)])[-1]}"


def _in_venv(venv: Path) -> bool:
    return Path(sys.prefix).resolve() == venv.resolve()


def _versions() -> dict[str, str]:
    found = {"statereg": statereg.__version__, "torch": torch.__version__}
    for name in ("s3torchconnector", "obstore", "s3fs", "boto3"):
        try:
            module = __import__(name)
            found[name] = getattr(module, "__version__", "?")
        except ImportError:
            found[name] = NOT_INSTALLED
    return found


# --- the state -----------------------------------------------------------------------------


class Flat(nn.Module):
    """A module of named fp32 tensors (parameters `t00000`, ...): what statereg saves as its
    `model` component and the peers as a flat state dict of the very same tensors."""

    def __init__(self, sizes: list[int], seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        for i, numel in enumerate(sizes):
            self.register_parameter(f"t{i:05d}", nn.Parameter(
                torch.randn(numel, generator=generator), requires_grad=False))

    def flat(self) -> dict[str, torch.Tensor]:
        return {name: p.data for name, p in self.named_parameters()}


def shape_sizes(shape: str, args: argparse.Namespace) -> list[int]:
    """Element counts of the tensors of `shape`."""
    if shape == "large":
        return [int(args.gb * GB / 4 / args.tensors)] * args.tensors
    generator = torch.Generator().manual_seed(7)
    low, high = math.log(4 * 1024), math.log(64 * 1024)
    logs = torch.rand(args.small_tensors, generator=generator, dtype=torch.float64)
    return [int(math.exp(low + (high - low) * x)) // 4 for x in logs.tolist()]


def digests(live: dict[str, torch.Tensor]) -> dict[str, int]:
    return {name: xxhash.xxh3_64_intdigest(tensor_bytes(t)) for name, t in live.items()}


# --- the contenders ------------------------------------------------------------------------


class Server:
    """SeaweedFS on 127.0.0.1 with one bucket, and an s3fs filesystem for housekeeping."""

    def __init__(self, work: Path) -> None:
        workspace = work / "seaweedfs"
        workspace.mkdir(parents=True)
        # Its unix sockets in a short folder of their own: a --dir whose path is long would
        # make them longer than a socket's path may be (107 bytes), and weed exits at start.
        self.sockets = Path(tempfile.mkdtemp(prefix="statereg-weed-"))
        args = [a.replace("-master.volumeSizeLimitMB=64", "-master.volumeSizeLimitMB=1024")
                 .replace("-volume.max=32", "-volume.max=64")
                for a in seaweedfs_args(workspace, self.sockets)]
        # `weed` lies beside the main venv's python (the benchmark venv has none of its own).
        weed = WEED if WEED.exists() else REPO / ".venv" / "bin" / "weed"
        self.process = start_server("seaweedfs", args, workspace, "/", program=str(weed))
        self.endpoint = self.process.endpoint
        self.master = next(int(a.split("=")[1]) for a in self.process.process.args
                           if str(a).startswith("-master.port="))
        self.options = s3_options(self.endpoint)
        self.fs = fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False,
                                    **self.options)
        wait_for_bucket_creation(self.fs)  # the gateway answers before its filer is ready
        self.bucket = new_bucket(self.fs)

    def remove(self, prefix: str) -> None:
        """Delete a prefix and let the server reclaim the space (untimed housekeeping)."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(f"{self.bucket}/{prefix}", recursive=True)
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{self.master}/vol/vacuum?"
                                   "garbageThreshold=0.05", timeout=120).read()
        except OSError as exc:
            log(f"vacuum failed (space is reclaimed later): {exc}")

    def stop(self) -> None:
        self.process.stop()
        shutil.rmtree(self.sockets, ignore_errors=True)
        for arg in map(str, self.process.process.args):
            if ".grpc=" in arg:
                Path(f"/tmp/seaweedfs-{arg.split('.')[0].lstrip('-')}-grpc-"
                     f"{arg.split('=')[1]}.sock").unlink(missing_ok=True)


class Contender:
    """One library's operations on its own prefix; `ops` maps an operation to a callable of
    the repetition number. Loads fill `live`, which the caller checks bit for bit."""

    name = ""
    library = ""
    floor = False

    shape = ""  # each shape writes under its own prefix (set by run_shape)

    def __init__(self, server: Server, live: dict[str, torch.Tensor]) -> None:
        self.server, self.live = server, live
        self.status = "ok"

    def prefix(self, rep: int) -> str:
        return f"{self.shape}/{self.name}/{rep}"

    def url(self, rep: int) -> str:
        return f"s3://{self.server.bucket}/{self.prefix(rep)}"

    def ops(self) -> dict[str, Callable[[int], None]]:
        raise NotImplementedError

    def clean(self, rep: int) -> None:
        self.server.remove(self.prefix(rep))

    def close(self) -> None:
        """Release clients and managers."""


class Statereg(Contender):
    name, library = "statereg", f"statereg {statereg.__version__} (s3fs)"

    def __init__(self, server: Server, live: dict[str, torch.Tensor], module: Flat,
                 shape: str) -> None:
        super().__init__(server, live)

        def spec(kind: str, save: dict[str, Any]) -> dict[str, Any]:
            return {"storage": {"url": f"s3://{server.bucket}/{shape}/statereg-{kind}",
                                "options": server.options},
                    "save": save, "components": {"model": {"kind": "model"}}}

        self.sync = statereg.CheckpointManager(spec("sync", {}), model=module)
        self.asynchronous = statereg.CheckpointManager(spec("async", {"async": "thread"}),
                                                       model=module)
        self.steps = {"sync": 0, "async": 0}
        self.stall = 0.0

    def ops(self) -> dict[str, Callable[[int], None]]:
        def save(rep: int) -> None:
            self.steps["sync"] += 1
            self.sync.save(step=self.steps["sync"])

        def load(rep: int) -> None:
            self.sync.load(step=self.steps["sync"])

        return {"save": save, "load": load}

    def async_save(self) -> tuple[float, float]:
        """One async save: (stall, until committed)."""
        self.steps["async"] += 1
        start = time.perf_counter()
        self.asynchronous.save(step=self.steps["async"])
        staged = time.perf_counter()
        self.asynchronous.wait()
        return staged - start, time.perf_counter() - start

    def clean(self, rep: int) -> None:
        """Delete the checkpoints this repetition made (untimed), as the peers' are: each
        later save is still a manager's later save of a new step."""
        fs, bucket = self.server.fs, self.server.bucket
        for kind in ("sync", "async"):
            root = f"{bucket}/{self.shape}/statereg-{kind}"
            with contextlib.suppress(FileNotFoundError):
                for entry in fs.ls(root, detail=False):
                    if entry.rstrip("/").rsplit("/", 1)[-1].startswith("step_"):
                        self.server.remove(entry.removeprefix(f"{bucket}/"))

    def close(self) -> None:
        self.asynchronous.close()
        self.sync.close()


class S3TorchConnector(Contender):
    name = "s3torchconnector"

    def __init__(self, server: Server, live: dict[str, torch.Tensor]) -> None:
        super().__init__(server, live)
        import s3torchconnector
        from s3torchconnector import S3ClientConfig
        from s3torchconnector.dcp import S3StorageReader, S3StorageWriter

        self.library = f"s3torchconnector {s3torchconnector.__version__} (CRT)"
        self.config = S3ClientConfig(force_path_style=True)
        self.writer, self.reader = S3StorageWriter, S3StorageReader

    def ops(self) -> dict[str, Callable[[int], None]]:
        def save(rep: int) -> None:
            writer = self.writer(REGION, self.url(rep), s3client_config=self.config,
                                 thread_count=IO_THREADS)
            dcp.save(self.live, storage_writer=writer, no_dist=True)

        def load(rep: int) -> None:
            reader = self.reader(REGION, self.url(rep), s3client_config=self.config)
            dcp.load(self.live, storage_reader=reader, no_dist=True)

        return {"save": save, "load": load}


class DcpFsspec(Contender):
    name, library = "dcp_fsspec", f"torch {torch.__version__} FsspecWriter/Reader on s3fs"

    def ops(self) -> dict[str, Callable[[int], None]]:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        def save(rep: int) -> None:
            writer = FsspecWriter(self.url(rep), sync_files=False, thread_count=IO_THREADS,
                                  **self.server.options)
            dcp.save(self.live, storage_writer=writer, no_dist=True)

        def load(rep: int) -> None:
            dcp.load(self.live, storage_reader=FsspecReader(self.url(rep), **self.server.options),
                     no_dist=True)

        return {"save": save, "load": load}


class RawFloor(Contender):
    """A raw client putting and getting statereg's own checkpoint files (`files`)."""

    floor = True

    def __init__(self, server: Server, live: dict[str, torch.Tensor],
                 files: dict[str, bytes]) -> None:
        super().__init__(server, live)
        self.files = files


class Obstore(RawFloor):
    name = "obstore"

    def __init__(self, server: Server, live: dict[str, torch.Tensor],
                 files: dict[str, bytes]) -> None:
        super().__init__(server, live, files)
        import obstore
        from obstore.store import S3Store

        self.library = f"obstore {obstore.__version__} (Rust object_store)"
        self.obstore = obstore
        self.store = S3Store(server.bucket, endpoint=server.endpoint, access_key_id=S3_KEY,
                             secret_access_key=S3_SECRET, region=REGION,
                             virtual_hosted_style_request=False,
                             # Generous timeouts: a shared 2-core machine can stall a request.
                             client_options={"allow_http": True, "timeout": "600s",
                                             "connect_timeout": "60s"})

    def ops(self) -> dict[str, Callable[[int], None]]:
        def put(rep: int) -> None:
            def one(item: tuple[str, bytes]) -> None:
                self.obstore.put(self.store, f"{self.prefix(rep)}/{item[0]}", item[1],
                                 chunk_size=16 * MiB, max_concurrency=4)

            with ThreadPoolExecutor(IO_THREADS) as pool:
                list(pool.map(one, self.files.items()))

        def get(rep: int) -> None:
            def one(path: str) -> int:
                return len(self.obstore.get(self.store, f"{self.prefix(rep)}/{path}").bytes())

            with ThreadPoolExecutor(IO_THREADS) as pool:
                got = sum(pool.map(one, self.files))
            assert got == sum(map(len, self.files.values())), "obstore got short files"

        return {"put": put, "get": get}


class Boto3(RawFloor):
    name = "boto3"

    def __init__(self, server: Server, live: dict[str, torch.Tensor],
                 files: dict[str, bytes]) -> None:
        super().__init__(server, live, files)
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.library = f"boto3 {boto3.__version__} (s3transfer multipart)"
        self.client = boto3.client(
            "s3", endpoint_url=server.endpoint, aws_access_key_id=S3_KEY,
            aws_secret_access_key=S3_SECRET, region_name=REGION,
            config=Config(max_pool_connections=32, s3={"addressing_style": "path"},
                          read_timeout=600, connect_timeout=60))
        self.config = TransferConfig(multipart_threshold=16 * MiB,
                                     multipart_chunksize=16 * MiB, max_concurrency=IO_THREADS)

    def ops(self) -> dict[str, Callable[[int], None]]:
        from s3transfer.manager import TransferManager

        def put(rep: int) -> None:
            with TransferManager(self.client, self.config) as manager:
                futures = [manager.upload(io.BytesIO(data), self.server.bucket,
                                          f"{self.prefix(rep)}/{path}")
                           for path, data in self.files.items()]
                for future in futures:
                    future.result()

        def get(rep: int) -> None:
            buffers = {path: io.BytesIO() for path in self.files}
            with TransferManager(self.client, self.config) as manager:
                futures = [manager.download(self.server.bucket, f"{self.prefix(rep)}/{path}",
                                            buffer) for path, buffer in buffers.items()]
                for future in futures:
                    future.result()
            assert all(len(buffers[p].getbuffer()) == len(d) for p, d in self.files.items())

        return {"put": put, "get": get}


def checkpoint_files(module: Flat) -> dict[str, bytes]:
    """The files of one statereg checkpoint of `module` (8 writers, as on S3), made in memory."""
    root = f"/statereg-s3-reference-{os.getpid()}"
    mgr = statereg.CheckpointManager(
        {"storage": {"url": f"memory://{root}", "io_threads": IO_THREADS},
         "components": {"model": {"kind": "model"}}}, model=module)
    mgr.save(step=1)
    mgr.close()
    fs = fsspec.filesystem("memory")
    files = {path.removeprefix(f"{root}/"): bytes(fs.cat_file(path)) for path in fs.find(root)}
    fs.rm(root, recursive=True)
    return files


# --- the run -------------------------------------------------------------------------------


def _timed(operation: Callable[[], Any]) -> dict[str, float]:
    with peak_rss() as peak:
        cpu, start = time.process_time(), time.perf_counter()
        operation()
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"s": seconds, "cpu_s": cpu, "peak_gb": peak.peak_gb,
            "growth_gb": max(0.0, peak.peak_gb - peak.start_gb)}


def _row(op: str, samples: list[dict[str, float]], nbytes: int) -> dict[str, Any]:
    seconds = [s["s"] for s in samples]
    median = statistics.median(seconds)
    return {"label": OP_LABELS[op], "seconds": [round(s, 4) for s in seconds],
            "median_s": round(median, 4), "min_s": round(min(seconds), 4),
            "max_s": round(max(seconds), 4), "bytes": nbytes,
            "gb_per_s": round(nbytes / median / GB, 3) if median > 0 else None,
            "cpu_s": round(statistics.median(s["cpu_s"] for s in samples), 3),
            "peak_rss_gb": round(max(s["peak_gb"] for s in samples), 3),
            "rss_growth_gb": round(max(s["growth_gb"] for s in samples), 3)}


def run_shape(shape: str, args: argparse.Namespace, server: Server,
              available: dict[str, str]) -> dict[str, Any]:
    sizes = shape_sizes(shape, args)
    module = Flat(sizes, seed=len(sizes))
    live = module.flat()
    nbytes = sum(t.numel() * t.element_size() for t in live.values())
    expected = digests(live)
    log(f"{shape}: {len(live)} tensors, {nbytes / GB:.3f} GB")
    files = checkpoint_files(module)
    made: dict[str, Contender] = {"statereg": Statereg(server, live, module, shape)}
    entries: dict[str, dict[str, Any]] = {}
    for name, build in (("s3torchconnector", lambda: S3TorchConnector(server, live)),
                        ("dcp_fsspec", lambda: DcpFsspec(server, live)),
                        ("obstore", lambda: Obstore(server, live, files)),
                        ("boto3", lambda: Boto3(server, live, files))):
        package = {"dcp_fsspec": "s3fs"}.get(name, name)
        if available.get(package, NOT_INSTALLED) == NOT_INSTALLED:
            entries[name] = {"status": NOT_INSTALLED, "rows": {}}
            continue
        if name in args.skip.split(","):
            entries[name] = {"status": "skipped: --skip", "rows": {}}
            continue
        made[name] = build()
    for contender in made.values():
        contender.shape = shape
    samples: dict[str, dict[str, list[dict[str, float]]]] = {n: {} for n in made}
    first_stall: dict[str, float] | None = None
    names = list(made)
    for rep in range(args.reps):
        load_avg = os.getloadavg()[0]
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            contender = made[name]
            if contender.status != "ok":
                continue
            log(f"{shape} rep {rep + 1}/{args.reps}: {name} (load average {load_avg:.1f})")
            try:
                measure_ops(contender, rep, live, expected, samples[name], shape)
            except AssertionError:
                raise
            except Exception as exc:  # one client failing ends its rows, not the run
                contender.status = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0]}"
                log(f"  {name}: {contender.status}")
                continue
            if isinstance(contender, Statereg):
                if first_stall is None:
                    stall, _ = contender.async_save()
                    first_stall = {"s": stall, "cpu_s": 0.0, "peak_gb": 0.0, "growth_gb": 0.0}
                with peak_rss() as peak:
                    stall, commit = contender.async_save()
                log(f"  statereg async: stall {stall:.3f} s, committed {commit:.3f} s")
                for op, seconds in (("async_stall", stall), ("async_commit", commit)):
                    samples[name].setdefault(op, []).append(
                        {"s": seconds, "cpu_s": 0.0, "peak_gb": peak.peak_gb,
                         "growth_gb": max(0.0, peak.peak_gb - peak.start_gb)})
            contender.clean(rep)
    for name, contender in made.items():
        contender.close()
        rows = {op: _row(op, got, nbytes) for op, got in samples[name].items() if got}
        if name == "statereg" and first_stall is not None:
            rows["async_first_stall"] = _row("async_first_stall", [first_stall], nbytes)
        entries[name] = {"status": contender.status, "library": contender.library,
                         "floor": contender.floor, "rows": rows}
    return {"tensors": len(live), "bytes": nbytes, "checkpoint_files": len(files),
            "checkpoint_bytes": sum(map(len, files.values())), "verified": True,
            "contenders": entries, "bars": bars(entries, nbytes)}


def measure_ops(contender: Contender, rep: int, live: dict[str, torch.Tensor],
                expected: dict[str, int], samples: dict[str, list[dict[str, float]]],
                shape: str) -> None:
    """One repetition of `contender`'s operations; every load checked bit for bit."""
    for op, call in contender.ops().items():
        if op == "load":
            for tensor in live.values():
                tensor.zero_()
        got = _timed(lambda c=call, r=rep: c(r))
        samples.setdefault(op, []).append(got)
        log(f"  {contender.name} {op}: {got['s']:.3f} s, {got['cpu_s']:.2f} CPU-s, "
            f"RSS +{got['growth_gb']:.2f} GB")
        if op == "load":
            wrong = [k for k, d in digests(live).items() if d != expected[k]]
            if wrong:
                raise AssertionError(f"{contender.name}'s load of {shape} is not "
                                     f"bit-identical: {len(wrong)} tensors differ, e.g. "
                                     f"{wrong[0]}")


def bars(entries: dict[str, dict[str, Any]], nbytes: int) -> list[dict[str, Any]]:
    """Issue 43's acceptance bars on this shape's medians (None where a side is missing)."""
    def median(name: str, op: str) -> float | None:
        row = entries.get(name, {}).get("rows", {}).get(op)
        return row["median_s"] if row else None

    def floor(op: str) -> tuple[float | None, str]:
        found = [(median(n, op), n) for n in FLOORS if median(n, op) is not None]
        return min(found) if found else (None, "no floor measured")

    out = []
    for ours, raw in (("save", "put"), ("load", "get")):
        mine = median("statereg", ours)
        best, which = floor(raw)
        value = round(best / mine, 3) if best and mine else None
        out.append({"bar": f"statereg {ours}: throughput over the faster raw floor ({which})",
                    "value": value, "target": ">= 0.9",
                    "met": None if value is None else value >= 0.9})
        peer = median("s3torchconnector", ours)
        value = round(mine / peer, 3) if peer and mine else None
        out.append({"bar": f"statereg {ours}: time over DCP + s3torchconnector's",
                    "value": value, "target": "<= 1.0",
                    "met": None if value is None else value <= 1.0})
    from statereg.backends.s3 import S3Backend

    for op, stated, what in (("load", "read_window", "read window"),
                             ("save", "write_window", "part buffers + 64 MiB")):
        row = entries.get("statereg", {}).get("rows", {}).get(op)
        if not row:
            continue
        window = getattr(S3Backend, stated, None)
        growth = row["rss_growth_gb"] * GB
        out.append({"bar": f"statereg {op}: peak RSS growth over the live state (GB), against "
                           f"the stated {what} ({window and window / GB:.3f} GB)"
                           if window else f"statereg {op}: peak RSS growth (no stated window)",
                    "value": round(growth / GB, 3),
                    "target": f"<= {window / GB:.3f}" if window else "a stated window",
                    "met": bool(window) and growth <= window,
                    "over_state": round(row["peak_rss_gb"] * GB / nbytes, 3)})
    return out


def _cell(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def markdown(results: dict[str, Any]) -> str:
    machine = results["machine"]
    lines = [f"## S3 on SeaweedFS ({machine['date']})", "",
             f"Command: `{results['command']}`  ",
             f"Machine: {machine['cpu']}, {machine['cores']} cores, {machine['memory_gb']} GB; "
             f"load average {results['load_average']} (start, end); versions "
             + ", ".join(f"{k} {v}" for k, v in results["versions"].items()), ""]
    for shape, found in results["shapes"].items():
        lines += [f"### {shape}: {found['tensors']} tensors, {found['bytes'] / GB:.3f} GB "
                  f"({found['checkpoint_files']} statereg files)", "",
                  "| contender | operation | median s | min-max s | GB/s | client CPU-s | "
                  "peak RSS GB | RSS growth GB |", "|---|---|---|---|---|---|---|---|"]
        for name, entry in found["contenders"].items():
            if entry["status"] != "ok":
                lines.append(f"| {name} | {entry['status']} | | | | | | |")
                continue
            for row in entry["rows"].values():
                lines.append(
                    f"| {name} | {row['label']} | {row['median_s']:.3f} | "
                    f"{row['min_s']:.3f}-{row['max_s']:.3f} | {_cell(row['gb_per_s'], 2)} | "
                    f"{row['cpu_s']:.2f} | {row['peak_rss_gb']:.2f} | "
                    f"{row['rss_growth_gb']:.2f} |")
        lines += ["", "| bar | value | target | met |", "|---|---|---|---|"]
        lines += [f"| {b['bar']} | {_cell(b['value'])} | {b['target']} | "
                  f"{'—' if b['met'] is None else 'yes' if b['met'] else 'no'} |"
                  for b in found["bars"]]
        lines.append("")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0, help="large shape's bytes (1.0 GB)")
    parser.add_argument("--tensors", type=int, default=100, help="large shape's tensors")
    parser.add_argument("--small-tensors", type=int, default=20000,
                        help="small shape's tensors, 4-64 KB each (20000)")
    parser.add_argument("--shapes", default="large,small", help="large,small")
    parser.add_argument("--skip", default="",
                        help="peers to leave out, comma-separated (e.g. dcp_fsspec: its load "
                             "of 20,000 tensors is one GET per tensor, minutes here)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions (3)")
    parser.add_argument("--dir", default=None, help="where SeaweedFS keeps its data")
    parser.add_argument("--out", default="s3-results", help="folder for s3.json and s3.md")
    parser.add_argument("--bench-venv", default=DEFAULT_VENV,
                        help=f"the benchmark venv with the peers (default {DEFAULT_VENV})")
    parser.add_argument("--install", action="store_true",
                        help="create the benchmark venv and pip install "
                             "benchmarks/requirements-s3.txt into it (the only option that "
                             "downloads anything)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 4 MB in 4 tensors, 50 small tensors, 1 repetition")
    args = parser.parse_args(argv)
    if args.quick:
        args.gb, args.tensors, args.small_tensors, args.reps = 0.004, 4, 50, 1
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    venv = Path(args.bench_venv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    installed = None
    if args.install:
        installed = install_env(venv, out / "bench-install.log")
        log(f"install: {installed}")
    python = venv / "bin" / "python"
    if python.exists() and not _in_venv(venv):
        log(f"re-running with {python}")
        os.chdir(BENCH)
        rest = [a for a in argv if a != "--install"]
        os.execv(str(python), [str(python), "-m", "perfsuite.s3", *rest])
    # The peers' clients read the endpoint and credentials from the environment.
    work = Path(tempfile.mkdtemp(prefix="statereg-s3-", dir=args.dir))
    versions = _versions()
    results: dict[str, Any] = {
        "scenario": "s3", "command": " ".join(["python -m perfsuite.s3", *map(shlex.quote,
                                                                            argv)]),
        "config": dict(vars(args)), "machine": machine_info(work), "versions": versions,
        "bench_venv": {"path": str(venv), "used": _in_venv(venv), "install": installed},
        "load_average": [round(os.getloadavg()[0], 2)], "shapes": {}}
    started = time.perf_counter()
    server = None
    try:
        server = Server(work)
        os.environ.update({"AWS_ENDPOINT_URL": server.endpoint, "AWS_ACCESS_KEY_ID": S3_KEY,
                           "AWS_SECRET_ACCESS_KEY": S3_SECRET, "AWS_REGION": REGION,
                           "AWS_EC2_METADATA_DISABLED": "true"})
        for shape in [s.strip() for s in args.shapes.split(",") if s.strip()]:
            results["shapes"][shape] = run_shape(shape, args, server, versions)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    results["load_average"].append(round(os.getloadavg()[0], 2))
    results["elapsed_s"] = round(time.perf_counter() - started, 1)
    (out / "s3.json").write_text(json.dumps(results, indent=1, default=str))
    table = markdown(results)
    (out / "s3.md").write_text(table)
    print(table)
    log(f"done in {results['elapsed_s']:.0f} s; wrote {out / 's3.json'} and {out / 's3.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
