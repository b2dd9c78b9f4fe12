"""The `statereg` command: plan, schema, ls, inspect, verify, cp, export-hf, gc; `--json` on
the ones that report (their documents: statereg/schemas/cli.py).

`plan` and `schema` never import torch, so they answer in well under a second.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any, Literal

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


def _verify_target(text: str) -> str:
    """verify's argument: a checkpoint or a root (a store's top, `s3://bucket`, is a root);
    one that names no directory at all ('/', 's3://') is refused as `_checkpoint_url` does."""
    from statereg.engine.by_url import split_checkpoint_url

    url = text if "://" in text else os.path.abspath(text)
    try:
        split_checkpoint_url(url)
    except CheckpointNotFoundError as exc:
        last = url.rstrip("/").rpartition("/")[2]
        if last in ("", ".", "..") or last.endswith(":"):
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
    from statereg.backends.registry import backend_class
    from statereg.declaration import load_spec
    from statereg.engine.plan import WorldLayout, compile_job, render_job

    spec = load_spec(args.file)
    sizes = _model_bytes(args.model, spec) if args.model else None
    world = WorldLayout(0, args.world_size, _groups(spec, args.world_size, args.group))
    url = spec.storage.url
    job = compile_job(spec, world, sizes=sizes, store=backend_class(url).capabilities_at(url))
    plans = job
    if args.rank is not None:
        if not 0 <= args.rank < args.world_size:
            raise SpecError(f"--rank {args.rank}: give a rank from 0 to {args.world_size - 1}")
        plans = [job[args.rank]]
    if args.json:
        _print_json(_plan_document(plans))
        return
    tiers = _tiers_block(spec, job, args) if spec.tiers is not None else None
    print(render_job(plans))
    if tiers is not None:
        print()
        print(tiers)


def _print_json(document: Any) -> None:
    """One --json document (a model of statereg/schemas/cli.py) on stdout."""
    print(document.model_dump_json(indent=2))


def _plan_document(plans: list[Any]) -> Any:
    from statereg.schemas.cli import IOPolicyEntry, PlanOutput, RankEntry, StoreEntry, TaskEntry

    def task(t: Any) -> TaskEntry:
        role: Literal["leader", "member"] | None = (
            ("leader" if t.leader else "member") if t.takes_part else None)
        return TaskEntry(component=t.component, kind=t.kind, sharing=t.sharing,
                         format=t.format, layout=t.layout, collective=t.collective,
                         role=role, directory=t.directory, files=list(t.files),
                         codec=t.codec, bytes=t.nbytes if t.takes_part else None)

    first = plans[0]
    return PlanOutput(storage=first.storage, store=StoreEntry(**dataclasses.asdict(first.store)),
                      io=IOPolicyEntry(**dataclasses.asdict(first.io)),
                      world_size=first.world.size,
                      ranks=[RankEntry(rank=p.world.rank, tasks=[task(t) for t in p.tasks])
                             for p in plans])


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
    from statereg.engine.checkpoints import read_latest
    from statereg.engine.listing import checkpoints_in, open_root
    from statereg.engine.report import format_bytes, format_table

    memory_url = _memory_url(args)
    if memory_url is not None:
        # With tiers the durable root may not exist yet (every step still in memory).
        backend = open_backend(_root(args), _options(args))
        _ls_tiers(args, backend, memory_url)
        return
    backend = open_root(_root(args), _options(args))
    committed = checkpoints_in(backend)
    latest = read_latest(backend)
    if args.json:
        _print_json(_ls_document(backend, committed, latest))
        return
    if not committed:
        print(f"no committed checkpoints in {backend.url}{_identity_hint(backend.url)}")
        return
    rows: list[tuple[str, ...]] = [("checkpoint", "step", "tokens", "size", "created", "extra")]
    for c in committed:
        mark = " (latest)" if c.name == latest else ""
        tokens = "-" if c.tokens_seen is None else str(c.tokens_seen)
        rows.append((c.name + mark, str(c.step), tokens, format_bytes(c.total_bytes),
                     c.created_at, json.dumps(c.extra)))
    print("\n".join(format_table(rows)))


def _ls_document(backend: Any, committed: list[Any], latest: str | None,
                 memory: Any = None) -> Any:
    from statereg.schemas.cli import CheckpointEntry, LsOutput

    return LsOutput(root=backend.url, latest=latest, memory=memory, checkpoints=[
        CheckpointEntry(name=c.name, url=c.path, step=c.step, tokens_seen=c.tokens_seen,
                        bytes=c.total_bytes, created_at=c.created_at, extra=c.extra,
                        components=list(c.components), latest=c.name == latest)
        for c in committed])


def _ls_tiers(args: argparse.Namespace, backend: Any, memory_url: str) -> None:
    """`ls` with tiers: where each step lives (docs/cli.md, "Tiers in plan and ls")."""
    from statereg.engine.checkpoints import read_latest
    from statereg.engine.listing import checkpoints_in
    from statereg.tiers.report import memory_roots, render_locations, step_locations

    memories = memory_roots(memory_url)
    if not args.json:
        print(render_locations(backend, memories, memory_url))
        return
    from statereg.schemas.cli import MemoryTiers, StepLocation

    steps = [StepLocation.model_validate({"step": r.step, "memory": list(r.memory),
                                          "durable": r.durable, "bytes": r.size})
             for r in step_locations(backend, memories)]
    memory = MemoryTiers(url=memory_url, roots=[m.url for m in memories], steps=steps)
    _print_json(_ls_document(backend, checkpoints_in(backend), read_latest(backend), memory))


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

    _refuse_missing_local(args.url)
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


def _refuse_missing_local(url: str) -> None:
    """A local checkpoint path that does not exist is a typo or a deleted checkpoint: say
    that, not that a save was interrupted (which a directory without a manifest means)."""
    if "://" in url or os.path.lexists(url):
        return
    parent = os.path.dirname(url.rstrip("/"))
    where = (f"`statereg ls {parent}` lists the checkpoints there" if os.path.isdir(parent)
             else f"its folder {parent} does not exist either")
    raise CheckpointNotFoundError(f"{url} does not exist: check the path; {where}")


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


def cmd_verify(args: argparse.Namespace) -> int:
    from statereg.engine.by_url import verify
    from statereg.engine.report import format_bytes

    target = args.target
    if args.latest or not _names_a_checkpoint(target, _options(args)):
        return _verify_root(args, target)
    _refuse_missing_local(target)
    if not args.json:
        manifest = verify(target, _options(args))
        print(f"ok: {target}: {len(manifest.files)} files, "
              f"{format_bytes(manifest.total_bytes)}, every size and checksum matches the "
              "manifest")
        return 0
    checked = _verify_one(target, _options(args))
    _print_json(_verify_document(target, [checked]))
    return 0 if checked.status == "ok" else 1


def _names_a_checkpoint(url: str, options: dict[str, Any]) -> bool:
    """Whether `url` is one checkpoint rather than a root: its directory has a manifest, or
    its name is a step's (step_00000100, damaged or not); a store's top is a root."""
    from statereg.backends.registry import open_backend
    from statereg.engine.by_url import split_checkpoint_url
    from statereg.engine.checkpoints import step_of
    from statereg.schemas.manifest import MANIFEST_NAME

    try:
        root, name = split_checkpoint_url(url)
    except CheckpointNotFoundError:
        return False
    if step_of(name) is not None:
        return True
    return open_backend(root, options).exists(f"{name}/{MANIFEST_NAME}")


def _verify_one(url: str, options: dict[str, Any], damage: Exception | None = None) -> Any:
    """Read checkpoint `url` in full against its manifest; `damage`: already known (its
    manifest does not load)."""
    from statereg.engine.by_url import verify
    from statereg.engine.checkpoints import step_of
    from statereg.errors import CorruptCheckpointError, ManifestError
    from statereg.schemas.cli import VerifiedCheckpoint

    name = url.rstrip("/").rpartition("/")[2]
    if damage is None:
        try:
            manifest = verify(url, options)
        except (CorruptCheckpointError, ManifestError, CheckpointNotFoundError) as exc:
            damage = exc
        else:
            return VerifiedCheckpoint(
                name=name, url=url, step=manifest.step, status="ok",
                files=len(manifest.files) + len(manifest.references),
                bytes=manifest.total_bytes, error=None)
    return VerifiedCheckpoint(name=name, url=url, step=step_of(name), status="damaged",
                              files=None, bytes=None, error=str(damage))


def _verify_document(target: str, checked: list[Any]) -> Any:
    from statereg.schemas.cli import VerifyOutput

    damaged = [c.name for c in checked if c.status == "damaged"]
    return VerifyOutput(target=target, ok=not damaged, checkpoints=checked, damaged=damaged)


def _verify_root(args: argparse.Namespace, url: str) -> int:
    """Every committed checkpoint of root `url` (or its newest, --latest) read in full: one
    line each; exit 1 naming the damaged ones, or when there is nothing to verify."""
    from statereg.engine.checkpoints import scan_root, step_of
    from statereg.engine.listing import open_root
    from statereg.engine.report import format_bytes

    options = _options(args)
    backend = open_root(url, options)
    scan = scan_root(backend)  # every directory with a manifest, loadable or not
    found: list[tuple[str, Exception | None]] = [(c.name, None) for c in scan.committed]
    found += [(name, exc) for name, exc in scan.unreadable.items()]
    found.sort(key=lambda item: step_of(item[0]) or 0)
    if args.latest:
        found = found[-1:]
    checked = [_verify_one(backend.display(name), options, exc) for name, exc in found]
    document = _verify_document(backend.url, checked)
    if args.json:
        _print_json(document)
    else:
        for c in checked:
            if c.status == "ok":
                print(f"ok:      {c.url}: {c.files} files, {format_bytes(c.bytes or 0)}")
            else:
                print(f"DAMAGED: {c.url}: {c.error}")
    if not checked:
        print(f"statereg verify: error: no committed checkpoint in {backend.url} to verify; "
              f"check the root (`statereg ls {backend.url}`)", file=sys.stderr)
        return 1
    if document.damaged:
        print(f"statereg verify: error: {len(document.damaged)} of {len(checked)} "
              f"checkpoints damaged: {', '.join(document.damaged)}; load or copy an intact "
              "one", file=sys.stderr)
        return 1
    if not args.json:
        print(f"{len(checked)} checkpoint(s) verified: every size and checksum matches")
    return 0


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
    p.add_argument("--json", action="store_true",
                   help="print the plan of each rank as one JSON document (without the "
                   "tiers block)")
    p.set_defaults(run=cmd_plan)

    p = sub.add_parser("schema", help="print the JSON Schema of statereg.yaml, of manifest.json "
                       "or of the documents --json prints (cli)")
    p.add_argument("which", nargs="?", choices=("spec", "manifest", "cli"), default="spec")
    p.add_argument("--path", action="store_true",
                   help="print where the installed schema file is (for an editor's YAML plugin)")
    p.set_defaults(run=cmd_schema)

    def json_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--json", action="store_true",
                       help="print one JSON document (schema: `statereg schema cli`)")

    def storage_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--spec", help="take storage options from this statereg.yaml")
        p.add_argument("--options", help="storage options as a JSON object")

    p = sub.add_parser("ls", help="list committed checkpoints under a root (and, with tiers, "
                       "where each step lives)")
    p.add_argument("root", nargs="?",
                   help="checkpoint root: path or URL (default: storage.url of --spec)")
    p.add_argument("--memory", metavar="SHM_URL",
                   help="also show this memory tier root (default: the tiers of --spec)")
    json_arg(p)
    storage_args(p)
    p.set_defaults(run=cmd_ls)

    p = sub.add_parser("inspect", help="show a checkpoint's manifest: components, sizes, versions")
    p.add_argument("url", type=_checkpoint_url,
                   help="checkpoint path or URL, e.g. ./checkpoints/step_00000100")
    p.add_argument("--json", action="store_true",
                   help="print the manifest itself (schema: `statereg schema manifest`)")
    storage_args(p)
    p.set_defaults(run=cmd_inspect)

    p = sub.add_parser("verify", help="recompute every file's size and checksum of a "
                       "checkpoint, or of every checkpoint of a root")
    p.add_argument("target", type=_verify_target,
                   help="checkpoint path or URL, or a root to verify every committed "
                   "checkpoint of")
    p.add_argument("--latest", action="store_true",
                   help="with a root: verify only its newest checkpoint")
    json_arg(p)
    storage_args(p)
    p.set_defaults(run=cmd_verify)

    p = sub.add_parser("gc", help="list (or --delete) leftovers of interrupted saves under a root")
    p.add_argument("root", help="checkpoint root: path or URL")
    p.add_argument("--delete", action="store_true",
                   help="remove the leftovers (default: a dry run that only lists them)")
    p.add_argument("--grace", default="1h",
                   help="keep leftovers younger than this, a save may be writing them "
                   "(seconds, or e.g. 30m, 1h; default 1h)")
    json_arg(p)
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
    json_arg(p)
    storage_args(p)
    p.set_defaults(run=cmd_cp)
    return parser


_REMOTE = ("s3://", "s3a://", "gs://", "gcs://")


def _storage_hint(args: argparse.Namespace) -> str:
    """What to try when a remote store failed and no storage options were given at all."""
    given = [getattr(args, name, None)
             for name in ("root", "url", "target", "src", "dst", "out_dir")]
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


@contextlib.contextmanager
def _warnings_to_stderr() -> Iterator[None]:
    """statereg's warnings (a damaged checkpoint skipped, an entry not readable) on stderr,
    one line each, while a command runs, unless the program running it configured logging:
    the package logger has only a NullHandler, which leaves the choice to applications."""
    if logging.getLogger().handlers:
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(message)s"))
    package = logging.getLogger("statereg")
    package.addHandler(handler)
    try:
        yield
    finally:
        package.removeHandler(handler)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with _warnings_to_stderr():
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
