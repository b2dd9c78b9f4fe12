"""The kind x sharing x format matrix the schema accepts, and the objects of each case:
values that tell ranks and groups apart, snapshots of what must come back, and a bitwise
comparison. Shared by the conformance tests with and without memory tiers."""

from __future__ import annotations

import itertools
import random
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, get_args

import numpy as np
import torch
import torch.distributed as dist
from pydantic import ValidationError
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import statereg
from statereg.schemas.spec import ComponentSpec, Format, Kind, Sharing

ONE_COPY = {"global", "replicated", "sharded"}


def declaration(kind: str, sharing: str, fmt: str) -> dict[str, Any]:
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
                ComponentSpec.model_validate(declaration(*combo))
        except ValidationError:
            refused.append(combo)
        else:
            accepted.append(combo)
    return accepted, refused


ACCEPTED, REFUSED = schema_matrix()

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


def seed_for(base: int, sharing: str, rank: int, groups: dict[str, Any]) -> int:
    """One value per copy: per rank, per group, or one for every rank."""
    if sharing == "per_rank":
        return base + 100 * (rank + 1)
    if sharing == "per_group":
        return base + 100 * (min(dist.get_process_group_ranks(groups["pp"])) + 1)
    return base


def full(t: Any) -> Any:
    return t.full_tensor() if isinstance(t, DTensor) else t


class Case:
    """One combination's declaration, objects and snapshot on this rank."""

    def __init__(self, combo: tuple[str, str, str], root: Path | str, world: int,
                 options: dict[str, Any] | None = None) -> None:
        self.kind, self.sharing, self.fmt = combo
        self.url = f"{root}/{'-'.join(combo)}/ws{world}"
        self.options = options or {}  # storage.options of a remote root

    def spec(self, url: str | None = None) -> dict[str, Any]:
        components = {"c": declaration(self.kind, self.sharing, self.fmt)}
        if self.kind == "optimizer":
            components["m"] = {"kind": "model", "sharing": self.sharing, "format": "dcp",
                               **({"group": "pp"} if self.sharing == "per_group" else {})}
            components["c"]["model"] = "m"
        return {"storage": {"url": url or self.url, "options": self.options},
                "components": components}

    def objects(self, seed: int) -> dict[str, Any]:
        if self.kind == "rng":
            # Every generator: a one-copy rng whose ranks differ is refused at save.
            random.seed(seed)
            np.random.seed(seed)
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
            return {k: full(v).clone() for k, v in objects["c"].state_dict().items()}
        if self.kind == "optimizer":
            return {f"{i}.{k}": full(v).clone()
                    for i, entries in enumerate(objects["c"].state.values())
                    for k, v in entries.items()}
        return objects["c"].state_dict()


def bitwise_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
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


def pipeline_groups(rank: int, world: int) -> dict[str, Any]:
    """Pipeline-like groups: {0} | {0},{1} | {0,1},{2,3}."""
    layout = [[r] for r in range(world)] if world <= 2 else [[0, 1], [2, 3]]
    mine = None
    for members in layout:
        group = dist.new_group(members, backend="gloo")
        if rank in members:
            mine = group
    return {"pp": mine}


# -- what every matrix pass does -----------------------------------------------------------


def change_in_place(objects: dict[str, Any]) -> None:
    """Change every value a save captured, in place where it can be (after `save()` returns,
    as a training step does): what was saved must not change with it."""
    with torch.no_grad():
        for obj in objects.values():
            if isinstance(obj, nn.Module):
                for tensor in obj.state_dict().values():
                    tensor.add_(1)
            elif isinstance(obj, torch.optim.Optimizer):
                for entries in obj.state.values():
                    for tensor in entries.values():
                        tensor.add_(1)
            else:
                obj.state["w"].add_(1)
                obj.state["n"] += 1
    torch.rand(7)  # the global generator moves on


def load_fresh(case: Case, spec: dict[str, Any], rank: int, groups: dict[str, Any],
               seed: int = 1, changes: int = 0, **load: Any,
               ) -> tuple[statereg.LoadResult | None, bool]:
    """Load `spec` into fresh objects on this rank: (the result, whether they now hold
    exactly the values `seed` gave them, changed `changes` times by change_in_place)."""
    expected = case.objects(seed_for(seed, case.sharing, rank, groups))
    for _ in range(changes):
        change_in_place(expected)
    saved = case.snapshot(expected)
    fresh = case.objects(seed_for(5000, case.sharing, rank, groups))
    with statereg.CheckpointManager(spec, groups=groups, **fresh) as mgr:
        result = mgr.load(**load)
    return result, bitwise_equal(saved, case.snapshot(fresh))


def on_rank_zero(rank: int, work: Callable[..., None], *args: Any) -> str | None:
    """Run `work(*args)` on rank 0 only (a copy, a verify); every rank gets its error, if
    any."""
    error: list[str | None] = [None]
    if rank == 0:
        try:
            work(*args)
        except Exception as exc:
            error = [f"{type(exc).__name__}: {exc}"]
    dist.broadcast_object_list(error, 0)
    return error[0]


@contextmanager
def reported(failures: list[str], where: str) -> Iterator[None]:
    """One combination's checks: UserWarnings silenced, and an exception recorded among
    `failures` instead of raised, so every combination is reported, not just the first."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        try:
            yield
        except Exception as exc:
            failures.append(f"{where}: {type(exc).__name__}: {exc}")


def assert_none_failed(failures: list[str], world: int) -> None:
    """Every rank's failures, each once, fail every rank (collective)."""
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, failures)
    problems = sorted({f for rank_failures in everyone for f in rank_failures})
    assert not problems, f"{len(problems)} failures:\n" + "\n".join(problems)
