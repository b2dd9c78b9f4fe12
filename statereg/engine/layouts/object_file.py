"""The `object_file` layout: an object's state in one json or torch file per copy.

One copy (`state.json`), one per group (`<group>/state.json`) or one per rank
(`rank_00003.json`); a per-rank component loaded at another world size follows its
declared policy (reset: keep the fresh state; reshard: derive it from every saved rank's).
"""

from __future__ import annotations

import logging

from statereg.engine.layouts.base import Captured, Prepared, ReadContext, WriteContext, nothing
from statereg.engine.plan import LoadTask, Task
from statereg.errors import CorruptCheckpointError, SpecError
from statereg.formats.files import decode_object, encode_object
from statereg.schemas.manifest import ComponentRecord
from statereg.state.protocols import ObjectState

logger = logging.getLogger(__name__)


class ObjectFileLayout:
    needs_object = False

    def capture(self, task: Task, adapter: ObjectState) -> Captured:
        (path,) = task.files
        data = encode_object(task.format, adapter.capture(), f"component {task.component!r}")
        return Captured(task, blobs={path: data})

    def write(self, item: Captured, ctx: WriteContext) -> None:
        """Nothing beyond the captured file, which the caller writes with every blob."""

    def prepare(self, task: LoadTask, record: ComponentRecord, adapter: ObjectState | None,
                ctx: ReadContext) -> Prepared:
        if task.policy == "reset":
            logger.warning("%s: world size changed (%d -> %d); %r keeps its fresh state",
                           ctx.backend.display(ctx.name), task.saved_world_size, ctx.world.size,
                           task.component)
            return Prepared(nothing)
        states = []
        for path in task.state_files:
            if path not in record.files:
                raise CorruptCheckpointError(
                    f"{ctx.backend.display(ctx.name)}: component {task.component!r} lists no "
                    f"{path} (it lists {', '.join(record.files)}); the manifest and the "
                    "checkpoint disagree: load an earlier checkpoint"
                )
            full = f"{ctx.name}/{path}"
            # One copy (global, a group's): read by one rank of its collective, sent to all.
            states.append(decode_object(task.format, ctx.read_once(full, task.collective),
                                        ctx.backend.display(full)))
        if adapter is None and task.policy == "reshard":
            raise SpecError(
                f"component {task.component!r} declares on_world_size_change: reshard, which "
                "needs its object at load time; pass it to CheckpointManager(...) before load()"
            )
        if adapter is None:  # held until mgr.attach() gives the object
            return Prepared(nothing, states[0])
        adapter.check_ready()
        state = (adapter.reshard(states, ctx.world.rank, ctx.world.size)
                 if task.policy == "reshard" else states[0])
        adapter.check_state(state)  # e.g. a loader's position saved for another loader
        return Prepared(lambda: adapter.restore(state))
