"""Model adapter: stored tensor names from a live module, with prefix rules and tied weights."""

from __future__ import annotations

import torch
from torch import nn

from statereg.errors import CheckpointMismatchError, SpecError
from statereg.schemas.spec import PrefixSpec
from statereg.state.protocols import TensorCapture, TensorMeta, sharded_keys_of


def unwrap_module(module: nn.Module) -> nn.Module:
    """The module whose keys are canonical: strips torch.compile and DDP/DP wrappers."""
    while True:
        if hasattr(module, "_orig_mod") and isinstance(module._orig_mod, nn.Module):
            module = module._orig_mod
        elif isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            module = module.module
        else:
            return module


def to_stored_name(key: str, prefix: PrefixSpec | None) -> str:
    """Live key -> stored name: drop the `drop` prefix if present, then prepend `add`."""
    if prefix is None:
        return key
    if prefix.drop and key.startswith(prefix.drop):
        key = key[len(prefix.drop):]
    return f"{prefix.add}{key}" if prefix.add else key


def _identities(module: nn.Module) -> dict[str, int]:
    """State-dict key -> identity of the parameter or buffer behind it (tied keys share one)."""
    found = {name: id(p) for name, p in module.named_parameters(remove_duplicate=False)}
    found |= {name: id(b) for name, b in module.named_buffers(remove_duplicate=False)}
    return found


def mismatch_report(what: str, problems: dict[str, list[str]]) -> str:
    """A readable multi-line report of key problems, at most 10 keys per kind."""
    lines = [f"{what} does not fit the checkpoint:"]
    for kind, keys in problems.items():
        if keys:
            more = f" (and {len(keys) - 10} more)" if len(keys) > 10 else ""
            shown = ", ".join(keys[:10]) + more
            lines.append(f"  {kind}: {shown}")
    return "\n".join(lines)


class ModelAdapter:
    """Reads and writes a module's state dict under stored names.

    Tied weights (two keys, one parameter) are stored once under the first key; the others are
    recorded as aliases, and since loading writes into the live tensors the tie survives.
    """

    kind = "model"

    def __init__(self, name: str, module: nn.Module, prefix: PrefixSpec | None,
                 trainable_only: bool = False) -> None:
        if not isinstance(module, nn.Module):
            raise SpecError(
                f"component {name!r} is declared kind 'model' but got {type(module).__name__}; "
                "pass a torch.nn.Module"
            )
        self.name = name
        self.module = module
        self.prefix = prefix
        # Adapters / LoRA: only parameters with requires_grad are saved and loaded.
        self.trainable_only = trainable_only

    def unsaved_buffers(self) -> list[str]:
        """The buffers a `trainable_only` component leaves out of its checkpoints (none
        otherwise): a buffer that training changes (BatchNorm's running statistics in train
        mode) would not come back on a resume."""
        if not self.trainable_only:
            return []
        module = self.live_module
        buffers = {id(b) for b in module.buffers()}
        identities = _identities(module)
        return [k for k in module.state_dict() if identities.get(k) in buffers]

    @property
    def live_module(self) -> nn.Module:
        return unwrap_module(self.module)

    def stored_name(self, live_key: str) -> str:
        return to_stored_name(live_key, self.prefix)

    def _live_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        tensors: dict[str, torch.Tensor] = {}
        aliases: dict[str, str] = {}
        first_by_identity: dict[int, str] = {}
        module = self.live_module
        identities = _identities(module)
        trainable = ({id(p) for p in module.parameters() if p.requires_grad}
                     if self.trainable_only else None)
        for key, tensor in module.state_dict().items():
            if trainable is not None and identities.get(key) not in trainable:
                continue
            stored = self.stored_name(key)
            if stored in tensors or stored in aliases:
                raise SpecError(
                    f"component {self.name!r}: prefix rules map two keys to {stored!r}; "
                    "adjust prefix.drop / prefix.add"
                )
            # By parameter identity, not storage pointer: shards can be empty on some ranks.
            identity = identities.get(key, id(tensor))
            if identity in first_by_identity:
                aliases[stored] = first_by_identity[identity]
                continue
            first_by_identity[identity] = stored
            tensors[stored] = tensor
        return tensors, aliases

    def capture(self) -> TensorCapture:
        """Stored name -> live tensor (no copy), and manifest metadata (aliases)."""
        tensors, aliases = self._live_tensors()
        return TensorCapture(tensors, {"aliases": aliases} if aliases else {})

    def sharded_keys(self) -> list[str]:
        return sharded_keys_of(self._live_tensors()[0])

    def key_differences(self, stored: dict[str, TensorMeta], meta: dict,
                        ) -> tuple[list[str], list[str]]:
        """(missing, unexpected): live keys the checkpoint lacks, stored names the model lacks.

        A stored tensor under a name that is tied to another in the live model is expected.
        """
        tensors, live_aliases = self._live_tensors()
        saved_aliases = set(meta.get("aliases", {}))
        missing = sorted(k for k in tensors if k not in stored and k not in saved_aliases)
        unexpected = sorted(k for k in stored if k not in tensors and k not in live_aliases)
        return missing, unexpected

    def load_targets(self, stored: dict[str, TensorMeta], meta: dict, strict: bool,
                     sidecar: dict | None = None, cast: bool = False) -> dict[str, torch.Tensor]:
        """The live tensors to load into, after checking every key, shape and dtype.

        `cast` lets floating-point tensors load into another floating dtype (an imported
        bf16 Hugging Face checkpoint into a float32 model). Raises CheckpointMismatchError
        before anything is modified.
        """
        tensors, _ = self._live_tensors()
        missing, unexpected = self.key_differences(stored, meta)
        shape, dtype = [], []
        for key in sorted(set(tensors) & set(stored)):
            live, saved = tensors[key], stored[key]
            castable = cast and live.dtype.is_floating_point and saved.dtype.is_floating_point
            if tuple(live.shape) != saved.shape:
                shape.append(f"{key} (checkpoint {list(saved.shape)}, model {list(live.shape)})")
            elif live.dtype != saved.dtype and not castable:
                dtype.append(f"{key} (checkpoint {saved.dtype}, model {live.dtype})")
        problems = {"shape mismatch": shape, "dtype mismatch": dtype}
        if strict:
            problems = {"missing in checkpoint": missing, "not in model": unexpected, **problems}
        if any(problems.values()):
            hint = ("pass strict=False to load the keys that match"
                    if strict and (missing or unexpected) else
                    "check the model's config, or the prefix rules of the component")
            raise CheckpointMismatchError(
                mismatch_report(f"component {self.name!r} (model)", problems) + f"\n  {hint}"
            )
        return {k: t for k, t in tensors.items() if k in stored}

    def apply(self, targets: dict[str, torch.Tensor], meta: dict,
              sidecar: dict | None = None) -> None:
        """Fill weights that were tied when saved but are separate tensors in this model."""
        tensors, _ = self._live_tensors()
        with torch.no_grad():
            for alias, canonical in meta.get("aliases", {}).items():
                if alias in tensors and canonical in targets:
                    tensors[alias].copy_(targets[canonical])
