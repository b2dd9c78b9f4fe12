"""Directories written by plain torch.distributed.checkpoint: no manifest, so not verified.

`dcp.save({"model": ..., "optimizer": ...})` flattens nested state into names such as
`model.layers.0.weight`, `optimizer.state.<param>.exp_avg` and
`optimizer.param_groups.0.lr`; a component named `model` loads the names under `model.`.
statereg's own `dcp` components are such directories too, so export reads them here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from statereg.backends.stores import ReadableStore
from statereg.dcp.quiet import single_process_dcp
from statereg.dcp.reader import BackendReader, SafeLoadPlanner
from statereg.errors import CheckpointMismatchError
from statereg.formats.tensors import dcp_tensor_metas, nbytes
from statereg.state.optimizer import OptimizerAdapter
from statereg.state.protocols import TensorMeta

_GROUPS = "param_groups."


class DCPDirectory:
    """One DCP checkpoint directory: its items from `.metadata` (read safely), and loads.

    With `prefix`, only the items under it, named without it (`model.` for a component named
    `model`). Every rank plans its own reads (no collective): a DTensor takes its own shard.
    `thread_count`: files read at once (the I/O policy's read_threads, engine/io_policy.py).
    """

    def __init__(self, backend: ReadableStore, directory: str, prefix: str = "",
                 thread_count: int = 2) -> None:
        self.reader = BackendReader(backend, directory, thread_count)
        self.prefix = prefix
        metadata = self.reader.read_metadata()
        everything = dcp_tensor_metas(metadata)
        self.metas: dict[str, TensorMeta] = {
            k[len(prefix):]: v for k, v in everything.items() if k.startswith(prefix)}
        self.objects = sorted(fqn[len(prefix):] for fqn, md in metadata.state_dict_metadata.items()
                              if isinstance(md, BytesStorageMetadata) and fqn.startswith(prefix))
        self.top_level = _top_level(everything, metadata)

    def load(self, state: dict[str, Any]) -> None:
        """Fill `state` in place: tensors are copied into, other items replaced."""
        named = {self.prefix + k: v for k, v in state.items()}
        with single_process_dcp():
            dcp.load(named, storage_reader=self.reader, planner=SafeLoadPlanner(),
                     no_dist=True)
        state.update({k: named[self.prefix + k] for k in state})

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        state = {n: torch.empty(self.metas[n].shape, dtype=self.metas[n].dtype) for n in names}
        self.load(state)
        return state

    def load_into(self, targets: dict[str, torch.Tensor]) -> None:
        self.load(dict(targets))


def _top_level(metas: dict[str, TensorMeta], metadata: Any) -> dict[str, tuple[int, int, int]]:
    """First name segment -> (tensors, tensor bytes, other items), e.g. model, optimizer."""
    groups: dict[str, list[int]] = {}
    for fqn, meta in metas.items():
        entry = groups.setdefault(fqn.partition(".")[0], [0, 0, 0])
        entry[0] += 1
        entry[1] += nbytes(meta)
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            groups.setdefault(fqn.partition(".")[0], [0, 0, 0])[2] += 1
    return {k: (v[0], v[1], v[2]) for k, v in sorted(groups.items())}


def check_component_names(source: DCPDirectory, name: str) -> None:
    """A component reads the items under `<name>.`; there must be some."""
    if not source.metas:
        tops = list(source.top_level) or ["none"]
        raise CheckpointMismatchError(
            f"the foreign checkpoint has no tensors under {source.prefix!r} (its top-level "
            f"names: {', '.join(tops)}); name components after them, e.g. include="
            f"[{tops[0]!r}]"
        )


def _param_groups(source: DCPDirectory, name: str) -> list[dict[str, Any]]:
    """The optimizer's param_groups, rebuilt from `param_groups.<i>.<key>` items."""
    values: dict[str, Any] = dict.fromkeys(k for k in source.objects if k.startswith(_GROUPS))
    source.load(values)
    groups: dict[int, dict[str, Any]] = {}
    for key, value in values.items():
        index, _, entry = key[len(_GROUPS):].partition(".")
        groups.setdefault(int(index), {})[entry] = value
    ordered = [groups[i] for i in sorted(groups)]
    if not ordered or any(not all(isinstance(p, str) for p in g.get("params", [None]))
                          for g in ordered):
        raise CheckpointMismatchError(
            f"component {name!r}: the foreign checkpoint's optimizer state is not keyed by "
            "parameter name; save it with torch.distributed.checkpoint.state_dict."
            "get_state_dict(model, optimizer), which names parameters"
        )
    return ordered


def prepare_optimizer(source: DCPDirectory, name: str, adapter: OptimizerAdapter,
                      ) -> Callable[[], None]:
    """Check an optimizer against `state.<param>.<entry>` and `param_groups` items."""
    extra = {"param_groups": _param_groups(source, name), "state": {}}
    targets = adapter.load_targets(source.metas, {}, True, extra)

    def apply() -> None:
        source.load_into(targets)
        adapter.apply(targets, {}, extra)

    return apply
