"""Compression: statereg's zstd (float-aware) against DCP's ZStandard extension and zipnn.

Per state (fp32, bf16): statereg save and load with `storage.compression: zstd`, and plain
dcp.save / dcp.load with `FileSystemWriter(_extensions=[ZStandard()])` at the same thread
count. Ratios per tensor kind are read from each checkpoint's DCP metadata, which records the
stored length of every item: raw bytes of the kind / stored bytes of the kind.

zipnn runs in a separate virtualenv (it pins its own torch): the same tensors are dumped per
kind as .npy byte arrays and compressed there by `zipnn_worker.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from perfsuite.measure import PageCache, PeakRSS, Timing, fresh_dir, measure, tensor_bytes
from perfsuite.peers import check_loaded
from perfsuite.statereg_io import Saves, spec_for
from perfsuite.workload import KINDS, TrainingState, tensor_kind
from statereg.dcp.metadata import load_dcp_metadata

RATIO_KINDS = ("weights", "exp_avg", "exp_avg_sq")
WORKER = Path(__file__).with_name("zipnn_worker.py")
STATEREG_ZSTD = {"codec": "zstd", "level": 3, "threads": 0, "float_aware": True}


def _dtype_name(state: TrainingState) -> str:
    return "bf16" if state.dtype == torch.bfloat16 else "fp32"


def ratios_from_metadata(root: Path) -> dict[str, dict[str, int]]:
    """{kind: {raw, stored}} over every DCP checkpoint (.metadata) under `root`."""
    sizes = {kind: {"raw": 0, "stored": 0} for kind in KINDS}
    for path in root.rglob(".metadata"):
        metadata = load_dcp_metadata(path.read_bytes(), str(path))
        for index, info in metadata.storage_data.items():
            stored = metadata.state_dict_metadata[index.fqn]
            if not isinstance(stored, TensorStorageMetadata):
                continue
            element = torch._utils._element_size(stored.properties.dtype)
            chunk = next(c for c in stored.chunks
                         if index.offset is None or tuple(c.offsets) == tuple(index.offset))
            kind = sizes[tensor_kind(index.fqn)]
            kind["raw"] += chunk.sizes.numel() * element
            kind["stored"] += info.length
    return sizes


def ratio(sizes: dict[str, int]) -> float | None:
    return round(sizes["raw"] / sizes["stored"], 4) if sizes["stored"] else None


def _statereg_rows(state: TrainingState, work: Path, reps: int, cache: PageCache,
                   io_threads: int) -> tuple[dict[str, Timing], dict[str, Any]]:
    name = _dtype_name(state)
    root = work / f"statereg-zstd-{name}"

    def clear() -> None:
        fresh_dir(root)
        cache.drop()

    saves = Saves(state, spec_for(str(root), compression=STATEREG_ZSTD, io_threads=io_threads))
    rows = {
        f"statereg_save_{name}": measure(f"statereg save, zstd float-aware, {name}",
                                         saves.save, reps, state.nbytes, clear),
        f"statereg_load_{name}": measure(f"statereg load, zstd float-aware, {name}",
                                         saves.load, reps, state.nbytes, cache.drop),
    }
    sizes = ratios_from_metadata(root)
    fresh_dir(root)
    return rows, sizes


def _dcp_zstd_rows(state: TrainingState, work: Path, reps: int, cache: PageCache,
                   threads: int) -> tuple[dict[str, Timing], dict[str, Any]]:
    name = _dtype_name(state)
    root = work / f"dcp-zstd-{name}"
    flat = state.flat
    targets = {k: torch.zeros_like(v) for k, v in flat.items()}

    def clear() -> None:
        fresh_dir(root)
        cache.drop()

    def save() -> None:
        writer = dcp.FileSystemWriter(root, thread_count=threads, _extensions=[ZStandard()])
        dcp.save(flat, storage_writer=writer, no_dist=True)

    rows = {f"dcp_zstd_save_{name}": measure(
        f"dcp.save + ZStandard extension (thread_count={threads}), {name}", save, reps,
        state.nbytes, clear)}
    rows[f"dcp_zstd_load_{name}"] = measure(
        f"dcp.load of the ZStandard checkpoint, {name}",
        lambda: dcp.load(targets, storage_reader=dcp.FileSystemReader(root), no_dist=True),
        reps, state.nbytes, cache.drop)
    check_loaded(targets, flat, "dcp.load (ZStandard)")
    sizes = ratios_from_metadata(root)
    fresh_dir(root)
    return rows, sizes


def dump_kinds(state: TrainingState, folder: Path) -> list[dict[str, str]]:
    """One .npy byte array per tensor kind, the tensors' bytes in state order."""
    dtype = "bfloat16" if state.dtype == torch.bfloat16 else "float32"
    name = _dtype_name(state)
    flat = state.flat
    files = []
    for kind in RATIO_KINDS:
        tensors = [t for k, t in flat.items() if tensor_kind(k) == kind]
        path = folder / f"{name}.{kind}.npy"
        array = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8,
                                          shape=(sum(t.nbytes for t in tensors),))
        offset = 0
        for tensor in tensors:
            view = tensor_bytes(tensor)
            array[offset:offset + len(view)] = np.frombuffer(view, dtype=np.uint8)
            offset += len(view)
        array.flush()
        del array
        files.append({"name": f"{name}.{kind}", "path": str(path), "dtype": dtype})
    return files


def run_zipnn(states: list[TrainingState], work: Path, python: str,
              reps: int) -> tuple[dict[str, Timing], dict[str, Any]]:
    """zipnn on every kind of every state, in `python` (a virtualenv with zipnn)."""
    if python == "none":
        return {}, {"status": "zipnn: skipped (--zipnn-python none)"}
    if not python or not Path(python).exists():
        return {}, {"status": f"zipnn: not installed (no interpreter at {python!r}); see "
                              "docs/performance.md for the separate virtualenv"}
    folder = fresh_dir(work / "zipnn")
    files = [f for state in states for f in dump_kinds(state, folder)]
    job, out = folder / "job.json", folder / "out.json"
    job.write_text(json.dumps({"reps": reps, "files": files}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    done = subprocess.run([python, str(WORKER), str(job), str(out)], capture_output=True,
                          text=True, env=env, check=False)
    if done.returncode != 0:
        fresh_dir(folder)
        return {}, {"status": f"zipnn: failed ({done.stderr.strip().splitlines()[-1:]})"}
    result = json.loads(out.read_text())
    fresh_dir(folder)
    rows: dict[str, Timing] = {}
    peak = PeakRSS(peak_gb=result["peak_rss_gb"])
    for name, measured in result["files"].items():
        rows[f"zipnn_compress_{name}"] = Timing(
            f"zipnn compress {name} (in its venv)", measured["compress_s"],
            measured["raw_bytes"], peak)
        rows[f"zipnn_decompress_{name}"] = Timing(
            f"zipnn decompress {name} (in its venv)", measured["decompress_s"],
            measured["raw_bytes"], peak)
    data = {"status": f"zipnn {result['zipnn']}", "files": result["files"]}
    return rows, data


def _all_kinds(sizes: dict[str, dict[str, int]]) -> dict[str, int]:
    return {key: sum(s[key] for s in sizes.values()) for key in ("raw", "stored")}


def run(states: list[TrainingState], work: Path, reps: int, cache: PageCache, io_threads: int,
        zipnn_python: str, zipnn_reps: int) -> tuple[dict[str, Timing], dict[str, Any]]:
    rows: dict[str, Timing] = {}
    ratios: dict[str, dict[str, dict[str, Any]]] = {}
    for state in states:
        sr_rows, ours = _statereg_rows(state, work, reps, cache, io_threads)
        dz_rows, theirs = _dcp_zstd_rows(state, work, reps, cache, io_threads)
        rows |= sr_rows | dz_rows
        ours["all"], theirs["all"] = _all_kinds(ours), _all_kinds(theirs)
        ratios[_dtype_name(state)] = {
            kind: {"raw_bytes": ours[kind]["raw"], "statereg": ratio(ours[kind]),
                   "dcp_zstd": ratio(theirs[kind])} for kind in (*RATIO_KINDS, "all")}
    zipnn_rows, zipnn_data = run_zipnn(states, work, zipnn_python, zipnn_reps)
    rows |= zipnn_rows
    measured = zipnn_data.get("files", {})
    for name, kinds in ratios.items():
        for kind, entry in kinds.items():
            found = measured.get(f"{name}.{kind}")
            entry["zipnn"] = (round(found["raw_bytes"] / found["compressed_bytes"], 4)
                              if found else None)
    inexact = sorted(k for k, v in measured.items() if not v["roundtrip_exact"])
    return rows, {"ratios": ratios, "zipnn": zipnn_data.get("status"),
                  "zipnn_roundtrip_inexact": inexact}
