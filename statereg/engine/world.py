"""Who we are among the ranks, and the few collectives statereg's coordination needs.

All of statereg's collectives (its status exchange, file reports and DCP's planning) run on a
dedicated gloo group: it works whatever backend training uses (NCCL cannot gather Python
objects on CPU), and a save running in the background never interleaves its collectives with
the training loop's on the default group.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from statereg.engine.plan import WORLD, WorldLayout
from statereg.errors import SpecError, StateregError


def attempt(fn: Any, *args: Any) -> tuple[Any, BaseException | None]:
    """Run fn, returning (result, error) so every rank can report before anyone raises.

    Catches BaseException because DCP's CheckpointException derives from it.
    """
    try:
        return fn(*args), None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        return None, exc


def _describe(exc: BaseException) -> str:
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):  # DCP's CheckpointException: each rank's own error
        return "; ".join(f"rank {r}: {_describe(pair[0])}" for r, pair in sorted(failures.items()))
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def raise_own(error: BaseException, what: str, rank: int) -> None:
    """Raise this rank's error itself, also when DCP wrapped it in a CheckpointException.

    CheckpointException derives from BaseException, which `except Exception` misses: when it
    carries no error of this rank's own, it becomes a StateregError naming the failed ranks.
    """
    if isinstance(error, Exception):
        raise error
    own = getattr(error, "failures", {}).get(rank)
    if own is not None and isinstance(own[0], Exception):
        raise own[0] from error
    raise StateregError(f"{what} failed: {_describe(error)}") from error


@dataclass(frozen=True)
class World:
    """This process's rank, the world size, and the process groups statereg uses."""

    rank: int = 0
    size: int = 1
    group: Any = None  # statereg's own gloo group over all ranks; None when not distributed
    groups: Mapping[str, Any] = field(default_factory=dict)
    layout: WorldLayout = field(default_factory=WorldLayout)

    @classmethod
    def detect(cls, groups: Mapping[str, Any] | None = None) -> World:
        """The current world: torch.distributed's if initialized, else a single process.

        Collective: every rank learns every copy of each named group (their members), so
        plans name every group's directory, and a rank outside every group is an error now.
        """
        if not (dist.is_available() and dist.is_initialized()):
            if groups:
                raise SpecError("groups=... needs torch.distributed to be initialized")
            return cls()
        groups = dict(groups or {})
        group = dist.new_group(backend="gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
        mine = {name: tuple(sorted(dist.get_process_group_ranks(g)))
                for name, g in sorted(groups.items())}
        everyone: list[Any] = [None] * size
        dist.all_gather_object(everyone, mine, group=group)
        layout = WorldLayout(rank, size, {
            name: tuple(sorted({ranks[name] for ranks in everyone})) for name in mine})
        return cls(rank, size, group, groups, layout)

    @property
    def distributed(self) -> bool:
        return self.group is not None

    def process_group(self, collective: str | None) -> Any:
        """The process group of a task's collective (None: this rank alone)."""
        if collective is None or not self.distributed:
            return None
        return self.group if collective == WORLD else self.groups[collective]

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (just [obj] on one process)."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """`obj` from rank `src` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def agree(self, error: BaseException | None, what: str) -> None:
        """Exchange success or failure; if any rank failed, raise on every rank.

        Called around every collective phase, so one rank's failure ends the operation on all
        ranks instead of leaving the others waiting in a collective. The failing rank raises
        its own error; the others raise a StateregError naming the failed ranks.
        """
        if not self.distributed:
            if error is not None:
                raise_own(error, what, self.rank)
            return
        reports = self.all_gather(None if error is None else _describe(error))
        failed = {r: msg for r, msg in enumerate(reports) if msg is not None}
        if error is not None:
            raise_own(error, what, self.rank)
        if failed:
            lines = "; ".join(f"rank {r}: {msg}" for r, msg in sorted(failed.items()))
            raise StateregError(f"{what} failed on {len(failed)} of {self.size} ranks ({lines})")
