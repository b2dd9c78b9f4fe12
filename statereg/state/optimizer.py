"""Optimizer adapter: state keyed by parameter name, so it survives re-construction and resharding.

We do not use DCP's get/set_optimizer_state_dict: on an optimizer with no state yet they run a
zero-gradient `step()` to create some (`_init_optim_state`), which bumps Adam's step counter
and breaks bit-exact resume. Instead tensors are named `state.<param>.<key>` and loading
allocates exactly the entries the checkpoint holds - a parameter that never had a gradient
gets none, as it had none when saved.
"""

from __future__ import annotations

from typing import Any

import torch

from statereg.errors import CheckpointMismatchError, CorruptCheckpointError, SpecError
from statereg.state.model import ModelAdapter, mismatch_report
from statereg.state.protocols import TensorCapture, TensorMeta, sharded_keys_of

_STATE = "state."


def _split_key(key: str) -> tuple[str, str]:
    param, _, entry = key[len(_STATE):].rpartition(".")
    return param, entry


def is_zero(optimizer: Any) -> bool:
    """Whether `optimizer` is torch's ZeroRedundancyOptimizer (each rank holds the state of
    its own partition of the parameters, in `optimizer.optim`)."""
    return any(cls.__name__ == "ZeroRedundancyOptimizer"
               and cls.__module__.startswith("torch.distributed.optim")
               for cls in type(optimizer).__mro__)


def _require_sidecar(name: str, sidecar: dict[str, Any] | None) -> dict[str, Any]:
    if not isinstance(sidecar, dict) or not isinstance(sidecar.get("param_groups"), list) \
            or not isinstance(sidecar.get("state"), dict):
        raise CorruptCheckpointError(
            f"component {name!r}: the optimizer's param groups and scalar state are missing or "
            "malformed; the checkpoint is damaged: load an earlier one"
        )
    return sidecar


class OptimizerAdapter:
    """Captures and restores a torch.optim.Optimizer whose parameters belong to one model."""

    kind = "optimizer"

    def __init__(self, name: str, optimizer: torch.optim.Optimizer, model: ModelAdapter,
                 exposed: torch.optim.Optimizer | None = None) -> None:
        """`exposed`: a ZeroRedundancyOptimizer whose local shard `optimizer` is; its own
        param groups (the ones schedulers change) get the loaded hyperparameters too."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise SpecError(
                f"component {name!r} is declared kind 'optimizer' but got "
                f"{type(optimizer).__name__}; pass a torch.optim.Optimizer"
            )
        self.name = name
        self.optimizer = optimizer
        self.model = model
        self.exposed = exposed

    def _params_by_name(self) -> dict[str, torch.nn.Parameter]:
        return {self.model.stored_name(k): p for k, p in self.model.live_module.named_parameters()}

    def _ordered_params(self) -> list[torch.nn.Parameter]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _names_by_param(self) -> dict[int, str]:
        names = {id(p): n for n, p in self._params_by_name().items()}
        for param in self._ordered_params():
            if id(param) not in names:
                raise SpecError(
                    f"component {self.name!r}: the optimizer holds a parameter of shape "
                    f"{list(param.shape)} that is not in model component {self.model.name!r}; "
                    "set 'model:' on the optimizer declaration to the model it optimizes"
                )
        return names

    def capture(self) -> TensorCapture:
        """Tensor state under `state.<param>.<key>` (no copy), and the rest as JSON-able data
        (the sidecar: param groups and scalar state)."""
        names = self._names_by_param()
        tensors: dict[str, torch.Tensor] = {}
        scalars: dict[str, dict[str, Any]] = {}
        for param, entries in self.optimizer.state.items():
            pname = names[id(param)]
            for key, value in entries.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{_STATE}{pname}.{key}"] = value
                else:
                    scalars.setdefault(pname, {})[key] = value
        # A ZeroRedundancyOptimizer's exposed groups hold the current hyperparameters (a
        # scheduler sets them there; the local optimizer gets them at the next step).
        settings = (self.exposed or self.optimizer).param_groups
        groups = [
            {**{k: v for k, v in setting.items() if k != "params"},
             "params": [names[id(p)] for p in group["params"]]}
            for group, setting in zip(self.optimizer.param_groups, settings, strict=True)
        ]
        return TensorCapture(tensors, {}, {"param_groups": groups, "state": scalars})

    def sharded_keys(self) -> list[str]:
        return sharded_keys_of(self.capture().tensors)

    def unsaved_buffers(self) -> list[str]:
        return []  # an optimizer's whole state is saved

    def _check_groups(self, saved_groups: list[dict[str, Any]]) -> None:
        names = self._names_by_param()
        current = self.optimizer.param_groups
        if len(saved_groups) != len(current):
            raise CheckpointMismatchError(
                f"component {self.name!r}: checkpoint has {len(saved_groups)} parameter groups, "
                f"the optimizer has {len(current)}; build the optimizer with the same groups"
            )
        for i, (saved, live) in enumerate(zip(saved_groups, current, strict=True)):
            live_names = {names[id(p)] for p in live["params"]}
            saved_names = set(saved["params"])
            if live_names != saved_names:
                raise CheckpointMismatchError(mismatch_report(
                    f"component {self.name!r} (optimizer) parameter group {i}",
                    {"missing in checkpoint": sorted(live_names - saved_names),
                     "not in optimizer": sorted(saved_names - live_names)},
                ))

    def load_targets(self, stored: dict[str, TensorMeta], meta: dict[str, Any], strict: bool,
                     sidecar: dict[str, Any] | None) -> dict[str, torch.Tensor]:
        """Tensors to load into, one per stored entry; the optimizer is not modified yet.

        Always strict: optimizer state for a parameter the model lacks is an error."""
        extra = _require_sidecar(self.name, sidecar)
        self._check_groups(extra["param_groups"])
        params = self._params_by_name()
        targets: dict[str, torch.Tensor] = {}
        for key, item in stored.items():  # `meta` (the parameter) is the component's own
            pname, entry = _split_key(key)
            param = params.get(pname)
            if param is None:
                raise CheckpointMismatchError(
                    f"component {self.name!r}: checkpoint has optimizer state for {pname!r}, "
                    f"which is not a parameter of model component {self.model.name!r}"
                )
            existing = self.optimizer.state.get(param, {}).get(entry)
            if (isinstance(existing, torch.Tensor) and tuple(existing.shape) == item.shape
                    and existing.dtype == item.dtype):
                targets[key] = existing
            elif item.shape == tuple(param.shape):
                targets[key] = torch.empty_like(param, dtype=item.dtype)
            else:
                targets[key] = torch.empty(item.shape, dtype=item.dtype)
        return targets

    def key_differences(self, stored: dict[str, TensorMeta], meta: dict[str, Any],
                        ) -> tuple[list[str], list[str]]:
        """Nothing to report: load_targets refuses state for a parameter the model lacks,
        and parameters without saved state (never stepped) get theirs at their first step."""
        return [], []

    def apply(self, targets: dict[str, torch.Tensor], meta: dict[str, Any],
              sidecar: dict[str, Any] | None) -> None:
        """Install the loaded tensors and hyperparameters into the optimizer."""
        extra = _require_sidecar(self.name, sidecar)
        params = self._params_by_name()
        pid = {id(p): i for i, p in enumerate(self._ordered_params())}
        state: dict[int, dict[str, Any]] = {}
        for key, tensor in targets.items():
            pname, entry = _split_key(key)
            state.setdefault(pid[id(params[pname])], {})[entry] = tensor
        for pname, entries in extra["state"].items():
            state.setdefault(pid[id(params[pname])], {}).update(entries)
        groups = [
            {**{k: v for k, v in saved.items() if k != "params"},
             "params": [pid[id(p)] for p in live["params"]]}
            for saved, live in zip(extra["param_groups"], self.optimizer.param_groups, strict=True)
        ]
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        if self.exposed is not None:
            # ZeroRedundancyOptimizer copies its exposed groups' hyperparameters into the
            # local optimizer before each step: they must hold the loaded ones.
            for local, exposed in zip(self.optimizer.param_groups, self.exposed.param_groups,
                                      strict=True):
                exposed.update({k: v for k, v in local.items() if k != "params"})
