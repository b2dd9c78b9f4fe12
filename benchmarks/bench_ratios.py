"""Compression ratio per tensor kind: zstd alone, statereg's float-aware codec, and zipnn.

Run by hand (not a test):  .venv/bin/python benchmarks/bench_ratios.py [--zipnn-python PY]
zipnn pins its own torch, so it runs in its own virtualenv (see docs/performance.md); without
one the zipnn column says so. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch
import zstandard

from statereg.dcp import codec

WORKER = Path(__file__).parent / "perfsuite" / "zipnn_worker.py"


def tensors(numel: int) -> dict[str, torch.Tensor]:
    """16M-element stand-ins for each kind: normal and nn.Linear-initialised weights, moments."""
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--numel", type=int, default=16 << 20)
    parser.add_argument("--zipnn-python", default="/tmp/zvenv/bin/python")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="statereg-ratios-"))
    rows, job = {}, {"reps": 1, "files": []}
    for i, (name, tensor) in enumerate(tensors(args.numel).items()):
        raw = memoryview(tensor.detach().contiguous().view(torch.uint8).numpy()).cast("B")
        elem, rotate = codec.float_layout(tensor.dtype)
        out = io.BytesIO()
        codec.encode_planes(raw, elem, rotate, codec.CompressionSettings(), out.write)
        zstd = len(zstandard.ZstdCompressor(level=3).compress(raw))
        rows[name] = (len(raw) / zstd, len(raw) / out.tell())
        path = work / f"{i}.npy"
        np.save(path, np.frombuffer(raw, dtype=np.uint8))
        job["files"].append({"name": name, "path": str(path),
                             "dtype": str(tensor.dtype).removeprefix("torch.")})
    zipnn: dict[str, str] = {}
    if Path(args.zipnn_python).exists():
        (work / "job.json").write_text(json.dumps(job))
        subprocess.run([args.zipnn_python, str(WORKER), str(work / "job.json"),
                        str(work / "out.json")], check=True)
        for name, result in json.loads((work / "out.json").read_text())["files"].items():
            zipnn[name] = f"{result['raw_bytes'] / result['compressed_bytes']:.3f}"
    print("| tensor | zstd -3 alone | statereg `float_aware` | zipnn |\n|---|---|---|---|")
    for name, (alone, ours) in rows.items():
        print(f"| {name} | {alone:.2f} | {ours:.3f} | {zipnn.get(name, 'not installed')} |")
    for path in work.iterdir():
        path.unlink()
    work.rmdir()


if __name__ == "__main__":
    main()
