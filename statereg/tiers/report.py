"""What `statereg plan` and `statereg ls` say about tiers: the memory math and where each step
lives (docs/tiers.md, docs/cli.md).

Torch-free, like the commands that print it: plan and ls answer in well under a second.
The folder names and the small-files allowance come from tiers/identity.py, as the tier
engine's do, so the CLI and the engine name the same memory folder and do the same math.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from statereg.backends.base import StorageBackend
from statereg.backends.registry import open_backend
from statereg.backends.shm import SharedMemoryBackend, free_bytes, node_dir, shm_dir, used_bytes
from statereg.engine.checkpoints import read_manifest_at, scan_root, step_of
from statereg.engine.plan import RankPlan
from statereg.engine.report import format_bytes, format_table
from statereg.errors import CheckpointNotFoundError, CorruptCheckpointError, ManifestError
from statereg.schemas.spec import RegistrySpec
from statereg.tiers.identity import IDENTITY_NAME, SMALL_FILES_BYTES, run_url

# -- the memory math (statereg plan) --------------------------------------------------------


@dataclass(frozen=True)
class MemoryMath:
    """Bytes the memory tier takes on the fullest node, and the tmpfs where plan runs."""

    keep_last: int
    state: int | None  # one checkpoint of the node's ranks; None: not measured
    measured: tuple[str, ...]  # components whose bytes are in `state` (all: --state-bytes)
    unmeasured: tuple[str, ...]  # components with tensors whose bytes are unknown
    replica: str  # "not declared", or what the replica declaration says
    replica_state: int | None  # one checkpoint of the peer node's ranks held here
    shm_path: str
    free: int | None  # None: the shared-memory folder does not exist here
    held: int  # bytes this run's memory folder already holds on this node (reused)

    @property
    def copies(self) -> int:
        """keep_last complete checkpoints plus the one being written."""
        return self.keep_last + 1

    @property
    def own(self) -> int | None:
        return None if self.state is None else self.copies * self.state

    @property
    def total(self) -> int | None:
        if self.own is None:
            return None
        return self.own + self.copies * (self.replica_state or 0)


def _node_of(rank: int, world_size: int, nodes: int) -> int:
    """Ranks fill nodes in order, world_size / nodes each (as torchrun places them)."""
    return rank * nodes // world_size


def memory_math(spec: RegistrySpec, plans: list[RankPlan], nodes: int = 1,
                state_bytes: int | None = None) -> MemoryMath:
    """The memory math of `spec` over `plans` placed on `nodes` nodes. `state_bytes`, when
    given, is one checkpoint of the whole job's state and overrides what plans measured."""
    assert spec.tiers is not None
    memory = spec.tiers.memory
    world_size = len(plans)
    tensor_tasks = [t for t in plans[0].tasks if t.layout != "object_file"]
    measured = sorted({t.component for p in plans for t in p.tasks
                       if t.takes_part and t.nbytes is not None})
    unmeasured = sorted({t.component for t in tensor_tasks} - set(measured))
    per_node = [0] * nodes
    if state_bytes is not None:
        per_node = [state_bytes // nodes] * nodes
        measured, unmeasured = ["--state-bytes"], []
    else:
        for plan in plans:
            mine = sum(t.nbytes or 0 for t in plan.tasks if t.takes_part)
            per_node[_node_of(plan.world.rank, world_size, nodes)] += mine
    fullest = max(range(nodes), key=lambda n: per_node[n])
    known = bool(measured)
    state = per_node[fullest] + SMALL_FILES_BYTES if known else None
    declared = getattr(memory, "replicate", None)
    if declared is None:
        replica, replica_state = "not declared", None
    else:
        fields = declared.model_dump() if hasattr(declared, "model_dump") else {}
        replica = ", ".join(f"{k}: {v}" for k, v in fields.items()) or "declared"
        peer = (fullest - 1) % nodes
        replica_state = (per_node[peer] + SMALL_FILES_BYTES if known else None) \
            if nodes > 1 else None
        if nodes == 1:
            replica += " (one node: no peer to hold it; give --nodes)"
    base = shm_dir()
    folder = os.path.join(node_dir(), run_url(spec)[len("shm://"):].strip("/"))
    held = used_bytes(folder)
    free = free_bytes(base) if os.path.isdir(base) else None
    return MemoryMath(memory.keep_last, state, tuple(measured), tuple(unmeasured), replica,
                      replica_state, base, free, held)


def render_tiers(spec: RegistrySpec, math: MemoryMath, nodes: int) -> str:
    """The tiers block of `statereg plan`: cadence and retention of each tier, then the
    memory math of the fullest node against the tmpfs of the machine plan runs on."""
    assert spec.tiers is not None
    memory, durable = spec.tiers.memory, spec.tiers.durable
    keep = f"keep_last {durable.keep_last}" if durable.keep_last else "keep all"
    if durable.keep_every:
        keep += f", keep_every {durable.keep_every}"
    lines = [
        "tiers:",
        f"  memory:   {memory.url} = {run_url(spec)}  every {memory.every} steps, "
        f"keep_last {memory.keep_last}, drain: {memory.drain}",
        f"  durable:  {spec.storage.url}  every {durable.every} steps, {keep}",
        f"  restore:  {spec.restore}",
        "",
        f"memory per node ({nodes} node{'s' if nodes > 1 else ''}"
        f"{'; the fullest' if nodes > 1 else ''}):",
    ]
    if math.state is None:
        lines.append("  one checkpoint:  not measured: give --model MODULE:CALLABLE for the "
                     "model, or --state-bytes SIZE for the whole state")
    else:
        source = "--state-bytes" if math.measured == ("--state-bytes",) else \
            f"measured: {', '.join(math.measured)}"
        lines.append(f"  one checkpoint:  {format_bytes(math.state)} = "
                     f"{format_bytes(math.state - SMALL_FILES_BYTES)} ({source}) + "
                     f"{format_bytes(SMALL_FILES_BYTES)} for small files")
        if math.unmeasured:
            lines.append(f"                   not counted: {', '.join(math.unmeasured)} "
                         "(not measured; --state-bytes gives the whole state)")
        lines.append(f"  memory tier:     (keep_last {math.keep_last} + 1) x "
                     f"{format_bytes(math.state)} = {format_bytes(math.own or 0)}")
    if math.replica_state is None:
        lines.append(f"  peer replica:    {math.replica}")
    else:
        lines.append(f"  peer replica:    (keep_last {math.keep_last} + 1) x "
                     f"{format_bytes(math.replica_state)} = "
                     f"{format_bytes(math.copies * math.replica_state)} ({math.replica})")
    if math.total is not None:
        lines.append(f"  total per node:  {format_bytes(math.total)}")
    if math.free is None:
        lines.append(f"  tmpfs here:      {math.shm_path} does not exist on this machine")
    else:
        room = math.free + math.held
        verdict = "" if math.total is None else (
            ": fits" if math.total <= room else
            f": does NOT fit (short by {format_bytes(math.total - room)}); a manager on "
            "this machine refuses at construction")
        lines.append(f"  tmpfs here:      {math.shm_path} has {format_bytes(math.free)} free "
                     f"+ {format_bytes(math.held)} held by this run{verdict}")
    return "\n".join(lines)


# -- where each step lives (statereg ls) ----------------------------------------------------


COMMITTED, INCOMPLETE, DAMAGED, ABSENT = "committed", "incomplete", "damaged", "absent"


def memory_roots(url: str) -> list[StorageBackend]:
    """The memory roots under `url` (shm://NAME): one per job identity folder it holds
    (`ws<N>-<digest>` with an identity.json), or `url` itself when it holds checkpoints."""
    base = open_backend(url)
    names = base.list_dir("")
    if any(step_of(n) is not None for n in names):
        return [base]
    return [open_backend(f"{url.rstrip('/')}/{n}") for n in sorted(names)
            if n.startswith("ws") and base.exists(f"{n}/{IDENTITY_NAME}")]


def memory_state(backend: StorageBackend, name: str) -> str:
    """committed (manifest matches manifest.sum, every file present at its recorded size:
    what restore would use), damaged, incomplete (no manifest yet) or absent."""
    if not backend.exists(name):
        return ABSENT
    try:
        manifest = read_manifest_at(backend, name)
    except CheckpointNotFoundError:
        return INCOMPLETE
    except (ManifestError, CorruptCheckpointError):
        return DAMAGED
    sizes = {f.path: f.size for f in backend.walk(name)}
    if any(sizes.get(f"{name}/{r.path}") != r.size for r in manifest.files):
        return DAMAGED
    return COMMITTED


@dataclass(frozen=True)
class StepRow:
    step: int
    memory: tuple[str, ...]  # one state per memory root
    durable: str
    size: int | None


def step_locations(durable: StorageBackend, memories: list[StorageBackend]) -> list[StepRow]:
    """Every step found in any tier, oldest first, with its state in each tier."""
    scan = scan_root(durable)
    committed = {c.step: c for c in scan.committed}
    damaged = {step_of(n) for n in scan.unreadable}
    durable_steps = {s for s in map(step_of, durable.list_dir("")) if s is not None}
    memory_steps = [{s for s in map(step_of, m.list_dir("")) if s is not None} for m in memories]
    rows = []
    for step in sorted(durable_steps.union(*memory_steps)):
        name = f"step_{step:08d}"
        states = tuple(memory_state(m, name) if step in found else ABSENT
                       for m, found in zip(memories, memory_steps, strict=True))
        if step in committed:
            state, size = COMMITTED, committed[step].manifest.total_bytes
        else:
            state = DAMAGED if step in damaged else INCOMPLETE if step in durable_steps \
                else ABSENT
            size = None
            if COMMITTED in states:
                memory = memories[states.index(COMMITTED)]
                size = read_manifest_at(memory, name).total_bytes
        rows.append(StepRow(step, states, state, size))
    return rows


def render_locations(durable: StorageBackend, memories: list[StorageBackend],
                     memory_url: str) -> str:
    """The table of `statereg ls` with tiers: one row per step, a column per tier."""
    lines = []
    for m in memories:
        where = f" ({m.root})" if isinstance(m, SharedMemoryBackend) else ""
        lines.append(f"memory (this node): {m.url}{where}")
    if not memories:
        lines.append(f"memory (this node): no memory checkpoints under {memory_url}")
    lines += [f"durable:            {durable.url}", ""]
    rows = step_locations(durable, memories)
    if not rows:
        lines.append("no checkpoints in any tier")
        return "\n".join(lines)
    heads = ["memory"] if len(memories) == 1 else [
        f"memory {m.url.rstrip('/').rpartition('/')[2]}" for m in memories]
    table = [("step", *heads, "durable", "size")]
    for row in rows:
        size = "-" if row.size is None else format_bytes(row.size)
        table.append((str(row.step), *row.memory, row.durable, size))
    return "\n".join(lines + format_table(table))


def memory_url_for(spec: RegistrySpec | None, given: str | None) -> str | None:
    """The memory root ls shows: --memory as given, else the declaration's run folder."""
    if given:
        return given
    if spec is not None and spec.tiers is not None:
        return run_url(spec)
    return None
