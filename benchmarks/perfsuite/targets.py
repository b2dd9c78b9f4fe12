"""The issue's targets, evaluated on the medians of one run (the JSON result, so a saved
result can be re-checked). A target whose inputs were not measured is reported as such."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Results = dict[str, Any]


def _median(results: Results, section: str, row: str) -> float | None:
    found = results["sections"].get(section, {}).get("rows", {}).get(row)
    return None if found is None else found["median_s"]


def _data(results: Results, section: str) -> dict[str, Any]:
    return results["sections"].get(section, {}).get("data", {})


def _target(text: str, value: float | None, bar: float, op: str, needs: str) -> dict[str, Any]:
    if value is None:
        return {"target": text, "value": None, "bar": bar, "op": op, "met": None,
                "note": f"not measured (needs --only {needs})"}
    met = value >= bar if op == ">=" else value <= bar
    return {"target": text, "value": round(value, 3), "bar": bar, "op": op, "met": met}


def _faster(results: Results, bar: tuple[str, str], ours: tuple[str, str]) -> float | None:
    """How many times faster `ours` is than `bar` (bar time / our time)."""
    theirs, mine = _median(results, *bar), _median(results, *ours)
    return None if theirs is None or mine is None or mine == 0 else theirs / mine


def _best_dcp_save(results: Results) -> str | None:
    rows = results["sections"].get("peers", {}).get("rows", {})
    saves = {k: v["median_s"] for k, v in rows.items() if k.startswith("dcp_save_t")}
    return min(saves, key=saves.__getitem__) if saves else None


def _io_targets(results: Results) -> list[dict[str, Any]]:
    best = _best_dcp_save(results)
    dcp_speed = (None if best is None
                 else _faster(results, ("peers", best), ("statereg", "save")))
    copies = [c for c in (_median(results, "floor", "memcpy"),
                          _median(results, "floor", "memcpy_1thread")) if c is not None]
    copy = min(copies) if copies else None
    out = [
        _target("sync save ≥ 1.0x raw buffered write (+fsync)",
                _faster(results, ("floor", "write_buffered"), ("statereg", "save")), 1.0, ">=",
                "floor,statereg"),
        _target(f"sync save ≥ 1.0x best plain DCP ({best or 'dcp.save'})", dcp_speed, 1.0, ">=",
                "peers,statereg"),
        _target("load ≥ 1.0x cold raw read",
                _faster(results, ("floor", "read_cold"), ("statereg", "load")), 1.0, ">=",
                "floor,statereg"),
    ]
    for key, mode in (("async_thread", "async: thread"),
                      ("async_thread_early", "async: thread + early_return")):
        stall = _median(results, "statereg", f"{key}_stall")
        out.append(_target(f"{mode} stall ≤ 1.2x in-memory copy (stall / faster copy)",
                           None if copy is None or stall is None else stall / copy, 1.2, "<=",
                           "floor,statereg"))
    return out


def _compression_targets(results: Results) -> list[dict[str, Any]]:
    out = [_target("compressed save to the S3 server ≥ 1.15x faster end to end",
                   _faster(results, ("backends", "s3_save"), ("backends", "s3_save_zstd")),
                   1.15, ">=", "backends")]
    ratios = _data(results, "compression").get("ratios", {})
    for dtype in ("fp32", "bf16"):
        for kind in ("weights", "exp_avg", "exp_avg_sq"):
            entry = ratios.get(dtype, {}).get(kind, {})
            ours, zipnn = entry.get("statereg"), entry.get("zipnn")
            value = None if ours is None or not zipnn else ours / zipnn
            out.append(_target(f"compression ratio ≥ zipnn, {dtype} {kind} (ours / zipnn)",
                               value, 1.0, ">=", "compression (and zipnn's venv)"))
    for dtype in ("fp32", "bf16"):
        out.append(_target(
            f"compressed save throughput ≥ 2x DCP ZStandard, {dtype}",
            _faster(results, ("compression", f"dcp_zstd_save_{dtype}"),
                    ("compression", f"statereg_save_{dtype}")), 2.0, ">=", "compression"))
    return out


def _store_targets(results: Results) -> list[dict[str, Any]]:
    out = []
    for store in ("s3", "gcs"):
        for raw, ours, what in (("raw_put", "save", "save"), ("raw_get", "load", "load")):
            out.append(_target(
                f"{store}: statereg {what} ≥ 0.9x raw fsspec {raw.split('_')[1]}",
                _faster(results, ("backends", f"{store}_{raw}"), ("backends", f"{store}_{ours}")),
                0.9, ">=", "backends"))
    return out


def _scale_targets(results: Results) -> list[dict[str, Any]]:
    breakdown = _data(results, "scale").get("breakdown", {})
    largest = max(breakdown, key=int) if breakdown else None
    share = breakdown[largest]["overhead_share_of_save"] if largest else None
    text = f"plan + manifest + checksums ≤ 5% of save time ({largest or '100000'} tensors)"
    return [_target(text, share, 0.05, "<=", "scale")]


EVALUATORS: list[Callable[[Results], list[dict[str, Any]]]] = [
    _io_targets, _compression_targets, _store_targets, _scale_targets]


def evaluate(results: Results) -> list[dict[str, Any]]:
    return [t for evaluate_one in EVALUATORS for t in evaluate_one(results)]
