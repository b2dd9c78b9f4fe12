"""The markdown tables of one suite result (what docs/performance.md keeps)."""

from __future__ import annotations

import math
from typing import Any

from perfsuite import ratios, save_load

GB = 1e9


def _seconds(value: float) -> str:
    if math.isnan(value):
        return "n/a"
    return f"{value:.3f}" if value < 10 else f"{value:.1f}"


def _row(row: dict[str, Any]) -> str:
    spread = f"{_seconds(row['min_s'])}-{_seconds(row['max_s'])}"
    rate = "—" if row["gb_per_s"] is None else f"{row['gb_per_s']:.2f}"
    reps = len(row["seconds"])
    peak = f"{row['peak_rss_gb']:.2f}"
    if row.get("rss_at_start_gb"):
        peak += f" ({row['rss_at_start_gb']:.2f})"
    return (f"| {row['label']} | {_seconds(row['median_s'])} | {spread} | {reps} | {rate} "
            f"| {peak} |")


def _rows_table(rows: dict[str, Any]) -> list[str]:
    lines = ["| operation | median s | min-max s | reps | GB/s | peak RSS GB (at start) |",
             "|---|---|---|---|---|---|"]
    return lines + [_row(r) for r in rows.values()]


def _ratio_table(ratios: dict[str, Any]) -> list[str]:
    lines = ["| state | tensors | raw GB | statereg zstd | DCP ZStandard | zipnn |",
             "|---|---|---|---|---|---|"]

    def show(value: float | None) -> str:
        return "—" if value is None else f"{value:.3f}"

    for dtype, kinds in ratios.items():
        for kind, entry in kinds.items():
            lines.append(f"| {dtype} | {kind} | {entry['raw_bytes'] / GB:.3f} | "
                         f"{show(entry['statereg'])} | {show(entry['dcp_zstd'])} | "
                         f"{show(entry.get('zipnn'))} |")
    return lines


def _scale_table(section: dict[str, Any]) -> list[str]:
    lines = ["| tensors | save s | load s | plan s | manifest s | checksums s | "
             "share of save |", "|---|---|---|---|---|---|---|"]
    rows = section["rows"]
    for count, entry in section["data"]["breakdown"].items():
        parts = entry["per_save_s"]
        load = rows.get(f"load_{count}")
        lines.append(
            f"| {count} | {_seconds(rows[f'save_{count}']['median_s'])} | "
            f"{'—' if load is None else _seconds(load['median_s'])} | "
            f"{parts.get('plan', 0):.3f} | "
            f"{parts.get('manifest', 0):.3f} | {parts.get('checksums', 0):.3f} | "
            f"{entry['overhead_share_of_save']:.1%} |")
    return lines


def _targets_table(targets: list[dict[str, Any]]) -> list[str]:
    lines = ["| target | measured | bar | met |", "|---|---|---|---|"]
    for t in targets:
        value = "—" if t["value"] is None else f"{t['value']:.3f}"
        met = {True: "**met**", False: "**missed**", None: t.get("note", "not measured")}
        lines.append(f"| {t['target']} | {value} | {t['op']} {t['bar']} | {met[t['met']]} |")
    return lines


def _header(results: dict[str, Any]) -> list[str]:
    m = results["machine"]
    disk = m["disk"]
    cache = ("page cache dropped before every load and save" if results["page_cache_dropped"]
             else "page cache NOT dropped (not permitted, or --keep-page-cache): loads may be "
                  "served from memory")
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gb']} GB; disk under test "
        f"{disk['device']} ({disk['fstype']}) at {disk['path']}; kernel {m['kernel']}; "
        f"torch {m['torch']}, statereg {m['statereg']}, Python {m['python']}; {m['date']}.",
        "",
        f"Command: `{results['command']}`; {cache}.",
    ]
    if not results.get("peak_rss_per_operation", True):
        lines.append("Peak RSS could not be reset per operation (/proc/self/clear_refs): "
                     "each peak is since the process started.")
    if results["config"].get("quick"):
        lines.append("A --quick run: smoke-test sizes, one repetition; its ratios say nothing.")
    for name, state in results.get("states", {}).items():
        lines.append(f"State {name}: {state['params'] / 1e6:.0f}M parameters "
                     f"(vocab {state['vocab']}, width {state['width']}, {state['layers']} "
                     f"layers), {state['bytes'] / GB:.2f} GB in {state['tensors']} tensors.")
    return lines


def markdown(results: dict[str, Any]) -> str:
    lines = ["## Suite results", "", *_header(results), "", "### Targets", "",
             *_targets_table(results["targets"])]
    for name, section in results["sections"].items():
        lines += ["", f"### {name} ({section['elapsed_s']:.0f} s)", ""]
        if "error" in section:
            lines.append(f"Failed: `{section['error']}`")
            continue
        if section["rows"]:
            lines += _rows_table(section["rows"])
        data = section.get("data", {})
        if name == "save_load" and data:
            lines += ["", *save_load.summary(data)]
        if name == "ratios" and data:
            lines += [f"Compression ratio (raw / stored) of {data['numel']}-element tensors; "
                      f"zipnn: {data['zipnn']}.", "", *ratios.table(data)]
        if name == "compression" and data.get("ratios"):
            caption = f"Compression ratio (raw / stored); {data.get('zipnn')}"
            if data.get("zipnn_roundtrip_inexact"):
                caption += (", whose round trip was NOT exact for "
                            + ", ".join(data["zipnn_roundtrip_inexact"]))
            lines += ["", caption + ".", "", *_ratio_table(data["ratios"])]
        if name == "scale" and data.get("breakdown"):
            lines += ["", *_scale_table(section)]
    return "\n".join(lines) + "\n"
