"""The `consolidated` layout: a model's full tensors in whole files (safetensors, torch.save).

Every rank of the task's collective sends its shards; the leader writes full tensors. On
load every rank takes its own slice of each full tensor, so loading needs no collective.
"""

from __future__ import annotations

from statereg.backends.checksum import missing, verify_stream
from statereg.engine.layouts.base import (
    Captured,
    Prepared,
    ReadContext,
    WriteContext,
    key_report,
    require_object,
)
from statereg.engine.plan import LoadTask, Task
from statereg.errors import CheckpointMismatchError, SpecError
from statereg.formats.files import open_model_files, write_model_files
from statereg.schemas.manifest import ComponentRecord
from statereg.state.protocols import TensorState


class ConsolidatedLayout:
    needs_object = True

    def capture(self, task: Task, adapter: TensorState) -> Captured:
        state = adapter.capture()
        if state.sidecar is not None:
            keys = ", ".join(state.meta.get("entries", [])[:5])
            raise SpecError(
                f"component {task.component!r}: format {task.format!r} holds plain tensors "
                f"only, and the model's state_dict() also holds {keys} (extra state, quantized "
                "or other non-plain tensors); declare the component format: dcp, which stores "
                "them beside the tensors"
            )
        return Captured(task, tensors=state.tensors, meta=state.meta)

    def write(self, item: Captured, ctx: WriteContext) -> None:
        task = item.task
        write_model_files(ctx.backend, f"{ctx.name}/{task.directory}", task.format,
                          item.tensors or {}, ctx.world.process_group(task.collective),
                          task.leader, task.max_shard_size, ctx.recorder.add)

    def prepare(self, task: LoadTask, record: ComponentRecord, adapter: TensorState | None,
                ctx: ReadContext) -> Prepared:
        adapter = require_object(task, adapter)
        try:
            # A torch file is read whole by every rank: one rank reads it, the others receive
            # it (safetensors are read tensor by tensor, in the ranges each rank needs).
            source = open_model_files(ctx.backend, f"{ctx.name}/{task.directory}",
                                      record.format,
                                      lambda path: ctx.read_once(path, task.collective))
            targets = adapter.load_targets(source.metas, record.meta, ctx.strict, None)
        except CheckpointMismatchError:
            # safetensors headers are read on their own, before the files are checked whole:
            # a damaged header must be reported as damage, not as a model that differs.
            _verify_files(record, ctx)
            raise

        def apply() -> None:
            source.load_into(targets)
            adapter.apply(targets, record.meta, None)

        return Prepared(apply, keys=key_report(adapter, source.metas, record.meta, targets))


def _verify_files(record: ComponentRecord, ctx: ReadContext) -> None:
    """Check the component's files whole against the manifest (when the load verifies)."""
    for relative in record.files if ctx.records is not None else ():
        path = f"{ctx.name}/{relative}"
        recorded = ctx.records.get(path) if ctx.records is not None else None
        if recorded is None:
            continue
        where = ctx.backend.display(path)
        try:
            with ctx.backend.open_read(path) as stream:
                verify_stream(where, recorded, stream)
        except FileNotFoundError:
            raise missing(where, recorded) from None
