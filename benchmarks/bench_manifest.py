"""How a manifest scales with the number of tensor items: bytes per item, write and parse time.

An incremental save records one digest per tensor item (`digests`); everything else in the
manifest grows with files, not items. This builds the manifest of an N-item incremental
checkpoint (8 ranks' data files, half the items referenced from the previous checkpoint),
serializes it as a save does and parses it as every reader does (bounds, schema and all),
and reports the sizes and times, and the item count at which the reader's bound is reached.

    python benchmarks/bench_manifest.py --items 1000000 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from statereg.schemas.manifest import (
    FORMAT_VERSION,
    MAX_MANIFEST_BYTES,
    ComponentRecord,
    FileRecord,
    Manifest,
    parse_manifest,
)

RANKS = 8


def build(items: int) -> Manifest:
    """The manifest of an `items`-tensor incremental checkpoint, shaped as save() writes it."""
    checksum = "xxh3_64:" + "0123456789abcdef"
    files = [FileRecord(path=f"model/__{r}_0.distcp", size=1 << 30, checksum=checksum,
                        codec="zstd+planes") for r in range(RANKS)]
    files.append(FileRecord(path="model/.metadata", size=items * 200, checksum=checksum))
    references = [FileRecord(path=f"step_00000100/model/__{r}_0.distcp", size=1 << 30,
                             checksum=checksum, codec="zstd+planes") for r in range(RANKS)]
    digests = {f"model/layers.{i // 8}.block{i % 8}.weight":
               f"bfloat16[4096, 4096]:{i:032x}" for i in range(items)}
    return Manifest(
        format_version=FORMAT_VERSION, statereg_version="bench", torch_version="bench",
        created_at="2026-01-01T00:00:00+00:00", step=200, tokens_seen=None, extra={},
        world_size=RANKS, spec={}, files=files, references=references, digests=digests,
        components={"model": ComponentRecord(kind="model", sharing="sharded", format="dcp",
                                             files=[f.path for f in files], tensors=items)},
    )


def measure(items: int) -> dict[str, Any]:
    manifest = build(items)
    started = time.perf_counter()
    data = manifest.to_json()
    write_s = time.perf_counter() - started
    result: dict[str, Any] = {"items": items, "bytes": len(data),
                              "bytes_per_item": round(len(data) / items, 1),
                              "write_s": round(write_s, 3), "bound_bytes": MAX_MANIFEST_BYTES,
                              "items_at_bound": int(MAX_MANIFEST_BYTES / (len(data) / items))}
    if len(data) <= MAX_MANIFEST_BYTES:
        started = time.perf_counter()
        parsed = parse_manifest(data, "bench")
        result["parse_s"] = round(time.perf_counter() - started, 3)
        assert len(parsed.digests) == items
    else:
        result["parse_s"] = None  # over the bound: every reader refuses it (and save() too)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    results = [measure(n) for n in args.items]
    print(f"{'items':>10} {'bytes':>12} {'B/item':>7} {'write s':>8} {'parse s':>8} "
          f"{'items at bound':>15}")
    for r in results:
        parse = "refused" if r["parse_s"] is None else f"{r['parse_s']:.3f}"
        print(f"{r['items']:>10} {r['bytes']:>12} {r['bytes_per_item']:>7} "
              f"{r['write_s']:>8.3f} {parse:>8} {r['items_at_bound']:>15}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
