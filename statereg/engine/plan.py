"""Compile a declaration, the live objects and the world into per-rank plans of concrete tasks.

A `RankPlan` says, for one rank, what each component's save is: whether this rank takes
part, whether it leads (writes the shared files), over which collective, into which real
directory, which files it writes, by which layout, with which codec; and, where the store's
kind is known, its I/O policy (engine/io_policy.py: threads, components together or not,
broadcast reads, zip CRC-32s, writes around the page cache). Save runs these tasks and
nothing else; `statereg plan` prints them. Load compiles a `LoadTask` per
component from the manifest's record of what was saved plus the declaration, and checks
that the two fit before anything is read (`compile_load`).

Plain data and torch-free, so the CLI prints plans without starting a job.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from statereg.backends.capabilities import StoreCapabilities
from statereg.engine.io_policy import IOPolicy, storage_policy
from statereg.engine.report import format_bytes, format_table
from statereg.errors import CheckpointMismatchError, SpecError
from statereg.formats.names import (
    DCP_METADATA_NAME,
    SAFETENSORS_INDEX_NAME,
    SIDECAR_NAME,
    STATE_STEM,
    TORCH_MODEL_NAME,
    dcp_data_files,
    group_by_size,
    object_suffix,
    rank_file,
    shard_file_name,
)
from statereg.schemas.spec import (
    DEFAULT_MAX_SHARD_SIZE,
    ComponentSpec,
    Format,
    Kind,
    RegistrySpec,
    Sharing,
    parse_size,
)

# How a component's bytes are laid out; one executor module each (engine/layouts/).
Layout = Literal["dcp", "consolidated", "object_file"]
# The collective a task runs over: None (this rank alone), the whole world, or a named group.
WORLD = "world"


def layout_of(kind: str, fmt: str) -> Layout:
    """The layout that stores `kind` in `fmt` (the schema allows only these pairs)."""
    if fmt == "dcp":
        return "dcp"
    if kind == "model":  # safetensors or torch: one full copy of every tensor
        return "consolidated"
    return "object_file"


@dataclass(frozen=True)
class WorldLayout:
    """Who is where: this rank, the world size, and every copy of each named process group
    (as tuples of global ranks). Plain data: a live job builds it once (engine.world), the
    CLI and tests make one up."""

    rank: int = 0
    size: int = 1
    groups: Mapping[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)

    def at(self, rank: int) -> WorldLayout:
        return replace(self, rank=rank)

    def members(self, group: str, rank: int | None = None) -> tuple[int, ...]:
        """The ranks of `rank`'s copy of process group `group`."""
        rank = self.rank if rank is None else rank
        if self.size == 1 and group not in self.groups:
            return (0,)  # one process is its own group
        for members in self.groups.get(group, ()):
            if rank in members:
                return members
        if group not in self.groups:
            raise SpecError(
                f"sharing 'per_group' names group {group!r}, but CheckpointManager got no such "
                f"group; pass groups={{{group!r}: process_group}}"
            )
        raise SpecError(f"rank {rank} is in no {group!r} group; every rank must belong to one")

    def group_id(self, group: str, rank: int | None = None) -> str:
        """A stable id of `rank`'s copy of `group` (its lowest global rank): its directory."""
        return f"group_{min(self.members(group, rank)):05d}"

    def group_ids(self, group: str) -> list[str]:
        """The ids of every copy of `group`."""
        copies = self.groups.get(group, ((0,),) if self.size == 1 else ())
        return sorted(f"group_{min(m):05d}" for m in copies)


@dataclass(frozen=True)
class Task:
    """One component's save on one rank, fully decided."""

    component: str
    kind: Kind
    sharing: Sharing
    format: Format
    layout: Layout
    takes_part: bool  # this rank runs the layout's save (a collective member, or a writer)
    leader: bool  # this rank writes the component's shared files
    collective: str | None  # None: this rank alone; WORLD; or a named group
    directory: str  # relative to the checkpoint
    files: tuple[str, ...]  # what this rank writes; globs where DCP names the files
    codec: str = "none"
    max_shard_size: int | None = None
    validate: bool = False
    nbytes: int | None = None  # tensor bytes this rank holds, when live objects were measured

    @property
    def required_files(self) -> tuple[str, ...]:
        """Files that must exist once this task ran (DCP data files exist only where DCP
        gave the rank items, so they are predicted as globs that may match nothing)."""
        return tuple(f for f in self.files if "*" not in f)


@dataclass(frozen=True)
class RankPlan:
    """Every component's task on one rank: what save executes."""

    storage: str
    world: WorldLayout
    tasks: tuple[Task, ...]
    store: StoreCapabilities | None = None  # what kind of store `storage` is, where known
    io: IOPolicy | None = None  # how it is written and read (engine/io_policy.py)

    def task(self, name: str) -> Task:
        return next(t for t in self.tasks if t.component == name)

    def render(self) -> str:
        """One line per component: who writes what, where, how (what `statereg plan` prints)."""
        header = ("component", "layout", "sharing", "collective", "role", "bytes", "files")
        rows = [header]
        for t in self.tasks:
            role = ("leader" if t.leader else "member") if t.takes_part else "-"
            collective = t.collective or "alone"
            shown = "-" if t.nbytes is None or not t.takes_part else format_bytes(t.nbytes)
            files = " ".join(t.files) or "(writes nothing)"
            rows.append((t.component, f"{t.layout}/{t.format}", t.sharing, collective, role,
                         shown, files))
        lines = [f"rank {self.world.rank} of {self.world.size}"]
        return "\n".join(lines + format_table(rows))


def render_job(plans: list[RankPlan]) -> str:
    """Every rank's plan (what `statereg plan` prints without --rank)."""
    first = plans[0]
    lines = [f"storage:    {first.storage}"]
    if first.store is not None and first.io is not None:
        lines += [f"store:      {first.store.describe()}", f"I/O:        {first.io.describe()}"]
    lines += [
        f"world size: {first.world.size}",
        "layout:     <storage>/step_XXXXXXXX/<files below>  then manifest.json, then latest",
        "",
    ]
    for plan in plans:
        lines += [plan.render(), ""]
    return "\n".join(lines).rstrip()


def _codec(spec: RegistrySpec) -> str:
    declared = spec.storage.compression
    if declared is None or declared.codec == "none":
        return "none"
    return "zstd+planes" if declared.float_aware else "zstd"


def _safetensors_files(directory: str, sizes: list[tuple[str, int]] | None,
                       max_shard: int) -> tuple[str, ...]:
    if sizes is None:  # not measured: the count is unknown until the model is
        files = [f"{directory}/model-*-of-*.safetensors"]
    else:
        count = max(1, len(group_by_size(sizes, max_shard)))
        files = [f"{directory}/{shard_file_name(i, count)}" for i in range(1, count + 1)]
    return (*files, f"{directory}/{SAFETENSORS_INDEX_NAME}")


def compile_task(name: str, comp: ComponentSpec, spec: RegistrySpec, world: WorldLayout,
                 sizes: list[tuple[str, int]] | None = None) -> Task:
    """The task of component `name` on `world.rank`; `sizes`: (tensor name, bytes) measured
    from the live object, when there is one."""
    sharing, fmt, rank = comp.resolved_sharing, comp.resolved_format, world.rank
    layout = layout_of(comp.kind, fmt)
    # The collective and this rank's place in it, by sharing pattern.
    if sharing == "per_group":
        members = world.members(comp.group or "", rank)
        collective, place = comp.group, members.index(rank)
        directory = f"{name}/{world.group_id(comp.group or '', rank)}"
    elif sharing == "per_rank":
        collective, place, directory = None, 0, name
    elif sharing == "global" and layout != "consolidated":
        # One copy: rank 0's, written by rank 0 alone.
        collective, place, directory = (None, 0, name) if rank == 0 else (None, -1, name)
    else:  # sharded, replicated; consolidated global gathers over the world too
        collective, place, directory = WORLD, rank, name
    if world.size == 1 and collective == WORLD:
        collective = None
    takes_part = place >= 0
    leader = place == 0
    max_shard = (parse_size(comp.max_shard_size or DEFAULT_MAX_SHARD_SIZE)
                 if fmt == "safetensors" else None)
    files: tuple[str, ...] = ()
    if layout == "dcp":
        if sharing == "per_rank":  # each rank its own DCP checkpoint, in its own directory
            directory = f"{name}/rank_{rank:05d}"
        files = (f"{directory}/{dcp_data_files(place)}",)
        if leader:
            files += (f"{directory}/{DCP_METADATA_NAME}",)
            if comp.kind == "optimizer":
                files += (f"{directory}/{SIDECAR_NAME}",)
    elif layout == "consolidated":
        if leader:
            files = (_safetensors_files(directory, sizes, max_shard or 0)
                     if fmt == "safetensors" else (f"{directory}/{TORCH_MODEL_NAME}",))
    else:
        if sharing == "per_rank":
            files = (f"{directory}/{rank_file(rank, fmt)}",)
            takes_part = leader = True
        elif leader:
            files = (f"{directory}/{STATE_STEM}{object_suffix(fmt)}",)
        takes_part = takes_part and leader  # object state: only the writer takes part
    return Task(
        component=name, kind=comp.kind, sharing=sharing, format=fmt, layout=layout,
        takes_part=takes_part, leader=leader, collective=collective,
        directory=directory, files=files if takes_part else (),
        codec=_codec(spec) if layout == "dcp" else "none",
        max_shard_size=max_shard,
        validate=comp.validate_replicas,
        nbytes=None if sizes is None else _bytes_written(sum(n for _, n in sizes), layout,
                                                           sharing, world, comp.group),
    )


def _bytes_written(total: int, layout: Layout, sharing: str, world: WorldLayout,
                   group: str | None) -> int:
    """What one rank writes of a component's `total` tensor bytes: DCP spreads shards and
    replicas over the ranks of the collective (each item is written once)."""
    if layout != "dcp" or sharing not in ("sharded", "replicated", "per_group"):
        return total
    ranks = len(world.members(group or "")) if sharing == "per_group" else world.size
    return -(-total // ranks)


def compile_plan(spec: RegistrySpec, world: WorldLayout, storage: str | None = None,
                 sizes: Mapping[str, list[tuple[str, int]]] | None = None,
                 store: StoreCapabilities | None = None) -> RankPlan:
    """The plan of `world.rank`. `sizes`: per component, the (tensor, bytes) this rank holds,
    so the plan can name safetensors files and say how much each rank writes. `store`: what
    kind of store the root is (`StorageBackend.capabilities`), from which the plan's I/O
    policy is derived."""
    sizes = sizes or {}
    return RankPlan(
        storage=storage or spec.storage.url,
        world=world,
        tasks=tuple(compile_task(n, c, spec, world, sizes.get(n))
                    for n, c in spec.components.items()),
        store=store,
        io=None if store is None else storage_policy(store, spec.storage),
    )


def compile_job(spec: RegistrySpec, world: WorldLayout, storage: str | None = None,
                sizes: Mapping[str, list[tuple[str, int]]] | None = None,
                store: StoreCapabilities | None = None) -> list[RankPlan]:
    """Every rank's plan (for `statereg plan` and tests; a live rank compiles only its own)."""
    return [compile_plan(spec, world.at(r), storage, sizes, store) for r in range(world.size)]


def unpredicted(files: list[str], plans: list[RankPlan]) -> tuple[list[str], list[str]]:
    """(files no task predicted, predicted required files that are missing)."""
    predicted = [f for p in plans for t in p.tasks for f in t.files]
    extra = [f for f in files if not any(fnmatch.fnmatchcase(f, g) for g in predicted)]
    present = set(files)
    missing = sorted({f for p in plans for t in p.tasks for f in t.required_files
                      if f not in present})
    return extra, missing


def check_live_sharing(name: str, comp: ComponentSpec, sharded_keys: list[str]) -> None:
    """A component declared global, replicated or per_rank whose tensors are sharded across
    ranks would save some shards only: refuse it at construction, before any collective."""
    sharing = comp.resolved_sharing
    # per_group is fine: DCP saves a group's shards over the group's own collective.
    if sharing in ("global", "replicated", "per_rank") and sharded_keys and \
            comp.resolved_format == "dcp":
        shown = ", ".join(sharded_keys[:3]) + (" ..." if len(sharded_keys) > 3 else "")
        raise SpecError(
            f"component {name!r} is declared sharing: {sharing}, but its tensors are split "
            f"across ranks (DTensor shards, e.g. {shown}); saving it so would keep only some "
            f"shards: declare sharing: sharded (components.{name}.sharing)"
        )


# -- load ---------------------------------------------------------------------------------------

Policy = Literal["same", "reset", "reshard"]


@dataclass(frozen=True)
class Saved:
    """What the manifest records of one component: how it was saved."""

    kind: Kind
    sharing: Sharing
    format: Format
    world_size: int
    files: tuple[str, ...]

    def group_ids(self, name: str) -> list[str]:
        return sorted({p.split("/")[1] for p in self.files if p.startswith(f"{name}/group_")})


@dataclass(frozen=True)
class LoadTask:
    """One component's load on one rank: where to read, over which collective, how."""

    component: str
    layout: Layout
    format: Format
    collective: str | None
    directory: str  # relative to the checkpoint
    state_files: tuple[str, ...] = ()  # object_file: the file(s) this rank reads
    policy: Policy = "same"
    saved_world_size: int = 1


# Sharing patterns whose stored bytes are interchangeable: one logical copy of every tensor
# (DCP reshards between them; a consolidated model or an object file is one full copy).
_ONE_COPY = frozenset({"global", "replicated", "sharded"})


def _mismatch(name: str, saved: Saved, comp: ComponentSpec, why: str) -> str:
    return (f"component {name!r}: saved as sharing {saved.sharing}, format {saved.format} on "
            f"{saved.world_size} rank(s); declared sharing {comp.resolved_sharing}, format "
            f"{comp.resolved_format}: {why}")


def compile_load_task(name: str, comp: ComponentSpec, saved: Saved, world: WorldLayout,
                      ) -> LoadTask:
    """The load of one component on `world.rank`, or CheckpointMismatchError saying why not.

    Supported conversions, all explicit here: among global / replicated / sharded (one copy
    of the state: DCP reshards, whole files are read by every rank); any format the
    component's kind can be stored in (the manifest says how to read it); per_rank at another
    world size by the declared on_world_size_change policy; per_group when every group copy
    still has its group. Everything else is refused, naming what was saved and declared.
    """
    declared = comp.resolved_sharing
    if saved.kind != comp.kind:
        raise CheckpointMismatchError(_mismatch(
            name, saved, comp, f"it holds a {saved.kind}, declared a {comp.kind}; load it into "
            "a component of the same kind, or exclude it"))
    same_family = saved.sharing == declared or {saved.sharing, declared} <= _ONE_COPY
    if not same_family:
        raise CheckpointMismatchError(_mismatch(
            name, saved, comp, "one copy and per-rank or per-group copies do not convert "
            f"into each other; declare sharing: {saved.sharing} to load it, or exclude it"))
    layout = layout_of(saved.kind, saved.format)
    rank, size = world.rank, world.size
    if saved.sharing == "per_group":
        group = comp.group or ""
        current = world.group_ids(group)
        stored = saved.group_ids(name)
        if stored != current:
            raise CheckpointMismatchError(_mismatch(
                name, saved, comp, f"group {group!r}: it holds {len(stored)} group copies "
                f"({', '.join(stored)}) saved on {saved.world_size} ranks; "
                f"this job has {len(current)} {group!r} groups ({', '.join(current)}) on "
                f"{size} ranks (checkpoint={saved.world_size}, current={size}). A copy belongs "
                "to the group whose lowest rank saved it: build the same groups (e.g. the same "
                "pipeline stages), or exclude the component (see docs/distributed.md)"))
        directory = f"{name}/{world.group_id(group)}"
        state = (f"{directory}/{STATE_STEM}{object_suffix(saved.format)}",)
        return LoadTask(name, layout, saved.format, group if size > 1 else None, directory,
                        state if layout == "object_file" else (),
                        saved_world_size=saved.world_size)
    if saved.sharing == "per_rank":
        policy: Policy = "same"
        if saved.world_size != size:
            declared_policy = comp.on_world_size_change
            if declared_policy == "error":
                raise CheckpointMismatchError(_mismatch(
                    name, saved, comp, f"it holds per-rank state of {saved.world_size} ranks, "
                    f"this job has {size} (checkpoint={saved.world_size}, current={size}): the "
                    f"world size changed. Resume with {saved.world_size} ranks, exclude the "
                    "component, or declare on_world_size_change: reset | reshard "
                    "(see docs/distributed.md)"))
            policy = "reset" if declared_policy == "reset" else "reshard"
        if layout == "dcp":
            directory = f"{name}/rank_{rank:05d}"
            if not any(p.startswith(f"{name}/rank_") for p in saved.files):
                directory = name  # written before per-rank DCP directories (format 1.1)
            return LoadTask(name, layout, saved.format, None, directory, policy=policy,
                            saved_world_size=saved.world_size)
        readers = range(saved.world_size) if policy == "reshard" else [rank]
        files = tuple(f"{name}/{rank_file(r, saved.format)}" for r in readers)
        return LoadTask(name, layout, saved.format, None, name, files, policy,
                        saved.world_size)
    # One copy: every rank reads it (DCP over the world, so each reads only what it needs).
    state = (f"{name}/{STATE_STEM}{object_suffix(saved.format)}",)
    return LoadTask(name, layout, saved.format, WORLD if size > 1 else None, name,
                    state if layout == "object_file" else (), saved_world_size=saved.world_size)


def compile_load(spec: RegistrySpec, saved: Mapping[str, Saved], names: list[str],
                 world: WorldLayout, where: str) -> dict[str, LoadTask]:
    """Every selected component's load task; all mismatches are reported at once."""
    tasks: dict[str, LoadTask] = {}
    problems: list[str] = []
    for name in names:
        try:
            tasks[name] = compile_load_task(name, spec.components[name], saved[name], world)
        except (CheckpointMismatchError, SpecError) as exc:
            problems.append(str(exc))
    if problems:
        raise CheckpointMismatchError(
            f"{where} does not fit this job's declaration:\n  " + "\n  ".join(problems))
    return tasks
