"""Compress .npy byte dumps with zipnn; runs in its own virtualenv (numpy + zipnn only).

Usage: python zipnn_worker.py JOB.json OUT.json, where JOB.json is
{"reps": N, "files": [{"name": ..., "path": ....npy, "dtype": "float32" | "bfloat16"}]}.

zipnn compresses in place: it rewrites the buffer it is given (even a `bytes` object) while
compressing, so every repetition gets a fresh copy of the pristine bytes, and the round trip
is checked against a digest taken before compressing.
"""

from __future__ import annotations

import hashlib
import json
import resource
import sys
import time

import numpy as np
import zipnn


def measure(path: str, dtype: str, reps: int) -> dict:
    pristine = np.load(path, mmap_mode="r")
    digest = hashlib.sha256(pristine).hexdigest()
    compress_s, compressed = [], b""
    for _ in range(reps):
        work = bytearray(pristine)
        codec = zipnn.ZipNN(input_format="byte", bytearray_dtype=dtype)
        start = time.perf_counter()
        compressed = codec.compress(work)
        compress_s.append(time.perf_counter() - start)
        del work
    codec = zipnn.ZipNN(input_format="byte", bytearray_dtype=dtype)
    start = time.perf_counter()
    restored = codec.decompress(compressed)
    decompress_s = time.perf_counter() - start
    return {"raw_bytes": pristine.nbytes, "compressed_bytes": len(compressed),
            "compress_s": compress_s, "decompress_s": [decompress_s],
            "roundtrip_exact": hashlib.sha256(restored).hexdigest() == digest}


def main() -> None:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    results = {f["name"]: measure(f["path"], f["dtype"], job["reps"]) for f in job["files"]}
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    version = getattr(zipnn, "__version__", None)
    if version is None:
        from importlib.metadata import version as dist_version

        version = dist_version("zipnn")
    with open(sys.argv[2], "w") as out:
        json.dump({"zipnn": version, "peak_rss_gb": peak_gb, "files": results}, out)


if __name__ == "__main__":
    main()
