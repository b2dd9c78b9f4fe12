"""Execute a save: capture state, (optionally stage it), write every file, then commit."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import statereg
from statereg.backends.base import FileRecorder, StorageBackend, WrittenFile
from statereg.backends.dcp_io import BackendWriter
from statereg.engine.commit import (
    Committed,
    apply_retention,
    checkpoint_name,
    commit,
    read_manifest_at,
)
from statereg.engine.jsonstate import encode_state
from statereg.engine.plan import DCP_EXTRA_NAME, CheckpointPlan, ComponentPlan
from statereg.engine.report import Progress, describe_rate
from statereg.errors import CheckpointExistsError, CheckpointNotFoundError, SpecError
from statereg.schemas.manifest import FORMAT_VERSION, ComponentRecord, FileRecord, Manifest
from statereg.schemas.spec import RegistrySpec
from statereg.state.factory import Adapter
from statereg.state.model import ModelAdapter
from statereg.state.optimizer import OptimizerAdapter

logger = logging.getLogger("statereg")


@dataclass
class CapturedComponent:
    """One component's state at save time: tensors for DCP, and small files as bytes."""

    plan: ComponentPlan
    tensors: dict[str, Any] | None = None
    blobs: dict[str, bytes] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in (self.tensors or {}).values() if isinstance(t, torch.Tensor))


def capture(plan: CheckpointPlan, adapters: dict[str, Adapter], rank: int = 0,
            ) -> list[CapturedComponent]:
    """Read every attached component's state. Tensors are referenced, not copied."""
    captured = []
    for cplan in plan.components:
        adapter = adapters.get(cplan.name)
        if adapter is None:
            continue
        item = CapturedComponent(cplan)
        where = f"component {cplan.name!r}"
        if isinstance(adapter, ModelAdapter):
            item.tensors, item.meta = adapter.capture()
        elif isinstance(adapter, OptimizerAdapter):
            item.tensors, extra = adapter.capture()
            item.blobs[f"{cplan.directory}/{DCP_EXTRA_NAME}"] = encode_state(extra, where)
        elif cplan.format == "dcp":
            item.tensors = adapter.capture()
        else:
            item.blobs[cplan.json_file(rank)] = encode_state(adapter.capture(), where)
        captured.append(item)
    return captured


class StagingArea:
    """Host buffers that hold a copy of the tensors while a background save writes them.

    Buffers are allocated on the first save and reused while shapes and dtypes stay the same,
    so repeated async saves do not grow memory.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())

    def stage(self, captured: list[CapturedComponent]) -> list[CapturedComponent]:
        staged = []
        for item in captured:
            if item.tensors is None:
                staged.append(item)
                continue
            copies: dict[str, Any] = {}
            for key, tensor in item.tensors.items():
                if not isinstance(tensor, torch.Tensor):
                    copies[key] = tensor
                    continue
                slot = (item.plan.name, key)
                buf = self._buffers.get(slot)
                if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
                    buf = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
                    self._buffers[slot] = buf
                buf.copy_(tensor.detach())
                copies[key] = buf
            staged.append(replace(item, tensors=copies))
        return staged


def redacted_spec(spec: RegistrySpec) -> dict[str, Any]:
    """The declaration as JSON data, with every storage option value hidden."""
    data = spec.model_dump(mode="json", by_alias=True)
    data["storage"]["options"] = {k: "<redacted>" for k in data["storage"]["options"]}
    return data


def check_extra(extra: dict[str, Any] | None) -> dict[str, Any]:
    """`extra` must survive JSON unchanged, since the manifest stores it."""
    extra = dict(extra or {})
    for key, value in extra.items():
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            raise SpecError(
                f"save(extra=...): value of {key!r} ({type(value).__name__}) is not plain JSON; "
                "pass numbers, strings, lists or dicts (e.g. float(loss))"
            ) from None
        if not isinstance(key, str):
            raise SpecError(f"save(extra=...): key {key!r} must be a string")
    return extra


def _prepare_directory(backend: StorageBackend, name: str) -> None:
    """Refuse a committed step; clear leftovers of an interrupted save of the same step."""
    try:
        read_manifest_at(backend, name)
    except CheckpointNotFoundError:
        if backend.list_dir(name):
            logger.warning("removing leftovers of an interrupted save in %s", backend.display(name))
            backend.remove_tree(name)
        return
    raise CheckpointExistsError(
        f"{backend.display(name)} is already a committed checkpoint; save a different step, "
        "or delete it first (statereg never overwrites a committed checkpoint)"
    )


def write_components(backend: StorageBackend, name: str, captured: list[CapturedComponent],
                     io_threads: int, progress: Progress) -> list[WrittenFile]:
    """Write every file of every component; returns them with paths relative to `name`."""
    recorder = FileRecorder()
    for item in captured:
        if item.tensors is not None:
            writer = BackendWriter(backend, f"{name}/{item.plan.directory}", recorder,
                                   thread_count=io_threads)
            dcp.save(item.tensors, storage_writer=writer, no_dist=True)
        for path, data in item.blobs.items():
            recorder.add(backend.write_bytes(f"{name}/{path}", data))
        progress.update(item.tensor_bytes + sum(len(b) for b in item.blobs.values()))
    prefix = f"{name}/"
    return [WrittenFile(f.path.removeprefix(prefix), f.size, f.checksum) for f in recorder.files()]


def build_manifest(spec: RegistrySpec, captured: list[CapturedComponent],
                   files: list[WrittenFile], step: int, tokens_seen: int | None,
                   extra: dict[str, Any], world_size: int) -> Manifest:
    components = {}
    for item in captured:
        prefix = f"{item.plan.directory}/"
        mine = [f for f in files if f.path.startswith(prefix)]
        components[item.plan.name] = ComponentRecord(
            kind=item.plan.kind,
            sharing=item.plan.sharing,
            format=item.plan.format,
            files=[f.path for f in mine],
            tensors=len(item.tensors or {}),
            bytes=sum(f.size for f in mine),
            meta=item.meta,
        )
    return Manifest(
        format_version=FORMAT_VERSION,
        statereg_version=statereg.__version__,
        torch_version=torch.__version__,
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        step=step,
        tokens_seen=tokens_seen,
        extra=extra,
        world_size=world_size,
        spec=redacted_spec(spec),
        components=components,
        files=[FileRecord(path=f.path, size=f.size, checksum=f.checksum) for f in files],
    )


def save_checkpoint(backend: StorageBackend, spec: RegistrySpec, captured: list[CapturedComponent],
                    step: int, tokens_seen: int | None, extra: dict[str, Any],
                    world_size: int = 1) -> Committed:
    """Write, commit and apply retention; returns the committed checkpoint."""
    started = time.perf_counter()
    name = checkpoint_name(step)
    _prepare_directory(backend, name)
    total = sum(c.tensor_bytes + sum(len(b) for b in c.blobs.values()) for c in captured)
    with Progress(total, f"save {name}") as progress:
        files = write_components(backend, name, captured, spec.storage.io_threads, progress)
    manifest = build_manifest(spec, captured, files, step, tokens_seen, extra, world_size)
    commit(backend, name, manifest)
    deleted = apply_retention(backend, spec.save)
    elapsed = time.perf_counter() - started
    logger.info(
        "saved %s: %d components, %d files, %s%s",
        backend.display(name), len(captured), len(files),
        describe_rate(manifest.total_bytes, elapsed),
        f"; retention removed {', '.join(deleted)}" if deleted else "",
    )
    return Committed(name, manifest)
