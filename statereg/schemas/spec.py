"""The declaration: what a user writes in statereg.yaml, as pydantic models (no torch, no I/O)."""

from __future__ import annotations

import re
import warnings
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from statereg.schemas.sharing import verdict

Kind = Literal["model", "optimizer", "scheduler", "dataloader", "rng", "custom"]
Sharing = Literal["global", "replicated", "per_rank", "per_group", "sharded"]
Format = Literal["dcp", "safetensors", "torch", "json"]

DEFAULT_SHARING: dict[str, Sharing] = {
    "model": "sharded",
    "optimizer": "sharded",
    "scheduler": "global",
    "dataloader": "per_rank",
    "rng": "per_rank",
    "custom": "global",
}
DEFAULT_FORMAT: dict[str, Format] = {
    "model": "dcp",
    "optimizer": "dcp",
    "scheduler": "json",
    "dataloader": "json",
    "rng": "json",
    "custom": "json",
}
TENSOR_KINDS = frozenset({"model", "optimizer"})
# Which kinds each format can hold (the docs' table in docs/formats.md says why).
FORMAT_KINDS: dict[str, frozenset[str]] = {
    "dcp": TENSOR_KINDS | {"custom"},
    "safetensors": frozenset({"model"}),
    "torch": frozenset({"model", "scheduler", "dataloader", "custom"}),
    "json": frozenset({"scheduler", "dataloader", "rng", "custom"}),
}
# A model in format safetensors or torch is one full copy, gathered from these patterns.
CONSOLIDATED_SHARING = frozenset({"sharded", "replicated", "global"})
DEFAULT_MAX_SHARD_SIZE = "5GB"

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(value: int | str) -> int:
    """Bytes from an int or a size such as '2GB' (10^9, as Hugging Face counts) or '512MiB'."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ValueError(f"size {value} must be at least 1 byte")
        return value
    match = _SIZE.match(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f"size {value!r} is not a size; write e.g. 2GB, 500MB, 512MiB or bytes")
    size = int(float(match.group(1)) * _SIZE_UNITS[(match.group(2) or "").upper()])
    if size < 1:
        raise ValueError(f"size {value!r} must be at least 1 byte")
    return size

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|min|h|d)?\s*$", re.IGNORECASE)
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}


def parse_duration(value: str) -> float:
    """Seconds from a duration such as '90s', '30m', '6h' or '2d' (a bare number is seconds)."""
    match = _DURATION.match(value)
    if match is None:
        raise ValueError(f"duration {value!r} is not a duration; write e.g. 3600, 90m, 6h or 2d")
    return float(match.group(1)) * _DURATION_UNITS[(match.group(2) or "").lower()]

# Component names become directory names on storage, so keep them portable.
# \Z, not $: `$` also matches before a trailing newline, which would let "model\n" through.
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]{0,63}\Z")


class _Declared(BaseModel):
    """Base of every declaration model: frozen; an unknown key is an error listing allowed ones."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = {field.alias or name for name, field in cls.model_fields.items()}
            for key in data:
                if key not in known:
                    raise PydanticCustomError(
                        "unknown_field",
                        "unknown field '{field}'; allowed fields: {allowed}",
                        {"field": str(key), "allowed": ", ".join(sorted(known))},
                    )
        return data


class PrefixSpec(_Declared):
    """Key-prefix rules mapping live state-dict keys to the names stored in the checkpoint.

    `drop` removes a leading prefix from live keys (``model.`` from a wrapper), `add` prepends
    one. The same rules apply in reverse on load, so a checkpoint is portable between wrappings.
    """

    drop: str | None = Field(default=None, description="Leading prefix removed from live keys.")
    add: str | None = Field(default=None, description="Prefix prepended to stored keys.")

    @model_validator(mode="after")
    def _needs_a_rule(self) -> PrefixSpec:
        if self.drop is None and self.add is None:
            raise ValueError("a prefix rule needs 'drop', 'add' or both")
        return self


class ComponentSpec(_Declared):
    """One checkpointable object: what it is, how ranks share it, and how it is stored."""

    kind: Kind = Field(description="What the object is; picks the adapter that reads its state.")
    sharing: Sharing | None = Field(
        default=None,
        description="How the state is shared across ranks (default depends on kind: model and "
        "optimizer sharded, scheduler global, dataloader and rng per_rank, custom global). "
        "Combinations that cannot be right (e.g. rng: global, scheduler: sharded) are refused; "
        "the kind x sharing table is in docs/distributed.md.",
    )
    format: Format | None = Field(
        default=None,
        description="Serialization format (default: dcp for model/optimizer, json otherwise). "
        "safetensors: a model as a Hugging Face safetensors directory; torch: one torch.save "
        "file, loaded with weights_only=True (see docs/formats.md).",
    )
    max_shard_size: int | str | None = Field(
        default=None,
        description="For format: safetensors, the largest file (bytes or e.g. '2GB'; default "
        f"{DEFAULT_MAX_SHARD_SIZE}); a larger tensor gets a file of its own.",
    )
    trainable_only: bool = Field(
        default=False,
        description="For a model: save only parameters with requires_grad (adapters, LoRA); "
        "loading restores them and leaves the frozen base untouched.",
    )
    ddp_layout: bool = Field(
        default=True,
        description="For a model wrapped in DistributedDataParallel: carry DDP's gradient "
        "bucket layout in the checkpoint and restore it on load, so a resume at 3 or more "
        "ranks averages gradients in the saved run's order (bit-exact; "
        "docs/exact-resume.md#under-ddp). Set false to leave it out.",
    )
    prefix: PrefixSpec | None = Field(default=None, description="Key-prefix rules (model only).")
    required: bool = Field(
        default=True,
        description="If false, the object may be given later with mgr.attach() or left out.",
    )
    model: str | None = Field(
        default=None,
        description="For an optimizer: the model component whose parameters it updates "
        "(default: the only model component).",
    )
    group: str | None = Field(
        default=None, description="For sharing: per_group, the name of the process group."
    )
    validate_replicas: bool = Field(
        default=False,
        alias="validate",
        description="For sharing: replicated, compare every rank's copy before saving; ranks "
        "whose tensors differ fail the save, naming the tensor and the ranks.",
    )
    on_world_size_change: Literal["error", "reset", "reshard"] = Field(
        default="error",
        description="For sharing: per_rank, what load does when the world size changed: error "
        "(default), reset (keep the fresh state), reshard (derive per-rank state; see "
        "docs/distributed.md).",
    )

    @model_validator(mode="after")
    def _fields_fit_kind(self) -> ComponentSpec:
        if self.prefix is not None and self.kind not in ("model", "optimizer"):
            raise ValueError(f"'prefix' applies to model and optimizer components, not {self.kind}")
        if self.model is not None and self.kind != "optimizer":
            raise ValueError("'model' applies to optimizer components only")
        if self.format is not None and self.kind not in FORMAT_KINDS[self.format]:
            fits = [f for f, kinds in FORMAT_KINDS.items() if self.kind in kinds]
            held = "tensors" if self.kind in TENSOR_KINDS else "state"
            raise ValueError(f"format {self.format!r} cannot hold {self.kind} {held}; use "
                             f"{' or '.join(map(repr, fits))}")
        if (self.kind == "model" and self.resolved_format in ("safetensors", "torch")
                and self.resolved_sharing not in CONSOLIDATED_SHARING):
            raise ValueError(f"format {self.format!r} holds one full copy of the model: use "
                             "sharing sharded, replicated or global")
        if self.max_shard_size is not None:
            if self.resolved_format != "safetensors":
                raise ValueError("'max_shard_size' applies to format 'safetensors' only")
            parse_size(self.max_shard_size)
        if self.trainable_only and self.kind != "model":
            raise ValueError("'trainable_only' applies to model components only")
        if not self.ddp_layout and self.kind != "model":
            raise ValueError("'ddp_layout' applies to model components only")
        if self.resolved_sharing == "per_group" and not self.group:
            raise ValueError("sharing 'per_group' needs 'group': the name of the process group")
        if self.validate_replicas and self.resolved_sharing != "replicated":
            raise ValueError("'validate' applies to sharing 'replicated' only")
        if self.on_world_size_change != "error" and self.resolved_sharing != "per_rank":
            raise ValueError("'on_world_size_change' applies to sharing 'per_rank' only")
        if (self.on_world_size_change == "reshard" and self.resolved_format == "dcp"):
            raise ValueError("'on_world_size_change: reshard' needs an object's own "
                             "reshard_state_dict, which format dcp does not call; use reset, or "
                             "format json / torch")
        judged, why = verdict(self.kind, self.resolved_sharing, self.resolved_format)
        if judged == "refuse":
            raise ValueError(f"sharing {self.resolved_sharing!r} does not fit a {self.kind}: {why}")
        if judged == "warn":
            warnings.warn(f"sharing {self.resolved_sharing!r} for a {self.kind}: {why}",
                          UserWarning, stacklevel=2)
        return self

    @property
    def resolved_sharing(self) -> Sharing:
        """The sharing pattern, with the kind's default filled in."""
        return self.sharing or DEFAULT_SHARING[self.kind]

    @property
    def resolved_format(self) -> Format:
        """The format, with the kind's default filled in."""
        return self.format or DEFAULT_FORMAT[self.kind]


class CompressionSpec(_Declared):
    """Compression of tensor files, applied per item inside DCP files; any backend."""

    codec: Literal["none", "zstd"] = Field(
        default="zstd", description="none, or zstd (the `zstandard` package)."
    )
    level: int = Field(
        default=3, ge=1, le=19,
        description="zstd level for non-float items (ints, pickled objects, or every item "
        "when float_aware is false). Float planes always use a fast near-entropy setting.",
    )
    threads: int = Field(
        default=0, ge=0, le=64,
        description="zstd worker threads per item; 0: none beyond the io_threads writers.",
    )
    float_aware: bool = Field(
        default=True,
        description="Split float tensors into byte planes (exponents apart from mantissas) "
        "before zstd: ~15% smaller on bf16/fp32. False keeps files readable by plain DCP "
        "without statereg.",
    )

    @model_validator(mode="before")
    @classmethod
    def _codec_shorthand(cls, data: Any) -> Any:
        # `compression: zstd` is short for `{codec: zstd}`; YAML reads a bare `off` as false.
        if data is False:
            return {"codec": "none"}
        return {"codec": data} if isinstance(data, str) else data


class StorageSpec(_Declared):
    """Where checkpoints live: a URL picks the backend; options go to its fsspec filesystem."""

    url: str = Field(
        min_length=1,
        description="Root of the run's checkpoints: a path, file://, memory://, s3:// or gs://.",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="fsspec storage options; ${ENV_VAR} is expanded when the backend opens. "
        "Never written to manifests or logs.",
    )
    io_threads: int | None = Field(
        default=None, ge=1, le=64,
        description="Files each rank writes and reads in parallel; default: the backend's (2 "
        "on local disk and memory, 8 on S3 and GCS, where every file is a network round trip).",
    )
    compression: CompressionSpec | None = Field(
        default=None,
        description="Compress tensor files (e.g. `compression: zstd`); loads need no setting: "
        "each file's codec is recorded.",
    )
    read_cache: Literal["auto", "keep", "bypass"] = Field(
        default="auto",
        description="Local disk: whether the page cache keeps what loads read and saves "
        "write. auto: keep it when it takes under half of the available memory, so a second "
        "load is a memory copy; keep: always; bypass: never (O_DIRECT reads, written pages "
        "dropped after the fsync). Other backends ignore it.",
    )

    @field_validator("url")
    @classmethod
    def _url_not_blank(cls, url: str) -> str:
        if not url.strip():
            raise ValueError("storage url is blank; give a path or a URL such as s3://bucket/run")
        return url.strip()


class KeepBestSpec(_Declared):
    """Keep the best checkpoints by a metric stored in `extra` at save time."""

    metric: str = Field(min_length=1, description="Key in the `extra` dict given to save().")
    mode: Literal["min", "max"] = Field(default="min", description="Lower or higher is better.")
    count: int = Field(default=1, ge=1, description="How many best checkpoints to keep.")


class SaveSpec(_Declared):
    """How saves run and which checkpoints retention keeps."""

    async_mode: Literal["off", "thread", "pinned"] = Field(
        default="off",
        alias="async",
        description="off: save() returns when committed; thread: save() returns once tensors "
        "are copied to reusable host buffers and a background thread writes and commits; "
        "pinned: the same with page-locked buffers (faster GPU->host copies; CUDA only).",
    )
    early_return: bool = Field(
        default=False,
        description="With async thread or pinned: save() returns before the copy to host "
        "buffers is done; the copy runs in the background, overlapping forward and backward. "
        "The loop must call wait_staged() on what save() returned (or mgr.wait_staged()) "
        "before it next changes parameters or optimizer state, e.g. before optimizer.step().",
    )
    incremental: bool = Field(
        default=False,
        description="Reference tensors unchanged since the previous checkpoint instead of "
        "writing them again (a frozen base is written once); retention keeps referenced files.",
    )
    keep_last: int | None = Field(
        default=None, ge=1, description="Keep the newest N checkpoints (default: keep all)."
    )
    keep_every: int | None = Field(
        default=None, ge=1, description="Also keep every checkpoint whose step is a multiple of N."
    )
    keep_best: KeepBestSpec | None = Field(
        default=None, description="Also keep the best checkpoints by a metric in `extra`."
    )
    every_steps: int | None = Field(
        default=None, ge=1,
        description="The cadence mgr.should_save(step) answers: every N steps (combined with "
        "every_seconds, whichever comes first).",
    )
    every_seconds: float | None = Field(
        default=None, gt=0,
        description="The cadence mgr.should_save(step) answers: once this many seconds passed "
        "since the last save (rank 0's clock decides for every rank).",
    )
    every: Literal["auto"] | None = Field(
        default=None,
        description="auto: mgr.should_save(step) picks the interval from the measured stall of "
        "the last saves and `mtbf` (Young/Daly: interval = sqrt(2 x stall x MTBF)), and logs "
        "the expected goodput.",
    )
    mtbf: float | None = Field(
        default=None, gt=0,
        description="Mean time between failures of the job, in seconds or as a duration "
        "('6h', '90m', '2d'), for `every: auto` (default 24h).",
    )

    @field_validator("mtbf", mode="before")
    @classmethod
    def _mtbf_duration(cls, value: Any) -> Any:
        return parse_duration(value) if isinstance(value, str) else value

    @field_validator("async_mode", mode="before")
    @classmethod
    def _yaml_off_is_false(cls, value: Any) -> Any:
        # YAML 1.1 reads an unquoted `off` as the boolean false, and `on` / `yes` / `true`
        # as true, which names no mode.
        if value is True:
            raise ValueError("`on` (like yes and true) is YAML for true, which names no mode: "
                             "write thread (or pinned, or off)")
        return "off" if value is False else value

    @model_validator(mode="after")
    def _early_return_needs_async(self) -> SaveSpec:
        if self.early_return and self.async_mode == "off":
            raise ValueError("'early_return' needs 'async: thread' or 'async: pinned'")
        return self

    @model_validator(mode="after")
    def _one_cadence(self) -> SaveSpec:
        if self.every == "auto" and (self.every_steps or self.every_seconds):
            raise ValueError("'every: auto' picks the interval itself: remove every_steps and "
                             "every_seconds, or remove 'every'")
        if self.mtbf is not None and self.every != "auto":
            raise ValueError("'mtbf' is used by 'every: auto' only: add 'every: auto' or "
                             "remove 'mtbf'")
        return self


class ReplicaSpec(_Declared):
    """Where each node's memory checkpoints are copied, so losing a node loses no memory
    checkpoint (docs/tiers.md)."""

    to: Literal["next_node"] = Field(
        default="next_node",
        description="next_node: node i's files are copied into node i+1's memory (the last "
        "node's into the first's), read from node i's server after each memory save.",
    )


class MemoryTierSpec(_Declared):
    """The memory tier: checkpoints in host shared memory (/dev/shm), which outlives the
    trainer process but not the node (docs/tiers.md)."""

    url: str = Field(
        default="shm://{run_id}",
        min_length=1,
        description="Where memory checkpoints live: shm://NAME is a folder under /dev/shm (or "
        "$STATEREG_SHM_DIR), one per node; {run_id} is $STATEREG_RUN_ID, else a name "
        "derived from storage.url. The job's identity "
        "(world size, each rank's node, its groups) picks a sub-folder, so another job never "
        "adopts these files.",
    )
    every: int = Field(default=10, ge=1, description="Save to memory every N steps.")
    keep_last: int = Field(
        default=2,
        description="Memory checkpoints kept (at least 2, so the only complete copy is never "
        "the one being overwritten). Memory used: (keep_last + 1) x the state.",
    )
    drain: Literal["wait", "skip"] = Field(
        default="wait",
        description="When a durable checkpoint is due while the previous drain is still "
        "copying: wait for it (the loop blocks), or skip this one (the next due step drains).",
    )
    replicate: ReplicaSpec | None = Field(
        default=None,
        description="Copy each node's memory checkpoints into a peer node's memory, so a "
        "lost node restores from its peer instead of storage.url. Memory used per node: "
        "(keep_last + 1) x (its own ranks' state + its peer's).",
    )

    @field_validator("keep_last")
    @classmethod
    def _two_at_least(cls, keep_last: int) -> int:
        if keep_last < 2:
            raise ValueError(
                f"keep_last {keep_last} is below 2: with one memory checkpoint, a crash while "
                "it is being replaced leaves no complete copy in memory; use 2 or more"
            )
        return keep_last

    @field_validator("url")
    @classmethod
    def _shm_url(cls, url: str) -> str:
        if not url.startswith("shm://") or not url[len("shm://"):].strip("/"):
            raise ValueError(f"memory tier url {url!r} must be shm://NAME, e.g. shm://{{run_id}}")
        return url


class DurableTierSpec(_Declared):
    """The durable tier (`storage.url`): memory checkpoints copied there in the background."""

    every: int = Field(
        default=500, ge=1,
        description="Drain every N steps: the memory checkpoint of that step is copied to "
        "storage.url (manifest last); it must be a multiple of tiers.memory.every.",
    )
    keep_last: int | None = Field(
        default=None, ge=1, description="Keep the newest N durable checkpoints (default: all)."
    )
    keep_every: int | None = Field(
        default=None, ge=1, description="Also keep every durable checkpoint whose step is a "
        "multiple of N.",
    )
    max_missed: int = Field(
        default=3, ge=1,
        description="Due drains in a row that may fail (or be skipped) before save() stops the "
        "run: with none of them committed, a lost node loses every step since the last "
        "durable checkpoint. Each failed drain is also raised by the next save().",
    )
    on_missed: Literal["stop", "carry_on"] = Field(
        default="stop",
        description="What save() does at the due drain after max_missed uncommitted ones: stop "
        "(raise, naming the steps), or carry_on (log an error and train on with memory only).",
    )


class TiersSpec(_Declared):
    """Memory-first tiers: save often into memory, drain some of those saves to storage.url."""

    memory: MemoryTierSpec = Field(default_factory=MemoryTierSpec)
    durable: DurableTierSpec = Field(default_factory=DurableTierSpec)

    @model_validator(mode="after")
    def _durable_steps_are_memory_steps(self) -> TiersSpec:
        if self.durable.every % self.memory.every:
            raise ValueError(
                f"durable.every {self.durable.every} is not a multiple of memory.every "
                f"{self.memory.every}: a durable checkpoint is a drained memory checkpoint, "
                "so every durable step must also be a memory step"
            )
        return self


SignalName = Literal["SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2"]


class SignalSpec(_Declared):
    """What a declared signal does: finish the save in flight, flush the newest memory
    checkpoint to storage.url within grace_s, and exit (docs/tiers.md#signals)."""

    signals: list[SignalName] = Field(
        min_length=1,
        description="The signals that flush and exit, e.g. [SIGTERM, SIGUSR1]: what a "
        "scheduler sends before it kills a job (torchrun forwards SIGTERM to every rank).",
    )
    grace_s: float = Field(
        default=25.0, gt=0,
        description="Seconds from the signal to the exit: the process exits by then even if "
        "the flush is unfinished (storage.url then keeps its previous checkpoint). Keep it "
        "below the scheduler's kill delay (torchrun, Kubernetes and Slurm send SIGKILL 30 s "
        "after SIGTERM by default).",
    )

    @model_validator(mode="before")
    @classmethod
    def _list_shorthand(cls, data: Any) -> Any:
        # `on_signal: [SIGTERM, SIGUSR1]` (or one name) is short for `{signals: [...]}`.
        if isinstance(data, str):
            return {"signals": [data]}
        return {"signals": data} if isinstance(data, list) else data

    @field_validator("signals", mode="before")
    @classmethod
    def _catchable_once(cls, signals: Any) -> Any:
        if isinstance(signals, list):
            for name in signals:
                if name in ("SIGKILL", "SIGSTOP"):
                    raise ValueError(f"{name} cannot be caught, so nothing can run on it: "
                                     "declare SIGTERM, which schedulers send before SIGKILL")
            repeated = sorted({n for n in signals if signals.count(n) > 1}, key=str)
            if repeated:
                raise ValueError(f"{', '.join(map(str, repeated))} listed more than once")
        return signals


class ProfileSpec(_Declared):
    """A named selection of components for load(profile=...), e.g. a fine-tune."""

    exclude: list[str] = Field(default_factory=list, description="Components not to load.")
    include: list[str] | None = Field(
        default=None, description="If given, load only these components."
    )


class RegistrySpec(_Declared):
    """The whole declaration of a run's checkpointable state (the root of statereg.yaml)."""

    version: Literal[1] = Field(default=1, description="Declaration format version.")
    storage: StorageSpec
    components: dict[str, ComponentSpec] = Field(min_length=1)
    save: SaveSpec = Field(default_factory=SaveSpec)
    profiles: dict[str, ProfileSpec] = Field(default_factory=dict)
    tiers: TiersSpec | None = Field(
        default=None,
        description="Memory-first tiers (docs/tiers.md): save() saves to memory every "
        "tiers.memory.every steps and drains every tiers.durable.every to storage.url. "
        "Without it, every save goes to storage.url as before.",
    )
    restore: Literal["nearest"] = Field(
        default="nearest",
        description="Which copy load() resumes from: nearest, the newest step complete on "
        "every rank in some tier, memory first (the durable tier is read only when it holds "
        "a newer step).",
    )
    on_signal: SignalSpec | None = Field(
        default=None,
        description="On a declared signal: finish the save in flight, flush the newest memory "
        "checkpoint to storage.url (with tiers) within grace_s, and exit with status "
        "128 + the signal's number (docs/tiers.md#signals). Without tiers: finish the save in "
        "flight (an async save commits) and exit.",
    )

    @field_validator("components")
    @classmethod
    def _portable_names(cls, components: dict[str, ComponentSpec]) -> dict[str, ComponentSpec]:
        for name in components:
            if not _NAME.match(name):
                raise ValueError(
                    f"component name {name!r} must start with a letter or '_' and hold only "
                    "letters, digits, '_' or '-' (it becomes a directory name)"
                )
        return components

    @model_validator(mode="after")
    def _references_resolve(self) -> RegistrySpec:
        models = [n for n, c in self.components.items() if c.kind == "model"]
        for name, comp in self.components.items():
            if comp.kind != "optimizer":
                continue
            if comp.model is not None and comp.model not in models:
                raise ValueError(
                    f"components.{name}.model names {comp.model!r}, which is not a model "
                    f"component; model components: {models or 'none'}"
                )
            if comp.model is None and len(models) != 1:
                raise ValueError(
                    f"components.{name} needs 'model': the model component it optimizes "
                    f"(model components: {models or 'none'})"
                )
        if self.tiers is not None:
            self._tiers_fit_save()
        for pname, profile in self.profiles.items():
            for listed in [*profile.exclude, *(profile.include or [])]:
                if listed not in self.components:
                    raise ValueError(
                        f"profiles.{pname} names unknown component {listed!r}; "
                        f"components: {', '.join(self.components)}"
                    )
        return self

    def _tiers_fit_save(self) -> None:
        save = self.save
        if save.keep_last is not None or save.keep_every is not None or save.keep_best:
            raise ValueError("with 'tiers', retention is declared per tier: move save.keep_last "
                             "/ keep_every to tiers.durable (keep_best is not built for tiers "
                             "yet)")
        if save.incremental:
            raise ValueError("'tiers' with save.incremental is not built yet: set incremental "
                             "to false")

    def model_for(self, optimizer: str) -> str:
        """Name of the model component that the optimizer component `optimizer` updates."""
        comp = self.components[optimizer]
        if comp.model is not None:
            return comp.model
        return next(n for n, c in self.components.items() if c.kind == "model")
