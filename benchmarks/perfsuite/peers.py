"""Peers on the same flat state: torch.save / torch.load(mmap=True), safetensors, plain DCP.

Every save ends durable (fsync), as statereg's does. Every load ends with the bytes in
preallocated tensors, as statereg's in-place load does: torch.load(mmap=True) and safetensors'
load_file return new tensors, so their time includes the copy into the targets (what
`load_state_dict` does); dcp.load reads in place.
"""

from __future__ import annotations

import os
from pathlib import Path

import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp

from perfsuite.measure import PageCache, Timing, fresh_dir, measure


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def torch_save(flat: dict[str, torch.Tensor], path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(flat, f)
        f.flush()
        os.fsync(f.fileno())


def copy_loaded(loaded: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> None:
    for key, target in targets.items():
        target.copy_(loaded[key])


def check_loaded(targets: dict[str, torch.Tensor], flat: dict[str, torch.Tensor],
                 what: str) -> None:
    """A load that left a tensor untouched would be timed too fast; fail loudly instead."""
    keys = list(flat)
    for key in (keys[0], keys[len(keys) // 2], keys[-1]):
        if not torch.equal(targets[key], flat[key]):
            raise AssertionError(f"{what} did not load {key!r} correctly")
    for target in targets.values():
        target.zero_()


def run(flat: dict[str, torch.Tensor], nbytes: int, work: Path, reps: int, cache: PageCache,
        dcp_threads: list[int]) -> dict[str, Timing]:
    rows: dict[str, Timing] = {}
    targets = {k: torch.zeros_like(v) for k, v in flat.items()}

    def clear() -> None:
        fresh_dir(work)
        cache.drop()

    pt = work / "state.pt"
    rows["torch_save"] = measure("torch.save + fsync", lambda: torch_save(flat, pt), reps,
                                 nbytes, clear)
    rows["torch_load"] = measure(
        "torch.load(mmap=True) + copy into tensors",
        lambda: copy_loaded(torch.load(pt, mmap=True, weights_only=True), targets),
        reps, nbytes, cache.drop)
    check_loaded(targets, flat, "torch.load")

    st = work / "state.safetensors"

    def safetensors_save() -> None:
        safetensors.torch.save_file(flat, st)
        fsync_path(st)

    rows["safetensors_save"] = measure("safetensors save_file + fsync", safetensors_save, reps,
                                       nbytes, clear)
    rows["safetensors_load"] = measure(
        "safetensors load_file + copy into tensors",
        lambda: copy_loaded(safetensors.torch.load_file(st), targets), reps, nbytes, cache.drop)
    check_loaded(targets, flat, "safetensors load_file")

    for threads in dcp_threads:
        def dcp_save(count: int = threads) -> None:
            dcp.save(flat, storage_writer=dcp.FileSystemWriter(work / "dcp", thread_count=count),
                     no_dist=True)

        rows[f"dcp_save_t{threads}"] = measure(
            f"plain dcp.save, FileSystemWriter(thread_count={threads})", dcp_save, reps, nbytes,
            clear)
    rows["dcp_load"] = measure(
        "plain dcp.load, FileSystemReader",
        lambda: dcp.load(targets, storage_reader=dcp.FileSystemReader(work / "dcp"),
                         no_dist=True),
        reps, nbytes, cache.drop)
    check_loaded(targets, flat, "dcp.load")
    fresh_dir(work)
    return rows
