"""One executor per way of storing a component, as one backend per URL scheme.

A plan's task names its layout; save and load look the executor up here and run it, so a
new layout is one module plus one entry in `LAYOUTS`, and nothing else branches on formats.

- `dcp`: tensors through torch.distributed.checkpoint (sharded, replicated, one copy, per
  rank or per group), with a JSON sidecar for an optimizer's param groups;
- `consolidated`: a model's full tensors in whole files (safetensors or torch.save);
- `object_file`: small object state, one json or torch file per copy.
"""

from __future__ import annotations

from statereg.engine.layouts.base import (
    Captured,
    KeyReport,
    LayoutExecutor,
    Prepared,
    ReadContext,
    WriteContext,
)
from statereg.engine.layouts.consolidated import ConsolidatedLayout
from statereg.engine.layouts.dcp import DCPLayout
from statereg.engine.layouts.object_file import ObjectFileLayout
from statereg.state.protocols import ObjectState, TensorState

LAYOUTS: dict[str, LayoutExecutor[TensorState] | LayoutExecutor[ObjectState]] = {
    "dcp": DCPLayout(),
    "consolidated": ConsolidatedLayout(),
    "object_file": ObjectFileLayout(),
}

__all__ = ["LAYOUTS", "Captured", "KeyReport", "LayoutExecutor", "Prepared", "ReadContext",
           "WriteContext"]
