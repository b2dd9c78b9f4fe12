"""What every layout executor takes and returns: plain records, no format branches."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from statereg.backends.base import StorageBackend
from statereg.backends.checksum import FileRecorder
from statereg.backends.stores import ReadableStore
from statereg.dcp.codec import CompressionSettings
from statereg.dcp.writer import WriteReport
from statereg.engine.io_policy import IOPolicy
from statereg.engine.plan import LoadTask, Task
from statereg.engine.world import World
from statereg.errors import SpecError
from statereg.schemas.manifest import ComponentRecord, FileRecord
from statereg.state.protocols import ObjectState, TensorMeta, TensorState

# The adapter a layout executor takes: a TensorState (dcp, consolidated) or an ObjectState
# (object_file); the plan picks the layout from the component's kind, as the adapter is.
AdapterT = TypeVar("AdapterT", bound="TensorState | ObjectState", contravariant=True)
_Adapter = TypeVar("_Adapter", bound="TensorState | ObjectState")


@dataclass
class Captured:
    """One component's state on this rank at save time: tensors (live references until
    staged), the small state recorded in the manifest, and small files as bytes."""

    task: Task
    tensors: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    blobs: dict[str, bytes] = field(default_factory=dict)  # path in the checkpoint -> bytes
    # Plain tensors the collective's coordinator alone writes, its copy standing for every
    # rank's (a DDP model's buffers: each rank updates its own, the next step uses rank 0's).
    coordinator_only: frozenset[str] = frozenset()

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in (self.tensors or {}).values()
                   if isinstance(t, torch.Tensor))

    @property
    def nbytes(self) -> int:
        return self.tensor_bytes + sum(len(b) for b in self.blobs.values())


@dataclass
class WriteContext:
    """Where and how this rank's files of one checkpoint are written."""

    backend: StorageBackend
    name: str  # the checkpoint directory
    world: World
    recorder: FileRecorder
    compression: CompressionSettings | None
    io: IOPolicy  # how this store is written (engine/io_policy.py)
    reuse: Callable[[str], Any] | None = None  # directory -> what an incremental save reuses


@dataclass
class ReadContext:
    """Where one checkpoint is read from, for this rank.

    `records` are the manifest's files by path from the root (the checkpoint's own and the
    ones it references), or None with verify="off". With records, `backend` checks every
    whole-file read against them (verified.VerifiedReads) and DCP readers check each item as
    it is read; they also spare a size request per file.
    """

    backend: ReadableStore
    name: str
    world: World
    records: Mapping[str, FileRecord] | None
    io: IOPolicy  # how this store is read (engine/io_policy.py)
    strict: bool = True

    def read_once(self, path: str, collective: str | None) -> bytes:
        """The file `path` (from the root), read by one rank of the task's collective (its
        lowest) and broadcast to the others, since every one of them reads it alike (DCP
        `.metadata`, a sidecar, a group's state file). Verified by the reader as any read
        through `backend` is; its failure is raised on every rank of the collective."""
        group = self.world.process_group(collective)
        if group is None:
            return self.backend.read_bytes(path)
        return self.world.from_leader(self.backend.read_bytes, path, group=group)


@dataclass(frozen=True)
class KeyReport:
    """How one model's keys met a foreign source's tensors (stored names, after prefix rules)."""

    loaded: tuple[str, ...]
    missing: tuple[str, ...]  # in the model, not in the source: they keep their values
    unexpected: tuple[str, ...]  # in the source, not in the model: ignored

    def __str__(self) -> str:
        def some(keys: tuple[str, ...]) -> str:
            return ", ".join(keys[:5]) + (f" (and {len(keys) - 5} more)" if len(keys) > 5 else "")

        return (f"{len(self.loaded)} loaded, {len(self.missing)} missing"
                + (f" [{some(self.missing)}]" if self.missing else "")
                + f", {len(self.unexpected)} unexpected"
                + (f" [{some(self.unexpected)}]" if self.unexpected else ""))


@dataclass
class Prepared:
    """A checked load: `apply` modifies live objects; `pending` is state held for an object
    that is not attached yet (applied by mgr.attach); `keys` how a tensor component's keys
    met the stored ones."""

    apply: Callable[[], None]
    pending: Any = None
    keys: KeyReport | None = None


def key_report(adapter: TensorState, stored: dict[str, TensorMeta], meta: dict[str, Any],
               targets: dict[str, Any]) -> KeyReport:
    missing, unexpected = adapter.key_differences(stored, meta)
    return KeyReport(tuple(sorted(targets)), tuple(missing), tuple(unexpected))


def nothing() -> None:
    """A load step that changes nothing (a component reset on a world-size change)."""


class LayoutExecutor(Protocol[AdapterT]):
    """Executes the save and load tasks of one layout, on adapters of one protocol."""

    # Whether a load needs the live object (tensors load in place into it). A load into a
    # component not attached yet is then deferred until mgr.attach() gives the object;
    # otherwise the read state is held and applied by attach().
    needs_object: bool

    def capture(self, task: Task, adapter: AdapterT) -> Captured:
        """This rank's state of the component (no copy of tensors)."""
        ...

    def write(self, item: Captured, ctx: WriteContext) -> WriteReport | None:
        """Write this rank's files of the component except `item.blobs` (the caller writes
        those); returns what DCP's writer did (what an incremental save learns), or None."""
        ...

    def prepare(self, task: LoadTask, record: ComponentRecord, adapter: AdapterT | None,
                ctx: ReadContext) -> Prepared:
        """Check the stored component against the live object and return the load step;
        nothing live changes until `apply` runs."""
        ...


def require_object(task: LoadTask, adapter: _Adapter | None) -> _Adapter:
    """The component's adapter; a SpecError naming it when its object was not given."""
    if adapter is None:
        raise SpecError(
            f"component {task.component!r} (format {task.format}) has no object to load into; "
            "pass it to CheckpointManager(...) or exclude it"
        )
    return adapter
