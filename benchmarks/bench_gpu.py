"""statereg on a CUDA GPU: correctness checks, exact resume, the async save's stall, loads.

Run by hand on a machine with a GPU (not a test; it exits 0 with a note where there is none):

    python benchmarks/bench_gpu.py --gb 4 --out /tmp/gpu.json

Sections (`--only checks,resume,stall,load,tiers,ranks` runs some):
  checks  CUDA-only correctness: every async mode round-trips a CUDA model + AdamW bit for
          bit; early_return commits the state as of save() while the loop changes it; loads
          into CUDA tensors of several dtypes and sizes (larger than a landing slice,
          compressed too) are exact; a flipped byte fails the load; CUDA RNG resumes; the
          page-locked staging memory against torch's caching host allocator.
  resume  examples/train_demo.py --device cuda: train, SIGKILL, resume, losses bit-identical.
  stall   a model + AdamW state of --gb on the GPU: how long save() holds the loop for
          async thread / pinned / early_return, against the floor (one device-to-host copy of
          the same tensors into page-locked buffers), and the time until committed on the
          local disk (--dir).
  load    load() of that state into CUDA tensors against plain dcp.load into the same
          tensors, from the same disk; warm page cache, and cold where caches can be dropped.
  tiers   a GPU training loop with a memory-tier checkpoint every 10 steps (synchronous, and
          async pinned + early_return) against the same loop without checkpoints.
  ranks   2 gloo ranks sharing the GPU: a replicated CUDA model + AdamW saved async and
          loaded read-once (one rank reads, the others receive) bit for bit on every rank.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from perfsuite.floor import write_buffered
from perfsuite.measure import drop_caches
from torch import nn

import statereg
from statereg.dcp.device_reads import LANDING_SLICE
from statereg.engine.layouts import Captured
from statereg.engine.staging import StagingArea

HERE = Path(__file__).resolve().parent
RESULTS: dict[str, Any] = {}
PROFILE = False


def log(message: str) -> None:
    print(message, flush=True)


def build(gb: float, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Linear layers of 4096 x 4096 fp32 on the GPU and AdamW after one step: the weights
    are a third of `gb`, the two moments the rest."""
    torch.manual_seed(seed)
    width = 4096
    layers = max(1, round(gb * 1e9 / 3 / (width * width * 4)))
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return model, opt


def state_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The model's tensors and the optimizer's CUDA state, in parameter order and by state
    key: the comparison is by name, whatever order each dict holds its entries in."""
    tensors = list(model.state_dict().values())
    for param in model.parameters():
        state = opt.state.get(param, {})
        tensors += [state[key] for key in sorted(state)
                    if isinstance(state[key], torch.Tensor) and state[key].is_cuda]
    return tensors


def spec(root: Path, **save: Any) -> dict[str, Any]:
    return {"storage": {"url": str(root)},
            "components": {"model": {"kind": "model"}, "optimizer": {"kind": "optimizer"}},
            "save": {"keep_last": 2, **save}}


# -- checks -------------------------------------------------------------------------------


def host_pinned_bytes() -> int:
    """Bytes torch's caching host allocator holds (its key names vary across releases)."""
    stats = getattr(torch.cuda, "host_memory_stats", lambda: {})()
    for key in ("reserved_bytes.current", "segment_bytes.current", "allocated_bytes.current"):
        if key in stats:
            return int(stats[key])
    log(f"  host_memory_stats has no byte count: {sorted(stats)}")
    return 0


def checks(work: Path) -> None:
    found: dict[str, Any] = {}
    modes = [{"async": "off"}, {"async": "thread"}, {"async": "pinned"},
             {"async": "thread", "early_return": True},
             {"async": "pinned", "early_return": True}]
    for save in modes:
        name = "+".join(f"{k}={v}" for k, v in save.items())
        root = work / f"modes-{len(found)}"
        source = build(0.05, seed=1)
        snapshot = [t.clone() for t in state_tensors(*source)]
        mgr = statereg.CheckpointManager(spec(root, **save), model=source[0],
                                         optimizer=source[1])
        handle = mgr.save(step=1)
        # The loop goes on: forward work queued on the stream, then (after wait_staged)
        # the weights change in place, as optimizer.step() would.
        x = torch.randn(256, 4096, device="cuda")
        for layer in source[0]:
            x = layer(x)
        handle.wait_staged()
        with torch.no_grad():
            for t in state_tensors(*source):
                t.add_(1)
        mgr.close()
        target = build(0.05, seed=2)
        statereg.CheckpointManager(spec(root), model=target[0], optimizer=target[1]).load()
        loaded = state_tensors(*target)
        exact = all(torch.equal(a, b) for a, b in zip(loaded, snapshot, strict=True))
        on_gpu = all(t.is_cuda for t in loaded)
        found[name] = {"exact": exact, "loaded_on_gpu": on_gpu}
        log(f"  round trip {name}: exact={exact} on_gpu={on_gpu}")

    # Dtypes and sizes through the landing slices (16 MiB): several slices, a ragged end.
    class Holder(nn.Module):
        def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
            super().__init__()
            for key, value in tensors.items():
                self.register_buffer(key, value)

    def sample() -> dict[str, torch.Tensor]:
        g = torch.Generator(device="cuda").manual_seed(5)
        return {"big": torch.randn(LANDING_SLICE // 4 * 2 + 12345, device="cuda", generator=g),
                "bf16": torch.randn(1000, 33, device="cuda", generator=g).bfloat16(),
                "fp16": torch.randn(7, 7, device="cuda", generator=g).half(),
                "ints": torch.arange(10**6, device="cuda", dtype=torch.int64),
                "flags": torch.rand(999, device="cuda", generator=g) > 0.5,
                "scalar": torch.tensor(2.5, device="cuda", dtype=torch.float64)}

    for compression in (None, "zstd"):
        root = work / f"dtypes-{compression}"
        storage: dict[str, Any] = {"url": str(root)}
        if compression:
            storage["compression"] = compression
        declared = {"storage": storage, "components": {"holder": {"kind": "model"}}}
        statereg.CheckpointManager(declared, holder=Holder(sample())).save(step=1)
        empty = {k: torch.zeros_like(v) for k, v in sample().items()}
        holder = Holder(empty)
        statereg.CheckpointManager(declared, holder=holder).load()
        exact = all(torch.equal(getattr(holder, k), v) for k, v in sample().items())
        found[f"dtypes compression={compression}"] = exact
        log(f"  dtypes and sizes, compression={compression}: exact={exact}")

    # A flipped byte inside the big tensor's payload fails the load, naming the file.
    root = work / "dtypes-None" / "step_00000001" / "holder"
    data = max(root.rglob("*.distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    holder = Holder({k: torch.zeros_like(v) for k, v in sample().items()})
    declared = {"storage": {"url": str(work / "dtypes-None")},
                "components": {"holder": {"kind": "model"}}}
    try:
        statereg.CheckpointManager(declared, holder=holder).load(step=1)
        found["flipped byte"] = "loaded: NOT DETECTED"
    except statereg.CorruptCheckpointError as exc:
        found["flipped byte"] = f"CorruptCheckpointError: {str(exc)[:160]}"
    log(f"  flipped byte: {found['flipped byte']}")

    # CUDA RNG: what dropout draws after a resume is what it drew before.
    root = work / "rng"
    declared = {"storage": {"url": str(root)}, "components": {"rng": {"kind": "rng"}}}
    torch.cuda.manual_seed_all(7)
    torch.rand(10, device="cuda")
    statereg.CheckpointManager(declared).save(step=1)
    expected = torch.rand(1000, device="cuda")
    torch.cuda.manual_seed_all(99)
    statereg.CheckpointManager(declared).load()
    found["cuda rng"] = bool(torch.equal(torch.rand(1000, device="cuda"), expected))
    log(f"  CUDA RNG resumes: {found['cuda rng']}")

    # Page-locked memory: statereg's staging (exact, registered) against pin_memory(), for
    # an embedding of a 50,257-token vocabulary (not a power of two) and its AdamW moments.
    model = nn.Embedding(50257, 2048).cuda()
    opt = torch.optim.AdamW(model.parameters())
    model.weight.grad = torch.randn_like(model.weight)
    opt.step()
    tensors = state_tensors(model, opt)
    need = sum(t.nbytes for t in tensors)
    torch.cuda.synchronize()
    before = host_pinned_bytes()
    pinned = [torch.empty(t.shape, dtype=t.dtype).pin_memory() for t in tensors]
    after = host_pinned_bytes()
    del pinned
    area = StagingArea(pinned=True)
    area.stage([Captured(SimpleNamespace(component="m"),  # type: ignore[arg-type]
                         tensors={str(i): t for i, t in enumerate(tensors)})])
    found["pinned bytes"] = {"state": need, "statereg staging": area.nbytes,
                             "pin_memory() caching allocator": after - before}
    log(f"  page-locked bytes for {need / 1e9:.3f} GB of state: statereg {area.nbytes / 1e9:.3f}"
        f" GB, pin_memory() {(after - before) / 1e9:.3f} GB")
    del area, model, opt, tensors
    torch.cuda.empty_cache()
    RESULTS["checks"] = found


# -- resume -------------------------------------------------------------------------------


def resume(work: Path) -> None:
    demo = HERE.parent / "examples" / "train_demo.py"
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, str(demo), "--device", "cuda",
                           "--workdir", str(work / "demo")], capture_output=True, text=True)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-6:]
    RESULTS["resume"] = {"returncode": proc.returncode, "tail": tail,
                         "seconds": round(time.perf_counter() - started, 1)}
    log("  " + "\n  ".join(tail))


# -- stall --------------------------------------------------------------------------------


def floor(tensors: list[torch.Tensor], reps: int) -> float:
    """One device-to-host copy of `tensors` into preallocated page-locked buffers."""
    buffers = [torch.empty(t.shape, dtype=t.dtype).pin_memory() for t in tensors]
    times = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for dst, src in zip(buffers, tensors, strict=True):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    del buffers
    return statistics.median(times[1:])


def forward_work(model: nn.Module, batch: int) -> None:
    """Forward and backward of the loop, queued on the GPU; the caller times it."""
    x = torch.randn(batch, 4096, device="cuda", requires_grad=False)
    for layer in model:
        x = torch.relu(layer(x))
    x.sum().backward()


def stall(work: Path, gb: float, reps: int) -> None:
    model, opt = build(gb)
    tensors = state_tensors(model, opt)
    nbytes = sum(t.nbytes for t in tensors)
    copy_s = floor(tensors, reps)
    found: dict[str, Any] = {"state_gb": nbytes / 1e9, "floor_s": copy_s,
                             "floor_gbps": nbytes / copy_s / 1e9,
                             "disk": disk_floor(work, nbytes)}
    log(f"  state {nbytes / 1e9:.2f} GB; floor (D2H into page-locked buffers) {copy_s:.3f} s "
        f"= {nbytes / copy_s / 1e9:.1f} GB/s")
    # The loop's own forward+backward, for the early_return overlap.
    for _ in range(2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        forward_work(model, 4096)
        torch.cuda.synchronize()
        step_s = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    found["step_s"] = step_s
    modes = {"thread": {"async": "thread"}, "pinned": {"async": "pinned"},
             "thread+early_return": {"async": "thread", "early_return": True},
             "pinned+early_return": {"async": "pinned", "early_return": True}}
    for name, save in modes.items():
        root = work / f"stall-{name}"
        mgr = statereg.CheckpointManager(spec(root, **save), model=model, optimizer=opt)
        rows = []
        for step in range(reps + 1):
            torch.cuda.synchronize()
            start = time.perf_counter()
            handle = mgr.save(step=step)
            returned = time.perf_counter()
            forward_work(model, 4096)  # the loop goes on while the copy runs
            handle.wait_staged()
            torch.cuda.synchronize()
            staged = time.perf_counter()
            model.zero_grad(set_to_none=True)
            mgr.wait()
            committed = time.perf_counter()
            rows.append({"in_save_s": returned - start,
                         "stall_s": max(0.0, staged - start - step_s),
                         "committed_s": committed - start})
        mgr.close()
        shutil.rmtree(root, ignore_errors=True)
        later = rows[1:]
        summary = {key: statistics.median(r[key] for r in later) for key in later[0]}
        summary["first_save"] = rows[0]
        summary["stall_vs_floor"] = summary["stall_s"] / copy_s
        summary["stage_gbps"] = nbytes / max(summary["stall_s"], 1e-9) / 1e9
        summary["commit_gbps"] = nbytes / summary["committed_s"] / 1e9
        found[name] = summary
        log(f"  {name:20s} in save() {summary['in_save_s']:.3f} s, stall "
            f"{summary['stall_s']:.3f} s ({summary['stall_vs_floor']:.2f}x the floor), "
            f"committed {summary['committed_s']:.2f} s ({summary['commit_gbps']:.2f} GB/s); "
            f"first save: stall {rows[0]['stall_s']:.2f} s")
    RESULTS["stall"] = found
    del model, opt, tensors
    torch.cuda.empty_cache()


# -- load ---------------------------------------------------------------------------------


def disk_floor(work: Path, nbytes: int) -> dict[str, float]:
    """The disk alone: write `nbytes` in 64 MiB blocks and fsync; read the file back warm
    (page cache) and, where caches can be dropped, cold (16 MiB O_DIRECT reads)."""
    block = torch.frombuffer(bytearray(os.urandom(64 << 20)), dtype=torch.uint8)
    path = work / "floor.bin"
    start = time.perf_counter()
    write_buffered(path, [block] * max(1, nbytes // block.numel()))  # the suite's floor
    size = path.stat().st_size
    found = {"write_fsync_gbps": size / (time.perf_counter() - start) / 1e9}
    for cache in ("warm", "cold"):
        if cache == "cold" and not drop_caches():
            break
        flags = os.O_RDONLY | (os.O_DIRECT if cache == "cold" else 0)
        aligned = memoryview(mmap.mmap(-1, 16 << 20))  # page-aligned, as O_DIRECT needs
        fd = os.open(path, flags)
        start = time.perf_counter()
        while os.readv(fd, [aligned]):
            pass
        os.close(fd)
        found[f"read_{cache}_gbps"] = size / (time.perf_counter() - start) / 1e9
    path.unlink()
    log("  disk alone: " + ", ".join(f"{k} {v:.2f}" for k, v in found.items()))
    return found


def load(work: Path, gb: float, reps: int) -> None:
    model, opt = build(gb)
    nbytes = sum(t.nbytes for t in state_tensors(model, opt))
    ours = work / "load-statereg"
    statereg.CheckpointManager(spec(ours), model=model, optimizer=opt).save(step=1)
    plain = work / "load-dcp"
    flat = {"model": model.state_dict(),
            "optim": {f"{i}.{k}": v for i, s in enumerate(opt.state.values())
                      for k, v in s.items() if isinstance(v, torch.Tensor)}}
    dcp.save(flat, checkpoint_id=str(plain))
    expected = [t.clone() for t in state_tensors(model, opt)]
    with torch.no_grad():
        for t in state_tensors(model, opt):
            t.zero_()

    def run_ours() -> None:
        statereg.CheckpointManager(spec(ours), model=model, optimizer=opt).load()

    def run_dcp() -> None:
        dcp.load(flat, checkpoint_id=str(plain))

    found: dict[str, Any] = {"state_gb": nbytes / 1e9, "disk": disk_floor(work, nbytes)}
    can_drop = drop_caches()
    # statereg's writer lets the page cache drop what it wrote (local.py, _WritebackFile):
    # "warm" means both checkpoints were read once before, as a second load on the node.
    for path in (*ours.rglob("*"), *plain.rglob("*")):
        if path.is_file():
            path.read_bytes()
    for cache in ("warm", "cold") if can_drop else ("warm",):
        for name, fn in (("statereg", run_ours), ("dcp.load", run_dcp)):
            times = []
            for _ in range(reps + (cache == "warm")):
                if cache == "cold":
                    drop_caches()
                torch.cuda.synchronize()
                start = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            found[f"{name} {cache}"] = statistics.median(times[1:] if cache == "warm"
                                                         else times)
        found[f"speedup {cache}"] = found[f"dcp.load {cache}"] / found[f"statereg {cache}"]
        log(f"  {cache}: statereg {found[f'statereg {cache}']:.3f} s "
            f"({nbytes / found[f'statereg {cache}'] / 1e9:.1f} GB/s), dcp.load "
            f"{found[f'dcp.load {cache}']:.3f} s: {found[f'speedup {cache}']:.2f}x")
    if PROFILE:
        import cProfile
        import pstats
        profile = cProfile.Profile()
        profile.runcall(run_ours)
        pstats.Stats(profile).sort_stats("tottime").print_stats(15)
    found["exact"] = all(torch.equal(a, b) for a, b in
                         zip(state_tensors(model, opt), expected, strict=True))
    log(f"  loaded state equals the saved one: {found['exact']}")
    RESULTS["load"] = found


# -- ranks ----------------------------------------------------------------------------------


RANK_MODES = {"off": {"async": "off"}, "thread": {"async": "thread"},
              "pinned": {"async": "pinned"},
              "thread+early_return": {"async": "thread", "early_return": True},
              "pinned+early_return": {"async": "pinned", "early_return": True}}


def rank_job(rank: int, world: int, root: str, init: str) -> None:
    """One of `world` gloo ranks sharing the one GPU: a replicated CUDA model + AdamW saved
    in every async mode and loaded into a fresh CUDA model, which reads each file on one
    rank and broadcasts its items (read once). Writes what differed to ROOT-rankN.json."""
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)

    def trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        """The same bits on every rank: trained on the CPU with one thread, then moved (two
        processes sharing a GPU may not compute bit-identical steps)."""
        torch.set_num_threads(1)
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(8, 1024)).square().mean().backward()
        opt.step()
        state = opt.state_dict()
        model.cuda()
        opt = torch.optim.AdamW(model.parameters())
        opt.load_state_dict(state)  # its moments move to the parameters' device
        return model, opt

    replicated = {"sharing": "replicated", "validate": True}  # the ranks' copies must agree
    found: dict[str, Any] = {}
    for mode, save in RANK_MODES.items():
        declared = {"storage": {"url": f"{root}/{mode}"},
                    "components": {"model": {"kind": "model", **replicated},
                                   "optimizer": {"kind": "optimizer", **replicated}},
                    "save": save}
        source = trained(seed=1)
        expected = [t.clone() for t in state_tensors(*source)]
        mgr = statereg.CheckpointManager(declared, model=source[0], optimizer=source[1])
        mgr.save(1).wait_staged()
        with torch.no_grad():
            for t in state_tensors(*source):
                t.add_(1)  # the loop moves on: the checkpoint keeps the state at save()
        mgr.close()
        target = trained(seed=99)
        statereg.CheckpointManager(declared, model=target[0], optimizer=target[1]).load()
        loaded = state_tensors(*target)
        found[mode] = {
            "off_gpu": [i for i, t in enumerate(loaded) if not t.is_cuda],
            "differ": [i for i, (a, b) in enumerate(zip(loaded, expected, strict=True))
                       if not torch.equal(a, b)],
            "equal_to_changed": [i for i, (a, b) in enumerate(zip(loaded, expected,
                                                                  strict=True))
                                 if torch.equal(a, b + 1)]}
    Path(f"{root}-rank{rank}.json").write_text(json.dumps(found))
    dist.barrier()
    dist.destroy_process_group()


def ranks(work: Path, world: int = 2) -> None:
    import torch.multiprocessing as mp

    started = time.perf_counter()
    mp.spawn(rank_job, args=(world, str(work / "ranks"), str(work / "ranks-init")),
             nprocs=world, join=True)
    found = {rank: json.loads((work / f"ranks-rank{rank}.json").read_text())
             for rank in range(world)}
    exact = all(not r["differ"] and not r["off_gpu"] for f in found.values() for r in f.values())
    RESULTS["ranks"] = {"world": world, "exact": exact, "per_rank": found,
                        "seconds": time.perf_counter() - started}
    for rank, modes in found.items():
        for mode, r in modes.items():
            log(f"  rank {rank} {mode:20s} differ {r['differ']} (of them the state after "
                f"save(): {r['equal_to_changed']}), off the GPU {r['off_gpu']}")
    assert exact, "a replicated CUDA state did not come back exactly"


# -- a training loop with memory-tier checkpoints -------------------------------------------


def tier_loop(work: Path, gb: float, reps: int, steps: int = 40, every: int = 10,
              batch: int = 16384) -> None:
    """A GPU training loop (forward, backward, AdamW) with no checkpoint, and with a memory
    tier checkpoint every `every` steps: synchronous, and async pinned + early_return (the
    loop calls wait_staged() before optimizer.step()). The last save's commit is waited for
    inside the timed loop."""
    model, opt = build(gb)
    nbytes = sum(t.nbytes for t in state_tensors(model, opt))
    x = torch.randn(batch, 4096, device="cuda")
    # The memory tier in a fresh folder of /dev/shm, removed at the end.
    shm = Path(tempfile.mkdtemp(prefix="statereg-bench-gpu-", dir="/dev/shm"))
    os.environ["STATEREG_SHM_DIR"] = str(shm)

    def tiered(root: Path, **save: Any) -> dict[str, Any]:
        declared = spec(root, **save)
        del declared["save"]["keep_last"]  # tiers keep per tier
        declared["tiers"] = {"memory": {"every": every, "keep_last": 2},
                             "durable": {"every": 10**9 // every * every}}
        return declared

    def train(mgr: statereg.CheckpointManager | None, first: int) -> tuple[float, float]:
        """Seconds of the steps, and of the steps with the last save committed."""
        torch.cuda.synchronize()
        start = time.perf_counter()
        handle = None
        for step in range(first, first + steps):
            y = x
            for layer in model:
                y = torch.relu(layer(y))
            y.square().mean().backward()
            if handle is not None:
                handle.wait_staged()  # early_return: the copy is done before the state moves
            opt.step()
            opt.zero_grad(set_to_none=True)
            if mgr is not None:
                handle = mgr.save(step)
        torch.cuda.synchronize()
        stepped = time.perf_counter() - start
        if mgr is not None:
            mgr.wait()
        return stepped, time.perf_counter() - start

    train(None, 0)  # warm the kernels
    managers = {
        "memory, synchronous": statereg.CheckpointManager(
            tiered(work / "tier-sync"), model=model, optimizer=opt),
        "memory, pinned + early_return": statereg.CheckpointManager(
            tiered(work / "tier-async", **{"async": "pinned", "early_return": True}),
            model=model, optimizer=opt)}
    times: dict[str, list[tuple[float, float]]] = {"none": [],
                                                   **{name: [] for name in managers}}
    first = every  # each manager saved once first: its buffers and files exist
    for manager in managers.values():
        manager.save(first)
        manager.wait()
    for _ in range(reps):  # alternate, so drift in the machine hits every mode alike
        times["none"].append(train(None, 0))
        for name, manager in managers.items():
            first += steps
            times[name].append(train(manager, first + 1))
    for manager in managers.values():
        manager.close()
    shutil.rmtree(shm)
    base = statistics.median(t for t, _ in times["none"])
    found: dict[str, Any] = {"state_gb": nbytes / 1e9, "steps": steps, "every": every,
                             "step_s": base / steps, "none_s": base}
    log(f"  state {nbytes / 1e9:.2f} GB, {steps} steps of {base / steps * 1000:.0f} ms, "
        f"a memory checkpoint every {every}, the last at the last step")
    for name in managers:
        stepped = statistics.median(t for t, _ in times[name])
        waited = statistics.median(t for _, t in times[name])
        found[name] = {"seconds": stepped, "slowdown_pct": 100 * (stepped / base - 1),
                       "with_last_commit_s": waited,
                       "with_last_commit_pct": 100 * (waited / base - 1)}
        log(f"  {name:30s} {stepped:.2f} s against {base:.2f} s: "
            f"{100 * (stepped / base - 1):+.1f}%; with the last save committed {waited:.2f} s: "
            f"{100 * (waited / base - 1):+.1f}%")
    RESULTS["tiers"] = found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=4.0, help="state size for stall and load")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where checkpoints go (local disk)")
    parser.add_argument("--only", default="checks,resume,stall,load,tiers,ranks")
    parser.add_argument("--tier-gb", type=float, default=1.5,
                        help="state size for the training loop with memory checkpoints")
    parser.add_argument("--out", default=None, help="write every figure as JSON here")
    parser.add_argument("--profile", action="store_true",
                        help="print a profile of one statereg load (load section)")
    args = parser.parse_args()
    global PROFILE
    PROFILE = args.profile
    if not torch.cuda.is_available():
        print("no GPU: skipped (no CUDA device; run this on a GPU machine)")
        return 0
    RESULTS["machine"] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                          "cuda": torch.version.cuda, "cpus": os.cpu_count(),
                          "python": platform.python_version()}
    log(f"{RESULTS['machine']}")
    work = Path(tempfile.mkdtemp(prefix="statereg-gpu-", dir=args.dir))
    sections = {"checks": lambda: checks(work), "resume": lambda: resume(work),
                "stall": lambda: stall(work, args.gb, args.reps),
                "load": lambda: load(work, args.gb, args.reps),
                "tiers": lambda: tier_loop(work, args.tier_gb, args.reps),
                "ranks": lambda: ranks(work)}
    failed = False
    for name in args.only.split(","):
        log(f"[{name}]")
        started = time.perf_counter()
        try:
            sections[name]()
        except Exception as exc:  # report and go on: one run should give every figure
            import traceback
            traceback.print_exc()
            RESULTS[name] = {"error": f"{type(exc).__name__}: {exc}"}
            failed = True
        log(f"  ({time.perf_counter() - started:.1f} s)")
        if args.out:
            Path(args.out).write_text(json.dumps(RESULTS, indent=1, default=str))
    shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
