"""`statereg plan` and `statereg schema`: what a declaration means, before anything runs.
Neither imports torch (unless `plan --model` builds the model), so they answer in well under
a second."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, Literal

from statereg.cli.common import _print_json
from statereg.errors import SpecError


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
