"""The `statereg` command: plan, schema, ls, inspect, verify, cp, export-hf.

`plan` and `schema` never import torch, so they answer in well under a second.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from statereg.errors import CheckpointNotFoundError, SpecError, StateregError, StorageError


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """Storage options from --spec (its storage.options) and/or --options JSON."""
    options: dict[str, Any] = {}
    if args.spec:
        from statereg.declaration import load_spec

        options.update(load_spec(args.spec).storage.options)
    options.update(_json_options(args.options, "--options"))
    return options


def _checkpoint_url(text: str) -> str:
    """A checkpoint argument: a local path made absolute, so that its last segment names the
    checkpoint directory ('.' inside one works); a URL as given. One that names no directory
    ('/', 's3://': it would read manifest.json from the current directory) or a store's top
    ('shm://run7') is refused, as `split_checkpoint_url` refuses it."""
    from statereg.engine.by_url import split_checkpoint_url

    url = text if "://" in text else os.path.abspath(text)
    try:
        split_checkpoint_url(url)
    except CheckpointNotFoundError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return url


def _model_bytes(factory: str, spec: Any) -> dict[str, list[tuple[str, int]]]:
    """Tensor bytes of the model built by `module:callable`, on the meta device (no memory)."""
    import importlib

    import torch

    from statereg.state.model import ModelAdapter

    module_name, _, attr = factory.partition(":")
    # As `python -m` does: a module in the current directory imports (the console script
    # would otherwise look only beside itself and in site-packages).
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)
    try:
        build = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise SpecError(f"--model {factory!r}: cannot import it ({exc}); use module:callable, "
                        f"the module in the current directory ({here}) or on PYTHONPATH"
                        ) from None
    models = [n for n, c in spec.components.items() if c.kind == "model"]
    if not models:
        raise SpecError("--model: the declaration has no model component")
    with torch.device("meta"):
        module = build()
    tensors = ModelAdapter(models[0], module, spec.components[models[0]].prefix).capture().tensors
    return {models[0]: [(key, t.nbytes) for key, t in tensors.items()]}


def cmd_plan(args: argparse.Namespace) -> None:
    from statereg.declaration import load_spec
    from statereg.engine.plan import WorldLayout, compile_job, render_job

    spec = load_spec(args.file)
    sizes = _model_bytes(args.model, spec) if args.model else None
    world = WorldLayout(0, args.world_size, _groups(spec, args.world_size, args.group))
    job = compile_job(spec, world, sizes=sizes)
    plans = job
    if args.rank is not None:
        if not 0 <= args.rank < args.world_size:
            raise SpecError(f"--rank {args.rank}: give a rank from 0 to {args.world_size - 1}")
        plans = [job[args.rank]]
    tiers = _tiers_block(spec, job, args) if spec.tiers is not None else None
    print(render_job(plans))
    if tiers is not None:
        print()
        print(tiers)


def _tiers_block(spec: Any, job: list[Any], args: argparse.Namespace) -> str:
    """The tiers' cadence and retention and the memory math (docs/tiers.md); the math covers
    every rank of `job`, whatever --rank shows."""
    from statereg.schemas.spec import parse_size
    from statereg.tiers.report import memory_math, render_tiers

    if not 1 <= args.nodes <= args.world_size or args.world_size % args.nodes:
        raise SpecError(f"--nodes {args.nodes}: give a divisor of --world-size "
                        f"{args.world_size} (ranks are spread evenly over the nodes)")
    state = None
    if args.state_bytes is not None:
        try:
            state = parse_size(args.state_bytes)
        except ValueError as exc:
            raise SpecError(f"--state-bytes: {exc}") from None
    return render_tiers(spec, memory_math(spec, job, args.nodes, state), args.nodes)


def _groups(spec: Any, world_size: int, given: list[str]) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Named groups from `--group NAME=0,1/2,3`; a declared group not given spans every rank."""
    groups: dict[str, tuple[tuple[int, ...], ...]] = {}
    for text in given:
        name, _, layout = text.partition("=")
        try:
            copies = tuple(tuple(int(r) for r in part.split(",")) for part in layout.split("/"))
        except ValueError:
            raise SpecError(f"--group {text!r}: write NAME=0,1/2,3 (ranks of each copy, "
                            "copies separated by /)") from None
        ranks = sorted(r for copy in copies for r in copy)
        if ranks != list(range(world_size)):
            raise SpecError(f"--group {text!r}: the copies must hold every rank 0..{world_size - 1}"
                            " exactly once")
        groups[name] = copies
    for comp in spec.components.values():
        if comp.group and comp.group not in groups:
            groups[comp.group] = (tuple(range(world_size)),)
    return groups


def cmd_schema(args: argparse.Namespace) -> None:
    from statereg.schemas import SCHEMA_FILES, json_schema

    if args.path:
        # The copy installed with the package (a wheel carries it): a stable file to point
        # an editor's YAML plugin at.
        from importlib.resources import files

        print(files("statereg.schemas") / SCHEMA_FILES[args.which])
        return
    print(json.dumps(json_schema(args.which), indent=2, sort_keys=True))


def cmd_ls(args: argparse.Namespace) -> None:
    from statereg.backends.registry import open_backend
    from statereg.engine.checkpoints import list_committed, read_latest
    from statereg.engine.report import format_bytes, format_table

    backend = open_backend(_root(args), _options(args))
    memory_url = _memory_url(args)
    if memory_url is not None:
        from statereg.tiers.report import memory_roots, render_locations

        print(render_locations(backend, memory_roots(memory_url), memory_url))
        return
    committed = list_committed(backend)
    if not committed:
        print(f"no committed checkpoints in {backend.url}{_identity_hint(backend.url)}")
        return
    latest = read_latest(backend)
    rows = [("checkpoint", "step", "tokens", "size", "created", "extra")]
    for c in committed:
        m = c.manifest
        mark = " (latest)" if c.name == latest else ""
        tokens = "-" if m.tokens_seen is None else str(m.tokens_seen)
        rows.append((c.name + mark, str(m.step), tokens, format_bytes(m.total_bytes),
                     m.created_at, json.dumps(m.extra)))
    print("\n".join(format_table(rows)))


def _identity_hint(url: str) -> str:
    """For a memory tier's run folder (shm://NAME), which holds one folder per job identity
    and no checkpoint itself: the identity folders to list instead."""
    if not url.startswith("shm://"):
        return ""
    from statereg.tiers.report import memory_roots

    roots = [r.url for r in memory_roots(url) if r.url != url]
    if not roots:
        return ""
    noun = "identity" if len(roots) == 1 else "identities"
    others = f" (or {', '.join(roots[1:])})" if roots[1:] else ""
    return (f"; it holds the memory checkpoints of {len(roots)} job {noun}: list one with "
            f"`statereg ls {roots[0]}`{others}, or every tier with `statereg ls --spec SPEC "
            "ROOT`")


def _memory_url(args: argparse.Namespace) -> str | None:
    """The memory root `ls` shows beside ROOT: --memory, else the run folder of --spec's
    tiers; None without either (ls lists ROOT alone, as before tiers)."""
    if args.memory:
        if not args.memory.startswith("shm://"):
            raise SpecError(f"--memory {args.memory!r}: give a shm://NAME URL, e.g. "
                            "shm://run7 (the run's folder) or shm://run7/ws1-<digest>")
        return str(args.memory)
    if not args.spec:
        return None
    from statereg.declaration import load_spec
    from statereg.tiers.report import memory_url_for

    return memory_url_for(load_spec(args.spec), None)


def _root(args: argparse.Namespace) -> str:
    """ROOT as given, or else the storage.url of --spec."""
    if args.root:
        return str(args.root)
    if not args.spec:
        raise SpecError("give ROOT, or --spec statereg.yaml to use its storage.url")
    from statereg.declaration import load_spec

    return load_spec(args.spec).storage.url


def cmd_inspect(args: argparse.Namespace) -> None:
    from statereg.engine.by_url import describe, read_manifest

    try:
        manifest = read_manifest(args.url, _options(args))
    except CheckpointNotFoundError:
        if args.json:  # there is no manifest to print
            raise
        from statereg.interop import describe_foreign

        print(describe_foreign(args.url, _options(args)))  # plain DCP or safetensors, or raise
        return
    if args.json:
        print(manifest.to_json().decode())
    else:
        print(describe(manifest, args.url))


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


def cmd_verify(args: argparse.Namespace) -> None:
    from statereg.engine.by_url import verify
    from statereg.engine.report import format_bytes

    manifest = verify(args.url, _options(args))
    print(f"ok: {args.url}: {len(manifest.files)} files, {format_bytes(manifest.total_bytes)}, "
          "every size and checksum matches the manifest")


def _json_options(text: str | None, flag: str) -> dict[str, Any]:
    if not text:
        return {}
    try:
        given = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError(f"{flag} is not valid JSON: {exc}") from None
    if not isinstance(given, dict):
        raise SpecError(f"{flag} must be a JSON object, e.g. '{{\"anon\": true}}'")
    return given


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
    rate = describe_rate(manifest.total_bytes, time.perf_counter() - started)
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

    backend = open_backend(args.root, _options(args))
    found = collect_garbage(backend, delete=args.delete, grace_s=_duration(args.grace))
    if not found:
        print(f"no leftovers in {backend.url}")
        return 0
    rows = [("path", "what", "size", "age", "action")]
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


def build_parser() -> argparse.ArgumentParser:
    from statereg import __version__

    parser = argparse.ArgumentParser(
        prog="statereg", description="Declarative PyTorch training checkpoints."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="show who writes which component, where and how")
    p.add_argument("file", help="statereg.yaml")
    p.add_argument("--world-size", type=int, default=1, help="ranks to plan for (default 1)")
    p.add_argument("--rank", type=int, default=None, help="print only this rank's plan")
    p.add_argument("--group", action="append", default=[], metavar="NAME=0,1/2,3",
                   help="the copies of a per_group process group (default: one over every rank)")
    p.add_argument("--model", metavar="MODULE:CALLABLE",
                   help="build the model (on the meta device, no memory) to show bytes per rank")
    p.add_argument("--nodes", type=int, default=1,
                   help="nodes the ranks are spread over, for the tiers' memory per node "
                   "(default 1)")
    p.add_argument("--state-bytes", metavar="SIZE",
                   help="one checkpoint of the whole job's state, e.g. 30GB, for the tiers' "
                   "memory math (default: what --model measures)")
    p.set_defaults(run=cmd_plan)

    p = sub.add_parser("schema", help="print the JSON Schema of statereg.yaml or of manifest.json")
    p.add_argument("which", nargs="?", choices=("spec", "manifest"), default="spec")
    p.add_argument("--path", action="store_true",
                   help="print where the installed schema file is (for an editor's YAML plugin)")
    p.set_defaults(run=cmd_schema)

    def storage_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--spec", help="take storage options from this statereg.yaml")
        p.add_argument("--options", help="storage options as a JSON object")

    p = sub.add_parser("ls", help="list committed checkpoints under a root (and, with tiers, "
                       "where each step lives)")
    p.add_argument("root", nargs="?",
                   help="checkpoint root: path or URL (default: storage.url of --spec)")
    p.add_argument("--memory", metavar="SHM_URL",
                   help="also show this memory tier root (default: the tiers of --spec)")
    storage_args(p)
    p.set_defaults(run=cmd_ls)

    p = sub.add_parser("inspect", help="show a checkpoint's manifest: components, sizes, versions")
    p.add_argument("url", type=_checkpoint_url,
                   help="checkpoint path or URL, e.g. ./checkpoints/step_00000100")
    p.add_argument("--json", action="store_true", help="print the raw manifest")
    storage_args(p)
    p.set_defaults(run=cmd_inspect)

    p = sub.add_parser("verify", help="recompute every file's size and checksum")
    p.add_argument("url", type=_checkpoint_url, help="checkpoint path or URL")
    storage_args(p)
    p.set_defaults(run=cmd_verify)

    p = sub.add_parser("gc", help="list (or --delete) leftovers of interrupted saves under a root")
    p.add_argument("root", help="checkpoint root: path or URL")
    p.add_argument("--delete", action="store_true",
                   help="remove the leftovers (default: a dry run that only lists them)")
    p.add_argument("--grace", default="1h",
                   help="keep leftovers younger than this, a save may be writing them "
                   "(seconds, or e.g. 30m, 1h; default 1h)")
    storage_args(p)
    p.set_defaults(run=cmd_gc)

    p = sub.add_parser("export-hf",
                       help="write a checkpoint's model as a Hugging Face safetensors directory")
    p.add_argument("url", type=_checkpoint_url, help="checkpoint path or URL")
    p.add_argument("out_dir", help="directory (path or URL) for the safetensors files")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"),
                   help="convert floating-point tensors (default: as saved)")
    p.add_argument("--max-shard-size", default="5GB",
                   help="largest file, e.g. 2GB, 500MB, 512MiB (default 5GB)")
    p.add_argument("--config", help="a config.json to copy beside the weights")
    p.add_argument("--component", help="the model component (default: the only one)")
    storage_args(p)
    p.set_defaults(run=cmd_export_hf)

    p = sub.add_parser("cp", help="copy a committed checkpoint to another root (any backends)")
    p.add_argument("src", type=_checkpoint_url,
                   help="checkpoint URL, e.g. s3://bkt/run/step_00000100")
    p.add_argument("dst", help="destination root; the checkpoint keeps its name")
    p.add_argument("--compression", choices=("zstd", "zstd-plain", "none"),
                   help="rewrite tensor files: zstd (float-aware), zstd-plain (readable by "
                   "plain DCP), none; default: copy the bytes as they are")
    p.add_argument("--level", type=int, default=3, choices=range(1, 20), metavar="1..19",
                   help="zstd level for --compression (default 3)")
    p.add_argument("--src-options", help="storage options for SRC only (JSON object)")
    p.add_argument("--dst-options", help="storage options for DST only (JSON object)")
    storage_args(p)
    p.set_defaults(run=cmd_cp)
    return parser


_REMOTE = ("s3://", "s3a://", "gs://", "gcs://")


def _storage_hint(args: argparse.Namespace) -> str:
    """What to try when a remote store failed and no storage options were given at all."""
    given = [getattr(args, name, None) for name in ("root", "url", "src", "dst", "out_dir")]
    remote = [str(u) for u in given if u and str(u).startswith(_REMOTE)]
    explicit = [getattr(args, name, None) for name in
                ("spec", "options", "src_options", "dst_options")]
    if not remote or any(explicit):
        return ""
    hint = ("; no --spec or --options was given, so the default cloud endpoint and credentials "
            "were used: pass --spec statereg.yaml (its storage.options) or --options '{...}'")
    if any(u.startswith(("s3://", "s3a://")) for u in remote):
        hint += (", or for an S3-compatible server set AWS_ENDPOINT_URL "
                 "(e.g. AWS_ENDPOINT_URL=http://127.0.0.1:9000)")
    return hint


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.run(args)
        sys.stdout.flush()  # a closed pipe surfaces here, not in the interpreter's exit
    except StorageError as exc:
        print(f"statereg {args.command}: error: {exc}{_storage_hint(args)}", file=sys.stderr)
        return 1
    except StateregError as exc:
        print(f"statereg {args.command}: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, SpecError) else 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader stopped early (`statereg schema | head -1`). Point stdout at /dev/null
        # so the final flush at exit cannot fail again, and exit as a tool killed by SIGPIPE.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
