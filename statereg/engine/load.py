"""Execute a load in two phases: check and prepare every selected component, then apply.

Nothing live is modified until every component has been checked against the checkpoint, so
a mismatch in one component leaves all of them as they were.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from statereg.backends.base import StorageBackend, checksum_of, new_hasher
from statereg.backends.dcp_io import BackendReader, SafeLoadPlanner
from statereg.engine.commit import Committed
from statereg.engine.jsonstate import decode_state
from statereg.engine.plan import DCP_EXTRA_NAME, STATE_NAME, rank_file
from statereg.engine.report import Progress, describe_rate
from statereg.errors import CheckpointMismatchError, CorruptCheckpointError, SpecError
from statereg.schemas.manifest import ComponentRecord, FileRecord
from statereg.state.factory import Adapter
from statereg.state.model import ModelAdapter, TensorMeta
from statereg.state.optimizer import OptimizerAdapter

logger = logging.getLogger("statereg")

VerifyMode = Literal["off", "fast", "full"]


@dataclass(frozen=True)
class LoadResult:
    """What a load restored, and the bookkeeping saved with it."""

    step: int
    tokens_seen: int | None
    extra: dict[str, Any]
    path: str
    components: tuple[str, ...]


def select_components(declared: Iterable[str], committed: Committed, include: list[str] | None,
                      exclude: list[str]) -> list[str]:
    """The declared components to load: `include` (default all) minus `exclude`."""
    declared = list(declared)
    for name in [*(include or []), *exclude]:
        if name not in declared:
            raise SpecError(
                f"load: {name!r} is not a declared component; declared: {', '.join(declared)}"
            )
    chosen = [n for n in (include or declared) if n not in exclude]
    absent = [n for n in chosen if n not in committed.manifest.components]
    if absent:
        raise CheckpointMismatchError(
            f"{committed.name} has no component {', '.join(map(repr, absent))} (it holds "
            f"{', '.join(committed.manifest.components)}); pass exclude={absent!r} to load the rest"
        )
    return chosen


def verify_files(backend: StorageBackend, name: str, files: list[FileRecord],
                 mode: VerifyMode) -> None:
    """fast: every file exists with its recorded size; full: also every checksum."""
    if mode == "off":
        return
    for record in files:
        path = f"{name}/{record.path}"
        if mode == "full":
            try:
                data = backend.read_bytes(path)
            except FileNotFoundError:
                data = None
            size = None if data is None else len(data)
        else:
            try:
                size = backend.size(path)
            except FileNotFoundError:
                size = None
        if size is None:
            raise CorruptCheckpointError(
                f"{backend.display(path)} is missing; the manifest lists it "
                f"({record.size} bytes). The checkpoint is damaged: load an earlier one"
            )
        if size != record.size:
            raise CorruptCheckpointError(
                f"{backend.display(path)} has {size} bytes, the manifest recorded "
                f"{record.size}; the file is truncated or damaged: load an earlier checkpoint"
            )
        if mode == "full":
            hasher = new_hasher()
            hasher.update(data)
            if checksum_of(hasher) != record.checksum:
                raise CorruptCheckpointError(
                    f"{backend.display(path)}: checksum {checksum_of(hasher)} differs from the "
                    f"manifest's {record.checksum}; the file is damaged: load an earlier checkpoint"
                )


def stored_tensor_metas(reader: BackendReader) -> dict[str, TensorMeta]:
    metadata = reader.read_metadata()
    return {
        fqn: TensorMeta(tuple(md.size), md.properties.dtype)
        for fqn, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }


def _read_json(backend: StorageBackend, path: str) -> Any:
    return decode_state(backend.read_bytes(path), backend.display(path))


def _prepare(backend: StorageBackend, ckpt: str, name: str, record: ComponentRecord,
             adapter: Adapter | None, strict: bool, rank: int) -> tuple[Callable[[], None], Any]:
    """Check one component and return (apply, pending state for a not-yet-attached object)."""
    if record.format == "dcp":
        reader = BackendReader(backend, f"{ckpt}/{name}")
        if isinstance(adapter, ModelAdapter):
            targets = adapter.load_targets(stored_tensor_metas(reader), record.meta, strict)

            def apply_model() -> None:
                dcp.load(targets, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
                adapter.after_load(targets, record.meta)

            return apply_model, None
        if isinstance(adapter, OptimizerAdapter):
            extra = _read_json(backend, f"{ckpt}/{name}/{DCP_EXTRA_NAME}")
            opt_targets = adapter.load_targets(stored_tensor_metas(reader), extra)

            def apply_optimizer() -> None:
                dcp.load(opt_targets, storage_reader=reader, planner=SafeLoadPlanner(),
                         no_dist=True)
                adapter.apply(opt_targets, extra)

            return apply_optimizer, None
        if adapter is None:
            return lambda: None, None
        state = adapter.capture()

        def apply_object_dcp() -> None:
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
            adapter.restore(state)

        return apply_object_dcp, None
    filename = rank_file(rank) if record.sharing == "per_rank" else STATE_NAME
    path = f"{ckpt}/{name}/{filename}"
    if f"{name}/{filename}" not in record.files:
        raise CheckpointMismatchError(
            f"{backend.display(ckpt)}: component {name!r} has no state for rank {rank} "
            f"(files: {', '.join(record.files)})"
        )
    state = _read_json(backend, path)
    if adapter is None:
        return lambda: None, state
    return lambda: adapter.restore(state), None


def load_checkpoint(backend: StorageBackend, committed: Committed, adapters: dict[str, Adapter],
                    names: list[str], strict: bool = True, verify: VerifyMode = "fast",
                    rank: int = 0) -> tuple[LoadResult, dict[str, Any]]:
    """Load `names` from a committed checkpoint into their adapters.

    Returns the result and the states of components whose objects are not attached yet.
    """
    started = time.perf_counter()
    manifest = committed.manifest
    selected_files = {p for n in names for p in manifest.components[n].files}
    files = [f for f in manifest.files if f.path in selected_files]
    verify_files(backend, committed.name, files, verify)
    steps: list[tuple[str, Callable[[], None]]] = []
    pending: dict[str, Any] = {}
    for name in names:
        apply, state = _prepare(backend, committed.name, name, manifest.components[name],
                                adapters.get(name), strict, rank)
        steps.append((name, apply))
        if state is not None:
            pending[name] = state
    nbytes = sum(f.size for f in files)
    with Progress(nbytes, f"load {committed.name}") as progress, torch.no_grad():
        for name, apply in steps:
            apply()
            progress.update(manifest.components[name].bytes)
    elapsed = time.perf_counter() - started
    logger.info("loaded %s: %s (%s)", backend.display(committed.name),
                describe_rate(nbytes, elapsed), ", ".join(names))
    result = LoadResult(
        step=manifest.step,
        tokens_seen=manifest.tokens_seen,
        extra=dict(manifest.extra),
        path=backend.display(committed.name),
        components=tuple(names),
    )
    return result, pending
