"""Compile a declaration and a world size into a CheckpointPlan: who writes what, where, how.

The plan is plain data (printable by `statereg plan`); save and load only execute it.
Torch-free, so the CLI can print plans without starting a job.
"""

from __future__ import annotations

from dataclasses import dataclass

from statereg.engine.report import format_bytes, format_table
from statereg.schemas.spec import (
    DEFAULT_MAX_SHARD_SIZE,
    Format,
    Kind,
    RegistrySpec,
    Sharing,
    parse_size,
)

# Files inside a component directory.
DCP_EXTRA_NAME = "extra.json"
STATE_STEM = "state"
# format: torch keeps a model's full state dict in one file; safetensors use the HF names.
TORCH_MODEL_NAME = "model.pt"
SAFETENSORS_FILES = ("model-<i>-of-<n>.safetensors", "model.safetensors.index.json")


def _suffix(fmt: Format) -> str:
    return ".pt" if fmt == "torch" else ".json"


def rank_file(rank: int, fmt: Format = "json") -> str:
    return f"rank_{rank:05d}{_suffix(fmt)}"


@dataclass(frozen=True)
class ComponentPlan:
    """How one component is written: by which ranks, in which format, under which directory."""

    name: str
    kind: Kind
    sharing: Sharing
    format: Format
    writers: tuple[int, ...]
    files: tuple[str, ...]
    group: str | None = None
    validate: bool = False
    on_world_size_change: str = "error"
    nbytes: int | None = None  # total tensor bytes, when a live object was measured
    max_shard_size: int | None = None  # format safetensors: the largest file, in bytes

    def bytes_per_writer(self, world_size: int) -> int | None:
        """Bytes each writing rank writes: shards and replicas spread evenly over the ranks."""
        if self.nbytes is None:
            return None
        spread = self.sharing in ("sharded", "replicated") and self.format == "dcp"
        return -(-self.nbytes // world_size) if spread else self.nbytes

    def directory(self, group_id: str | None = None) -> str:
        """Where this component's files go: its own directory, per group for per_group."""
        return f"{self.name}/{group_id}" if self.sharing == "per_group" else self.name

    def state_file(self, rank: int, group_id: str | None = None) -> str:
        """Path (relative to the checkpoint) of this component's json or torch state file, as
        seen by `rank`: `state.json`, `rank_00003.json` (`.pt` for format torch)."""
        name = (rank_file(rank, self.format) if self.sharing == "per_rank"
                else STATE_STEM + _suffix(self.format))
        return f"{self.directory(group_id)}/{name}"


@dataclass(frozen=True)
class CheckpointPlan:
    """The compiled declaration for one world size."""

    storage: str
    world_size: int
    components: tuple[ComponentPlan, ...]

    def component(self, name: str) -> ComponentPlan:
        return next(c for c in self.components if c.name == name)

    def render(self) -> str:
        """A table a person can read: one line per component."""
        header = ("component", "kind", "sharing", "format", "written by", "bytes/writer",
                  "files")
        rows = [header]
        for c in self.components:
            if c.sharing == "per_group":
                who = f"rank 0 of each {c.group!r} group"
            elif len(c.writers) == self.world_size and self.world_size > 1:
                who = "every rank"
            else:
                who = ", ".join(f"rank {r}" for r in c.writers)
            per_writer = c.bytes_per_writer(self.world_size)
            shown = "-" if per_writer is None else format_bytes(per_writer)
            rows.append((c.name, c.kind, c.sharing, c.format, who, shown, " ".join(c.files)))
        lines = [
            f"storage:    {self.storage}",
            f"world size: {self.world_size}",
            "layout:     <storage>/step_XXXXXXXX/<component>/...  then manifest.json, then latest",
            "",
        ]
        lines += format_table(rows)
        return "\n".join(lines)


def _component_plan(name: str, spec: RegistrySpec, world_size: int, nbytes: int | None,
                    ) -> ComponentPlan:
    comp = spec.components[name]
    sharing, fmt = comp.resolved_sharing, comp.resolved_format
    every_rank = tuple(range(world_size))
    where = f"{name}/group_<lowest rank>" if sharing == "per_group" else name
    if fmt == "dcp":
        # DCP spreads replicated tensors over the ranks, one copy each; global is rank 0's.
        writers = (0,) if sharing == "global" else every_rank
        files = [f"{where}/__<rank>_<n>.distcp", f"{where}/.metadata"]
        if comp.kind == "optimizer":
            files.append(f"{where}/{DCP_EXTRA_NAME}")
    elif comp.kind == "model":
        # safetensors / torch: every rank sends its shards, rank 0 writes full tensors.
        writers = (0,) if sharing == "global" else every_rank
        names = SAFETENSORS_FILES if fmt == "safetensors" else (TORCH_MODEL_NAME,)
        files = [f"{name}/{file}" for file in names]
    elif sharing == "per_rank":
        writers, files = every_rank, [f"{name}/rank_<rank>{_suffix(fmt)}"]
    else:
        writers, files = (0,), [f"{where}/{STATE_STEM}{_suffix(fmt)}"]
    max_shard = comp.max_shard_size or DEFAULT_MAX_SHARD_SIZE
    return ComponentPlan(name, comp.kind, sharing, fmt, writers, tuple(files), comp.group,
                         comp.validate_replicas, comp.on_world_size_change, nbytes,
                         parse_size(max_shard) if fmt == "safetensors" else None)


def compile_plan(spec: RegistrySpec, world_size: int = 1, storage: str | None = None,
                 nbytes: dict[str, int] | None = None) -> CheckpointPlan:
    """The plan for `spec` on `world_size` ranks.

    `storage` is the URL to show (never options); `nbytes` gives measured tensor bytes of
    components, so the plan can say how much each writing rank writes.
    """
    sizes = nbytes or {}
    return CheckpointPlan(
        storage=storage or spec.storage.url,
        world_size=world_size,
        components=tuple(_component_plan(n, spec, world_size, sizes.get(n))
                         for n in spec.components),
    )
