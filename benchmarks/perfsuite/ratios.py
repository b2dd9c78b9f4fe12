"""Scenario ratios: compression ratio per tensor kind, zstd alone, statereg's codec, zipnn.

(Formerly benchmarks/bench_ratios.py; docs/performance.md records its table.)

    .venv/bin/python benchmarks/suite.py --only ratios [--zipnn-python PY]

Synthetic stand-ins of `numel` elements (16M by default) for each kind: bf16 and fp32 weights
drawn from N(0, 0.02) and from nn.Linear's initialisation, and the two fp32 Adam moments after
three steps on random gradients. Each is compressed whole by zstd level 3 alone and by
statereg's float-aware codec (`codec.encode_planes`, default settings); zipnn pins its own
torch, so it runs in its own virtualenv (`--zipnn-python`, docs/performance.md) and its column
says "not installed" without one. Ratios only, no timings: unlike the compression section,
which saves the suite's whole transformer states through statereg and DCP.
"""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard

from perfsuite.measure import Timing, fresh_dir
from statereg.dcp import codec

WORKER = Path(__file__).parent / "zipnn_worker.py"


def tensors(numel: int) -> dict[str, torch.Tensor]:
    """`numel`-element stand-ins for each kind: normal and nn.Linear-initialised weights,
    moments."""
    torch.manual_seed(0)
    side = int(numel ** 0.5)
    linear = torch.empty(side, side)
    torch.nn.init.kaiming_uniform_(linear, a=5 ** 0.5)
    weight = torch.nn.Parameter(torch.randn(side, side) * 0.02)
    opt = torch.optim.AdamW([weight])
    for _ in range(3):
        weight.grad = torch.randn(side, side) * 1e-3
        opt.step()
    normal = torch.randn(numel) * 0.02
    return {"bf16 weights, N(0, 0.02)": normal.bfloat16(),
            "bf16 weights, nn.Linear init": linear.bfloat16(),
            "fp32 weights, N(0, 0.02)": normal,
            "fp32 weights, nn.Linear init": linear,
            "fp32 Adam exp_avg": opt.state[weight]["exp_avg"],
            "fp32 Adam exp_avg_sq": opt.state[weight]["exp_avg_sq"]}


def run(numel: int, work: Path, zipnn_python: str) -> tuple[dict[str, Timing], dict[str, Any]]:
    """No timed rows; data["ratios"][tensor] = {"zstd", "statereg", "zipnn"} (raw / stored)."""
    work = fresh_dir(work / "ratios")
    ratios: dict[str, dict[str, float | None]] = {}
    job: dict[str, Any] = {"reps": 1, "files": []}
    for i, (name, tensor) in enumerate(tensors(numel).items()):
        raw = memoryview(tensor.detach().contiguous().view(torch.uint8).numpy()).cast("B")
        elem, rotate = codec.float_layout(tensor.dtype)
        out = io.BytesIO()
        codec.encode_planes(raw, elem, rotate, codec.CompressionSettings(), out.write)
        zstd = len(zstandard.ZstdCompressor(level=3).compress(raw))
        ratios[name] = {"zstd": len(raw) / zstd, "statereg": len(raw) / out.tell(),
                        "zipnn": None}
        path = work / f"{i}.npy"
        np.save(path, np.frombuffer(raw, dtype=np.uint8))
        job["files"].append({"name": name, "path": str(path),
                             "dtype": str(tensor.dtype).removeprefix("torch.")})
    zipnn = "not installed"
    if Path(zipnn_python).exists():
        (work / "job.json").write_text(json.dumps(job))
        subprocess.run([zipnn_python, str(WORKER), str(work / "job.json"),
                        str(work / "out.json")], check=True)
        for name, result in json.loads((work / "out.json").read_text())["files"].items():
            ratios[name]["zipnn"] = result["raw_bytes"] / result["compressed_bytes"]
        zipnn = f"zipnn from {zipnn_python}"
    return {}, {"numel": numel, "zipnn": zipnn, "ratios": ratios}


def table(data: dict[str, Any]) -> list[str]:
    """The markdown table the standalone script printed."""
    lines = ["| tensor | zstd -3 alone | statereg `float_aware` | zipnn |", "|---|---|---|---|"]
    for name, entry in data["ratios"].items():
        zipnn = "not installed" if entry["zipnn"] is None else f"{entry['zipnn']:.3f}"
        lines.append(f"| {name} | {entry['zstd']:.2f} | {entry['statereg']:.3f} | {zipnn} |")
    return lines
