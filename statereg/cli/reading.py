"""The commands that report on checkpoints already written: `statereg ls` (with tiers,
where each step lives), `inspect` and `verify` (one checkpoint, or every one of a root)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from statereg.cli.common import _options, _print_json, _refuse_missing_local
from statereg.errors import CheckpointNotFoundError, SpecError


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
