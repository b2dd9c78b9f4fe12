"""The commands that write: `statereg cp` (a checkpoint to another root, optionally
recompressed), `export-hf` (a model as safetensors) and `gc` (leftovers of interrupted
saves)."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from statereg.cli.common import _json_options, _options, _print_json, _refuse_missing_local
from statereg.errors import SpecError


def cmd_export_hf(args: argparse.Namespace) -> None:
    from statereg.engine.report import format_bytes
    from statereg.interop import export_hf
    from statereg.schemas.spec import parse_size

    try:
        limit = parse_size(args.max_shard_size)
    except ValueError as exc:
        raise SpecError(f"--max-shard-size: {exc}") from None
    done = export_hf(args.url, args.out_dir, component=args.component, dtype=args.dtype,
                     max_shard_size=limit, config=args.config, options=_options(args))
    print(f"wrote {done.path}: {done.tensors} tensors, {format_bytes(done.bytes)} in "
          f"{len(done.files)} files ({', '.join(done.files[:4])}"
          f"{', ...' if len(done.files) > 4 else ''})")


def _refuse_existing_copy(dst: Any, name: str) -> None:
    """Refuse a DST that already has checkpoint `name`, in cp's words (the engine's refusal
    speaks to a save: "save a different step")."""
    from statereg.engine.checkpoints import read_manifest_at
    from statereg.errors import CheckpointExistsError, CheckpointNotFoundError, ManifestError

    try:
        read_manifest_at(dst, name, check=False)
    except CheckpointNotFoundError:
        return
    except ManifestError:
        pass  # a manifest that does not parse is still one cp must not overwrite
    raise CheckpointExistsError(
        f"{dst.display(name)} already exists: cp never overwrites a checkpoint; delete it "
        "there first, or copy into another root"
    )


def cmd_cp(args: argparse.Namespace) -> None:
    import time

    from statereg.backends.registry import open_backend
    from statereg.dcp.codec import CompressionSettings
    from statereg.engine.by_url import split_checkpoint_url
    from statereg.engine.report import describe_rate
    from statereg.engine.transfer import Recompress, copy_checkpoint

    shared = _options(args)
    root, name = split_checkpoint_url(args.src)
    src = open_backend(root, {**shared, **_json_options(args.src_options, "--src-options")})
    dst = open_backend(args.dst, {**shared, **_json_options(args.dst_options, "--dst-options")})
    recompress: Recompress = "keep"
    if args.compression == "none":
        recompress = None
    elif args.compression is not None:
        recompress = CompressionSettings(level=args.level, float_aware=args.compression == "zstd")
    _refuse_existing_copy(dst, name)
    started = time.perf_counter()
    manifest = copy_checkpoint(src, name, dst, recompress)
    seconds = time.perf_counter() - started
    if args.json:
        from statereg.schemas.cli import CpOutput

        _print_json(CpOutput(source=args.src, destination=dst.display(name),
                             files=len(manifest.files), bytes=manifest.total_bytes,
                             seconds=round(seconds, 3),
                             compression=args.compression or "keep"))
        return
    rate = describe_rate(manifest.total_bytes, seconds)
    print(f"copied {args.src} -> {dst.display(name)}: {len(manifest.files)} files, every "
          f"checksum verified; {rate}")


def _duration(text: str) -> float:
    """Seconds from '3600', '90s', '30m', '1h' or '2d'."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    value, unit = (text[:-1], text[-1]) if text and text[-1] in units else (text, "s")
    try:
        seconds = float(value) * units[unit]
    except ValueError:
        raise SpecError(f"--grace {text!r}: write seconds or e.g. 30m, 1h, 2d") from None
    # float() also reads 'nan' and 'inf': a NaN grace compares false with every age, so
    # it would delete what a running save is writing.
    if not math.isfinite(seconds) or seconds < 0:
        raise SpecError(f"--grace {text!r} must be a finite, non-negative duration: write "
                        "seconds or e.g. 30m, 1h, 2d")
    return seconds


def cmd_gc(args: argparse.Namespace) -> int:
    from statereg.backends.registry import open_backend
    from statereg.engine.gc import collect_garbage
    from statereg.engine.report import format_bytes, format_table

    _refuse_missing_local(args.root)  # a typo'd root has no leftovers, and no checkpoints
    backend = open_backend(args.root, _options(args))
    grace = _duration(args.grace)
    found = collect_garbage(backend, delete=args.delete, grace_s=grace)
    if args.json:
        return _gc_document(backend, found, args.delete, grace)
    if not found:
        print(f"no leftovers in {backend.url}")
        return 0
    rows: list[tuple[str, ...]] = [("path", "what", "size", "age", "action")]
    for item in found:
        age = "-" if item.age_s is None else f"{item.age_s:.0f} s"
        rows.append((item.path, item.kind, format_bytes(item.size), age, item.action))
    print("\n".join(format_table(rows)))
    removable = [f for f in found if f.deletable]
    size = format_bytes(sum(f.size for f in removable))
    if not args.delete:
        print(f"dry run: {len(removable)} of {len(found)} leftovers ({size}) would be deleted; "
              "run again with --delete to remove them")
        return 0
    print(f"deleted {len(removable)} of {len(found)} leftovers ({size})")
    failed = [f.path for f in found if f.action.startswith("failed")]
    if failed:
        print(f"statereg gc: error: {len(failed)} deletions failed ({', '.join(failed)}); "
              "the action column says why: fix that and run gc again", file=sys.stderr)
        return 1
    return 0


def _gc_document(backend: Any, found: list[Any], delete: bool, grace: float) -> int:
    from statereg.schemas.cli import GcOutput, LeftoverEntry

    failed = [f.path for f in found if f.action.startswith("failed")]
    _print_json(GcOutput(
        root=backend.url, delete=delete, grace_s=grace, failed=failed,
        deletable_bytes=sum(f.size for f in found if f.deletable),
        leftovers=[LeftoverEntry(path=f.path, kind=f.kind, size=f.size, age_s=f.age_s,
                                 action=f.action, deletable=f.deletable) for f in found]))
    return 1 if failed else 0
