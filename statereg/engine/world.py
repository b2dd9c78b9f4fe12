"""Who we are among the ranks, and the few collectives statereg's coordination needs.

All of statereg's collectives (its status exchange, file reports and DCP's planning) run on a
dedicated gloo group: it works whatever backend training uses (NCCL cannot gather Python
objects on CPU), and a save running in the background never interleaves its collectives with
the training loop's on the default group.

Those groups are statereg's to end (`World.release`, run by `CheckpointManager.close()`): a
gloo group's worker threads stop only when the last reference to the group goes, not at
`dist.destroy_process_group()`. Left running into interpreter exit, a worker thread that drops
the last reference to a finished collective holding Python-owned tensors (every
`*_object` collective's) takes the GIL while the interpreter is finalizing, and the process
aborts: "terminate called without an active exception" (docs/distributed.md, "Shutting
down").
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from statereg.engine.plan import WORLD, WorldLayout
from statereg.errors import CorruptCheckpointError, SpecError, StateregError

T = TypeVar("T")


@dataclass
class Outcome:
    """How a block run under `caught()` ended: `error` is None when it completed."""

    error: BaseException | None = None


@contextmanager
def caught() -> Iterator[Outcome]:
    """Run the block, keeping its error in the yielded Outcome instead of raising it, so
    every rank can report before anyone raises (`World.agree`, `World.gather_checked`):

        with caught() as capturing:
            captured = capture(plan, adapters)
        world.agree(capturing.error, "reading state")

    The block's calls read as calls (no function-and-arguments dispatch). Catches
    BaseException because DCP's CheckpointException derives from it; KeyboardInterrupt and
    SystemExit still propagate.
    """
    outcome = Outcome()
    try:
        yield outcome
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        outcome.error = exc


def describe(exc: BaseException) -> str:
    """One line naming an error's type and its message's first line, as the other ranks see
    it in a failure report (DCP's CheckpointException: each failed rank's own error)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):  # DCP's CheckpointException: each rank's own error
        return "; ".join(f"rank {r}: {describe(pair[0])}" for r, pair in sorted(failures.items()))
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _own_error(error: BaseException, rank: int) -> BaseException:
    """The error itself, or this rank's (else the first) error inside DCP's CheckpointException."""
    failures = getattr(error, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return error
    own = failures.get(rank, next(iter(failures.values())))
    return own[0] if isinstance(own, tuple) and isinstance(own[0], BaseException) else error


def _is_damage(error: BaseException, rank: int) -> bool:
    return isinstance(_own_error(error, rank), CorruptCheckpointError)


def _portable(error: BaseException, rank: int) -> BaseException:
    """An error another rank can raise as its own: the same one when it pickles, else a
    StateregError with its description (a DCP CheckpointException carries tracebacks)."""
    own = _own_error(error, rank)
    try:
        return pickle.loads(pickle.dumps(own))  # type: ignore[no-any-return]
    except Exception:
        return StateregError(describe(own))


def unwrap_alone(error: BaseException) -> BaseException:
    """The error inside DCP's CheckpointException from a call run on this process alone
    (no_dist: DCP keys it as rank 0 whatever this rank is), else the error itself."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and len(failures) == 1:
        (inner,) = failures.values()
        if isinstance(inner, tuple) and isinstance(inner[0], BaseException):
            return inner[0]
    return error


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
    raise StateregError(f"{what} failed: {describe(error)}") from error


@dataclass
class _Groups:
    """The process groups a World uses, in one place so that `World.release` drops every
    reference at once (the World is shared by the saver, the tiers and the layouts)."""

    world: Any = None  # statereg's own gloo group over all ranks; None when not distributed
    named: Mapping[str, Any] = field(default_factory=dict)
    made: list[Any] = field(default_factory=list)  # the groups statereg created: its to destroy
    released: bool = False


@dataclass(frozen=True)
class World:
    """This process's rank, the world size, and the process groups statereg uses."""

    rank: int = 0
    size: int = 1
    layout: WorldLayout = field(default_factory=WorldLayout)
    held: _Groups = field(default_factory=_Groups, repr=False, compare=False)

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
        made = [group]
        rank, size = dist.get_rank(), dist.get_world_size()
        mine = {name: (tuple(sorted(dist.get_process_group_ranks(g))), dist.get_backend(g))
                for name, g in sorted(groups.items())}
        everyone: list[Any] = [None] * size
        dist.all_gather_object(everyone, mine, group=group)
        layout = WorldLayout(rank, size, {
            name: tuple(sorted({ranks[name][0] for ranks in everyone})) for name in mine})
        # statereg sends CPU tensors and Python objects over a named group too: a group of
        # another backend (NCCL) gets a gloo twin of the same members, made by every rank in
        # the same order (new_group is collective).
        for name in mine:
            if all(ranks[name][1] == "gloo" for ranks in everyone):
                continue
            for members in layout.groups[name]:
                twin = dist.new_group(list(members), backend="gloo")
                if rank in members:
                    groups[name] = twin
                    made.append(twin)
        return cls(rank, size, layout, _Groups(group, groups, made))

    @property
    def distributed(self) -> bool:
        return self.held.world is not None or self.held.released

    @property
    def group(self) -> Any:
        """statereg's own gloo group over all ranks (None when not distributed)."""
        self._check_live()
        return self.held.world

    @property
    def groups(self) -> Mapping[str, Any]:
        """The named process groups statereg uses (a named NCCL group's gloo twin)."""
        self._check_live()
        return self.held.named

    def _check_live(self) -> None:
        if self.held.released:
            raise StateregError(
                "this CheckpointManager is closed: close() (or leaving its `with` block) "
                "released the process groups it coordinated the ranks on; construct a new "
                "CheckpointManager (on every rank) to save or load again")

    def release(self) -> None:
        """Destroy the process groups statereg created and drop every reference to them.

        Local, no collective, so it cannot hang on a rank whose peers are gone or still
        training: every collective statereg ran has completed on this rank, and a gloo send
        completes only once the peer has posted its receive, so no peer is left waiting on
        this rank; a peer that runs a collective on these groups later gets gloo's
        "Connection closed by peer" at once. Their worker threads end here, while the
        interpreter is whole, not during its exit (see the module docstring). Named groups
        the caller passed are only let go, never destroyed: they are the caller's.
        """
        held = self.held
        if held.released:
            return
        made = held.made
        held.world, held.named, held.made, held.released = None, {}, [], True
        while made:
            group = made.pop()
            # Already gone when the user ran dist.destroy_process_group() first: then only
            # this last reference remains, and dropping it ends the group's threads.
            if dist.is_initialized():
                with contextlib.suppress(ValueError):  # "Invalid process group specified"
                    dist.destroy_process_group(group)
            del group  # the last reference: the group's destructor joins its worker threads

    def process_group(self, collective: str | None) -> Any:
        """The process group of a task's collective (None: this rank alone)."""
        if collective is None or not self.distributed:
            return None
        return self.group if collective == WORLD else self.groups[collective]

    def members(self, group: Any = None) -> tuple[int, ...]:
        """The global ranks of `group` (statereg's world group when None), in order."""
        if not self.distributed:
            return (self.rank,)
        if group is None or group is self.group:
            return tuple(range(self.size))
        return tuple(sorted(dist.get_process_group_ranks(group)))

    def all_gather(self, obj: Any, group: Any = None) -> list[Any]:
        """Every rank's `obj`, in rank order (just [obj] on one process); `group`: gather
        among that process group's ranks only (statereg's world group when None)."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * len(self.members(group))
        dist.all_gather_object(out, obj, group=self.group if group is None else group)
        return out

    def broadcast(self, obj: Any, src: int = 0, group: Any = None) -> Any:
        """`obj` from global rank `src` on every rank of `group` (statereg's world group)."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group if group is None else group)
        return box[0]

    def from_leader(self, fn: Callable[..., T], *args: Any, group: Any = None) -> T:
        """fn(*args) run by the lowest rank of `group` only, its result on every rank.

        What every rank would read alike (a manifest, DCP `.metadata`, a sidecar, a small
        state file) is read once this way and broadcast. The leader's failure is raised on
        every rank of the group: the leader's own error there, an equal copy elsewhere, so a
        damaged file is a CorruptCheckpointError on every rank.
        """
        if not self.distributed:
            return fn(*args)
        leader = self.members(group)[0]
        result, error = None, None
        if self.rank == leader:
            with caught() as reading:
                result = fn(*args)
            error = reading.error
        shared = self.broadcast((result, None if error is None else _portable(error, leader)),
                                src=leader, group=group)
        if error is not None:
            raise_own(error, "reading", self.rank)
        if shared[1] is not None:
            raise shared[1]
        return shared[0]  # type: ignore[no-any-return]

    def gather_on_leader(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` on rank 0, in rank order, in one collective; None elsewhere.

        For what only rank 0 reads (a save's file reports, item digests): an all-gather would
        send every rank's objects to every rank, N times the bytes for nothing.
        """
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out

    def agree(self, error: BaseException | None, what: str, group: Any = None) -> None:
        """Exchange success or failure; if any rank failed, raise on every rank.

        Called around every collective phase, so one rank's failure ends the operation on all
        ranks instead of leaving the others waiting in a collective. The failing rank raises
        its own error; the others raise a StateregError naming the failed ranks, or a
        CorruptCheckpointError when a rank found damage (a file one rank read for the group
        is damaged for all of them: each must fall back alike). `group`: among its ranks only.

        One all-reduce of a failure flag (8 bytes, whatever the rank count); only when some
        rank failed does a second collective, an all-gather, bring every rank's report.
        """
        if not self.distributed:
            if error is not None:
                raise_own(error, what, self.rank)
            return
        failed = torch.tensor([0 if error is None else 1], dtype=torch.int64)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX,
                        group=self.group if group is None else group)
        if failed.item():
            self._exchange(None, error, what, group)  # raises on every rank

    def gather_checked(self, value: Any, error: BaseException | None, what: str,
                       group: Any = None) -> list[Any]:
        """Every rank's `value` in rank order (of `group`'s ranks), exchanged with success or
        failure in one collective: if any rank failed, raise on every rank as `agree` does."""
        if not self.distributed:
            if error is not None:
                raise_own(error, what, self.rank)
            return [value]
        return self._exchange(value, error, what, group)

    def _exchange(self, value: Any, error: BaseException | None, what: str,
                  group: Any) -> list[Any]:
        """One all-gather of every rank's (value, failure report); raises as `agree` says."""
        report = None if error is None else (describe(error), _is_damage(error, self.rank))
        gathered = self.all_gather((None if error is not None else value, report), group)
        ranks = self.members(group)
        failed = {ranks[i]: r for i, (_, r) in enumerate(gathered) if r is not None}
        if error is not None:
            raise_own(error, what, self.rank)
        if failed:
            lines = "; ".join(f"rank {r}: {msg}" for r, (msg, _) in sorted(failed.items()))
            text = f"{what} failed on {len(failed)} of {len(ranks)} ranks ({lines})"
            if any(damage for _, damage in failed.values()):
                raise CorruptCheckpointError(text)
            raise StateregError(text)
        return [v for v, _ in gathered]
