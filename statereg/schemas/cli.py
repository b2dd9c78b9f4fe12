"""The JSON documents `statereg ... --json` prints: one per command, its keys stable.

Schedulers, evaluation pipelines and dashboards read these instead of scraping tables;
`statereg schema cli` prints their JSON Schema (statereg/schemas/cli.schema.json). Every
document but `inspect`'s names its command in `command`; `inspect --json` prints the
checkpoint's manifest itself (`statereg schema manifest`), as it did before the others.
Adding a key is compatible; renaming or removing one is not.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from statereg.schemas.manifest import Manifest


class _Document(BaseModel):
    # Every key is always printed, so the schema lists defaulted ones as required too.
    model_config = ConfigDict(extra="forbid", frozen=True,
                              json_schema_serialization_defaults_required=True)


class CheckpointEntry(_Document):
    """One committed checkpoint, as `ls` lists it."""

    name: str = Field(description="Its directory under the root, e.g. 'step_00000100'.")
    url: str = Field(description="The checkpoint's URL: what inspect, verify and load take.")
    step: int
    tokens_seen: int | None
    bytes: int = Field(description="Bytes of its own files, as stored.")
    created_at: str = Field(description="UTC time it was committed (ISO 8601).")
    extra: dict[str, Any] = Field(description="What save(extra=...) recorded, e.g. eval loss.")
    components: list[str]
    latest: bool = Field(description="Whether the root's `latest` pointer names it.")


class StepLocation(_Document):
    """With tiers: where one step lives."""

    step: int
    memory: list[Literal["committed", "incomplete", "damaged", "absent"]] = Field(
        description="Its state in each memory root of `memory.roots`, in that order.")
    durable: Literal["committed", "incomplete", "damaged", "absent"]
    bytes: int | None = Field(description="Bytes of a committed copy; null without one.")


class MemoryTiers(_Document):
    """With tiers (`--spec` declaring them, or `--memory`): this node's memory roots."""

    url: str = Field(description="The memory root asked for (a run folder or one identity).")
    roots: list[str] = Field(description="The memory roots found under it, one per job "
                             "identity.")
    steps: list[StepLocation]


class LsOutput(_Document):
    """`statereg ls --json ROOT`: the committed checkpoints, oldest step first."""

    command: Literal["ls"] = "ls"
    root: str
    latest: str | None = Field(description="The name the `latest` pointer holds, if any.")
    checkpoints: list[CheckpointEntry] = Field(
        description="Intact committed checkpoints; damaged ones are left out (a warning on "
        "stderr names each).")
    memory: MemoryTiers | None = Field(default=None, description="With tiers only.")


class VerifiedCheckpoint(_Document):
    """One checkpoint `verify` read in full."""

    name: str
    url: str
    step: int | None = Field(description="null when the directory name holds no step.")
    status: Literal["ok", "damaged"]
    files: int | None = Field(description="Files checked (own and referenced); null when "
                              "the manifest itself is damaged.")
    bytes: int | None
    error: str | None = Field(description="Why it is damaged: the file and what differs.")


class VerifyOutput(_Document):
    """`statereg verify --json URL|ROOT`: every size and checksum recomputed."""

    command: Literal["verify"] = "verify"
    target: str = Field(description="The checkpoint or root given.")
    ok: bool = Field(description="True when every checkpoint checked is intact (exit 0).")
    checkpoints: list[VerifiedCheckpoint] = Field(description="Oldest step first.")
    damaged: list[str] = Field(description="Names of the damaged ones (exit 1 if any).")


class TaskEntry(_Document):
    """One component's save on one rank."""

    component: str
    kind: str
    sharing: str
    format: str
    layout: str
    collective: str | None = Field(description="null: the rank alone; 'world' or a group.")
    role: Literal["leader", "member"] | None = Field(
        description="leader writes the shared files; null when the rank takes no part.")
    directory: str = Field(description="Relative to the checkpoint directory.")
    files: list[str] = Field(description="What the rank writes; globs where DCP numbers them.")
    codec: str
    bytes: int | None = Field(description="Tensor bytes the rank writes, with --model.")


class RankEntry(_Document):
    rank: int
    tasks: list[TaskEntry]


class StoreEntry(_Document):
    """What kind of store the root is: facts its I/O policy is derived from."""

    medium: Literal["node-memory", "process-memory", "local-disk", "object-store",
                    "filesystem"]
    latency: Literal["memory", "disk", "network", "unknown"]
    page_cache: bool = Field(description="Writes can go around this node's page cache.")


class IOPolicyEntry(_Document):
    """How saves and loads use the store (docs/design.md, "I/O policy")."""

    write_threads: int = Field(description="Files each rank writes at once per component.")
    read_threads: int = Field(description="Files each rank reads at once.")
    parallel_components: bool = Field(
        description="Whether a save writes its components' files at the same time.")
    broadcast_reads: bool = Field(
        description="Whether one rank reads bytes several need and broadcasts them.")
    record_crcs: bool = Field(description="Whether tensor records carry zip CRC-32s.")
    write_around_cache: bool = Field(
        description="Whether tensor files are written around the page cache (O_DIRECT).")


class PlanOutput(_Document):
    """`statereg plan --json statereg.yaml`: the plan each rank runs."""

    command: Literal["plan"] = "plan"
    storage: str
    store: StoreEntry
    io: IOPolicyEntry = Field(description="The I/O policy derived for this store and "
                              "declaration.")
    world_size: int
    ranks: list[RankEntry] = Field(description="Every rank, or only --rank's.")


class LeftoverEntry(_Document):
    path: str = Field(description="Relative to the root.")
    kind: str
    size: int
    age_s: float | None
    action: str = Field(description="'delete' (dry run), 'deleted', 'keep: why' or "
                        "'failed: why'.")
    deletable: bool


class GcOutput(_Document):
    """`statereg gc --json ROOT`: what interrupted saves left, and what happened to it."""

    command: Literal["gc"] = "gc"
    root: str
    delete: bool = Field(description="False for a dry run.")
    grace_s: float
    leftovers: list[LeftoverEntry]
    deletable_bytes: int
    failed: list[str] = Field(description="Paths whose deletion failed (exit 1 if any).")


class CpOutput(_Document):
    """`statereg cp --json SRC DST`: the committed copy."""

    command: Literal["cp"] = "cp"
    source: str
    destination: str = Field(description="The copy's checkpoint URL.")
    files: int
    bytes: int
    seconds: float
    compression: Literal["keep", "zstd", "zstd-plain", "none"]


COMMAND_DOCUMENTS: dict[str, type[BaseModel]] = {
    "ls": LsOutput, "inspect": Manifest, "verify": VerifyOutput, "plan": PlanOutput,
    "gc": GcOutput, "cp": CpOutput,
}


def cli_json_schema() -> dict[str, Any]:
    """One schema for every command's document: `anyOf` over them, each under `$defs`
    by its model name, with the command each belongs to in `x-statereg-commands`."""
    from pydantic.json_schema import models_json_schema

    mode: Literal["serialization"] = "serialization"  # what the commands print
    keys = [(model, mode) for model in COMMAND_DOCUMENTS.values()]
    refs, schema = models_json_schema(keys, ref_template="#/$defs/{model}")
    schema["anyOf"] = [refs[(model, mode)] for model in COMMAND_DOCUMENTS.values()]
    schema["title"] = "statereg CLI --json documents"
    schema["description"] = (
        "What `statereg <command> --json` prints on stdout, one document per run. Exit "
        "status: 0 ok, 1 damaged or failed (verify found damage, a gc deletion failed, a "
        "storage error), 2 usage (bad argument or declaration).")
    schema["x-statereg-commands"] = {
        command: refs[(model, mode)]["$ref"]
        for command, model in COMMAND_DOCUMENTS.items()}
    return schema
