"""Conformance: every kind x sharing x format the schema accepts works exactly, at world sizes
1, 2 and 4 on real gloo groups; every combination it refuses is a SpecError at load_spec.

For each accepted combination and world size: save; the manifest's files are exactly the
ones the ranks' plans predicted; a load into fresh objects is bit-identical (each rank gets
its own copy back for per_rank, its group's for per_group); a load at another world size is
exact for one-copy patterns (global, replicated, sharded) and a StateregError otherwise.
The combinations are generated from the schema, so a new kind, sharing or format is tested
(or refused) without touching this file.
"""

from __future__ import annotations

import itertools
import warnings
from pathlib import Path
from typing import Any, get_args

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from pydantic import ValidationError
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import statereg
from statereg.engine.plan import unpredicted
from statereg.schemas.spec import ComponentSpec, Format, Kind, Sharing

WORLD_SIZES = (1, 2, 4)
ONE_COPY = {"global", "replicated", "sharded"}


def _declaration(kind: str, sharing: str, fmt: str) -> dict[str, Any]:
    decl: dict[str, Any] = {"kind": kind, "sharing": sharing, "format": fmt}
    if sharing == "per_group":
        decl["group"] = "pp"
    return decl


def schema_matrix() -> tuple[list[tuple[str, str, str]], list[tuple[str, str, str]]]:
    """(accepted, refused) combinations of kind x sharing x format, as the schema decides."""
    accepted, refused = [], []
    for combo in itertools.product(get_args(Kind), get_args(Sharing), get_args(Format)):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ComponentSpec.model_validate(_declaration(*combo))
        except ValidationError:
            refused.append(combo)
        else:
            accepted.append(combo)
    return accepted, refused


ACCEPTED, REFUSED = schema_matrix()


def test_every_combination_the_schema_refuses_is_a_spec_error_at_load_spec(
        capsys: pytest.CaptureFixture[str]) -> None:
    with capsys.disabled():  # the matrix's size belongs in the test output
        print(f"\nschema matrix: {len(ACCEPTED)} accepted, {len(REFUSED)} refused "
              f"kind x sharing x format combinations")
    assert ACCEPTED and REFUSED
    for kind, sharing, fmt in REFUSED:
        with pytest.raises(statereg.SpecError, match=r"components\.c") as info:
            statereg.load_spec({"storage": {"url": "./c"},
                                "components": {"c": _declaration(kind, sharing, fmt)}})
        assert len(str(info.value)) > 40, (kind, sharing, fmt, str(info.value))


# -- the objects, with values that tell ranks and groups apart -----------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.register_buffer("count", torch.zeros(2, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class Box:
    """A scheduler, dataloader or custom object: state_dict()/load_state_dict()."""

    def __init__(self, seed: int, tensors_only: bool) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.state = {"w": torch.randn(3, generator=gen), "n": torch.tensor(seed)}
        if not tensors_only:
            self.state["n"] = seed  # a plain int in json / torch files

    def state_dict(self) -> dict[str, Any]:
        return {k: v.clone() if isinstance(v, torch.Tensor) else v
                for k, v in self.state.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = dict(state)


def _seed(base: int, sharing: str, rank: int, groups: dict[str, Any]) -> int:
    """One value per copy: per rank, per group, or one for every rank."""
    if sharing == "per_rank":
        return base + 100 * (rank + 1)
    if sharing == "per_group":
        return base + 100 * (min(dist.get_process_group_ranks(groups["pp"])) + 1)
    return base


def _full(t: Any) -> Any:
    return t.full_tensor() if isinstance(t, DTensor) else t


class Case:
    """One combination's declaration, objects and snapshot on this rank."""

    def __init__(self, combo: tuple[str, str, str], root: Path, world: int) -> None:
        self.kind, self.sharing, self.fmt = combo
        self.url = str(root / "-".join(combo) / f"ws{world}")

    def spec(self, url: str | None = None) -> dict[str, Any]:
        components = {"c": _declaration(self.kind, self.sharing, self.fmt)}
        if self.kind == "optimizer":
            components["m"] = {"kind": "model", "sharing": self.sharing, "format": "dcp",
                               **({"group": "pp"} if self.sharing == "per_group" else {})}
            components["c"]["model"] = "m"
        return {"storage": {"url": url or self.url}, "components": components}

    def objects(self, seed: int) -> dict[str, Any]:
        if self.kind == "rng":
            torch.manual_seed(seed)
            return {}
        if self.kind in ("model", "optimizer"):
            torch.manual_seed(seed)
            model = Net()
            model.count.fill_(seed)
            if self.sharing == "sharded" and dist.get_world_size() > 1:
                fully_shard(model)
            if self.kind == "model":
                return {"c": model}
            opt = torch.optim.AdamW(model.parameters(), lr=0.1)
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            return {"m": model, "c": opt}
        return {"c": Box(seed, tensors_only=self.fmt == "dcp")}

    def snapshot(self, objects: dict[str, Any]) -> dict[str, Any]:
        """What must come back, as plain values (collective for sharded tensors)."""
        if self.kind == "rng":
            return {"draw": torch.rand(3)}  # the next numbers the restored generator gives
        if self.kind == "model":
            return {k: _full(v).clone() for k, v in objects["c"].state_dict().items()}
        if self.kind == "optimizer":
            return {f"{i}.{k}": _full(v).clone()
                    for i, entries in enumerate(objects["c"].state.values())
                    for k, v in entries.items()}
        return objects["c"].state_dict()


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape
                    and torch.equal(x.view(-1).view(torch.uint8) if x.numel() else x,
                                    y.view(-1).view(torch.uint8) if y.numel() else y)):
                return False
        elif x != y:
            return False
    return True


def _groups(rank: int, world: int) -> dict[str, Any]:
    """Pipeline-like groups: {0} | {0},{1} | {0,1},{2,3}."""
    layout = [[r] for r in range(world)] if world <= 2 else [[0, 1], [2, 3]]
    mine = None
    for members in layout:
        group = dist.new_group(members, backend="gloo")
        if rank in members:
            mine = group
    return {"pp": mine}


def _load_into(case: Case, url: str, world: int, rank: int, groups: dict[str, Any],
               ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(what was saved here, what a fresh load gave), on this rank."""
    saved = case.snapshot(case.objects(_seed(1, case.sharing, rank, groups)))
    fresh = case.objects(_seed(5000, case.sharing, rank, groups))
    with statereg.CheckpointManager(case.spec(url), groups=groups, **fresh) as mgr:
        mgr.load()
    return saved, case.snapshot(fresh)


def conformance_pass(rank: int, world: int, root: Path, save: bool, load_from: list[int],
                     ) -> None:
    groups = _groups(rank, world)
    failures: list[str] = []
    for combo in ACCEPTED:
        case = Case(combo, root, world)
        where = f"{'/'.join(combo)} at world size {world}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            try:
                if save:
                    objects = case.objects(_seed(1, case.sharing, rank, groups))
                    with statereg.CheckpointManager(case.spec(), groups=groups,
                                                    **objects) as mgr:
                        mgr.save(step=1)
                        plans = mgr.world.all_gather(mgr.plan)
                    manifest = statereg.read_manifest(f"{case.url}/step_00000001")
                    extra, missing = unpredicted([f.path for f in manifest.files], plans)
                    if extra or missing:
                        failures.append(f"{where}: files not predicted {extra}, predicted "
                                        f"but missing {missing}")
                    saved, loaded = _load_into(case, case.url, world, rank, groups)
                    if not _equal(saved, loaded):
                        failures.append(f"{where}: load is not bit-identical on rank {rank}")
                for other in load_from:
                    url = str(root / "-".join(combo) / f"ws{other}")
                    try:
                        saved, loaded = _load_into(case, url, world, rank, groups)
                    except statereg.StateregError as exc:
                        if combo[1] in ONE_COPY:
                            failures.append(f"{where} from {other}: refused ({exc})")
                        elif not str(exc).strip():
                            failures.append(f"{where} from {other}: an error without a reason")
                    else:
                        if combo[1] not in ONE_COPY:
                            failures.append(f"{where} from {other}: loaded per-copy state "
                                            "saved at another world size")
                        elif not _equal(saved, loaded):
                            failures.append(f"{where} from {other}: not bit-identical")
            except Exception as exc:  # every combination is reported, not just the first
                failures.append(f"{where}: {type(exc).__name__}: {exc}")
    everyone = [None] * world
    dist.all_gather_object(everyone, failures)
    problems = sorted({f for rank_failures in everyone for f in rank_failures})
    assert not problems, f"{len(problems)} failures:\n" + "\n".join(problems)


def test_every_accepted_combination_round_trips_at_world_sizes_1_2_4(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with capsys.disabled():
        print(f"\nconformance matrix: {len(ACCEPTED)} combinations x {len(WORLD_SIZES)} world "
              f"sizes = {len(ACCEPTED) * len(WORLD_SIZES)} save/load cases, plus "
              f"{len(ACCEPTED) * 6} loads across world sizes")
    root = tmp_path / "matrix"
    # Each size saves and loads its own; then loads across sizes, both ways.
    run_ranks(1, conformance_pass, tmp_path, root, True, [])
    run_ranks(2, conformance_pass, tmp_path, root, True, [1])
    run_ranks(4, conformance_pass, tmp_path, root, True, [1, 2])
    run_ranks(1, conformance_pass, tmp_path, root, False, [2, 4])
    run_ranks(2, conformance_pass, tmp_path, root, False, [4])
