"""Model adapter: stored tensor names from a live module, with prefix rules and tied weights.

Every entry of the module's own `state_dict()` is saved and restored, or the save is refused
before any file is written (docs/exact-resume.md#what-a-model-holds). Plain dense tensors that
are the module's parameters and buffers go through DCP and load in place. Everything else is
*derived*: entries a module computes in `state_dict()` and takes back in its own
`_load_from_state_dict` (`get_extra_state()`'s `_extra_state`, a quantized Linear's packed
parameters, scale and zero point), and tensors DCP cannot store as items (quantized, sparse,
nested, tensor subclasses). Derived plain tensors still go through DCP, into temporaries; the
others go into the component's sidecar as one `torch.save` blob that must load back with
`weights_only=True`, checked at capture. A load hands all derived entries back through the
module's own `load_state_dict`, so each module restores them as it defines.
"""

from __future__ import annotations

import io
import logging
import pickle
import re
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from statereg.errors import CheckpointMismatchError, SpecError
from statereg.schemas.spec import PrefixSpec
from statereg.state.ddp import DDPBucketLayout, find_ddp
from statereg.state.protocols import TensorCapture, TensorMeta, sharded_keys_of

logger = logging.getLogger(__name__)


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


def is_plain_tensor(value: Any) -> bool:
    """Whether DCP stores `value` as a tensor item that loads back exactly, in place: a dense
    strided tensor (or Parameter), unquantized, not nested, or a DTensor of one."""
    name = type(value).__name__
    if name == "ShardedTensor":
        return True
    if name == "DTensor":
        value = value.to_local()
    return (type(value) in (torch.Tensor, nn.Parameter) and value.layout == torch.strided
            and not value.is_quantized and not value.is_nested)


def describe(value: Any) -> str:
    """What a state-dict value is, in a message."""
    if isinstance(value, torch.Tensor):
        if value.is_quantized:
            return f"a quantized tensor ({value.dtype})"
        if value.is_nested:
            return "a nested tensor"
        if value.layout != torch.strided:
            return f"a {str(value.layout).removeprefix('torch.')} tensor"
        if type(value) not in (torch.Tensor, nn.Parameter):
            return f"a tensor subclass {type(value).__qualname__}"
        return f"a tensor {list(value.shape)} {value.dtype}"
    return f"a {type(value).__qualname__}"


def _encode_entries(entries: dict[str, Any], where: str) -> bytes:
    """`torch.save` bytes of the derived entries, checked to load back with weights_only."""
    buffer = io.BytesIO()
    try:
        torch.save(entries, buffer)
    except Exception as exc:
        key = _first_refused(entries, lambda v: torch.save(v, io.BytesIO()))
        raise SpecError(
            f"{where}: state_dict() entry {key!r} cannot be saved by torch.save ({exc}); make "
            "the module's get_extra_state()/state_dict() return tensors and plain Python "
            "values, or leave the component out of the declaration"
        ) from None
    data = buffer.getvalue()
    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        key = _first_refused(entries, _round_trip)
        raise SpecError(
            f"{where}: state_dict() entry {key!r} ({describe(entries.get(key))}) would not "
            f"load back: torch.load(weights_only=True) refuses it "
            f"({_first_line(exc)}); return tensors and plain Python "
            "values from get_extra_state(), or allow its type with "
            "torch.serialization.add_safe_globals([...]) before saving and loading"
        ) from None
    return data


def _first_line(exc: BaseException) -> str:
    """An exception's first line, without terminal escapes, bounded."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()
    return (text.splitlines() or [""])[0][:200]


def _round_trip(value: Any) -> None:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    torch.load(io.BytesIO(buffer.getvalue()), map_location="cpu", weights_only=True)


def _first_refused(entries: dict[str, Any], attempt: Any) -> str:
    for key, value in entries.items():
        try:
            attempt(value)
        except Exception:
            return key
    return next(iter(entries), "?")


def _decode_entries(data: Any, where: str) -> dict[str, Any]:
    if not isinstance(data, bytes):
        raise CheckpointMismatchError(f"{where}: the sidecar's derived entries are not bytes")
    try:
        entries = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as exc:
        raise CheckpointMismatchError(
            f"{where}: the saved derived entries do not load with weights_only=True "
            f"({_first_line(exc)}); register their types with "
            "torch.serialization.add_safe_globals([...]), or load with strict=False"
        ) from None
    if not isinstance(entries, dict):
        raise CheckpointMismatchError(f"{where}: the saved derived entries are not a dict")
    return entries


def mismatch_report(what: str, problems: dict[str, list[str]]) -> str:
    """A readable multi-line report of key problems, at most 10 keys per kind."""
    lines = [f"{what} does not fit the checkpoint:"]
    for kind, keys in problems.items():
        if keys:
            more = f" (and {len(keys) - 10} more)" if len(keys) > 10 else ""
            shown = ", ".join(keys[:10]) + more
            lines.append(f"  {kind}: {shown}")
    return "\n".join(lines)


class _LiveState:
    """One reading of a module's state dict, sorted by how each entry is saved."""

    def __init__(self) -> None:
        self.tensors: dict[str, Any] = {}  # stored name -> tensor, through DCP
        self.aliases: dict[str, str] = {}  # stored name -> the stored name it is tied to
        self.derived: set[str] = set()  # stored names (in `tensors`) restored by load_state_dict
        self.entries: dict[str, Any] = {}  # stored name -> value, in the sidecar
        self.live_keys: dict[str, str] = {}  # stored name -> live state-dict key
        self.buffers: set[str] = set()  # stored names (in `tensors`) of buffers
        # state_dict()'s `_metadata`: each module's version, which its _load_from_state_dict
        # reads to tell its current layout from an old one.
        self.versions: Any = None


class ModelAdapter:
    """Reads and writes a module's state dict under stored names.

    Tied weights (two keys, one parameter) are stored once under the first key; the others are
    recorded as aliases, and since loading writes into the live tensors the tie survives.
    Derived entries (module docstring) are handed back through the module's load_state_dict.
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
        self._ddp: Any = None  # the DDP wrapping the module, once looked for (False: none)
        # Whether this component carries its DDP's bucket layout (off when the declaration
        # has a DDPBucketLayout component of its own).
        self.carry_layout = True

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

    def _wrapper(self) -> Any:
        """The DistributedDataParallel wrapping the module, or None (looked for once, and
        again if the one found no longer wraps it)."""
        if self._ddp is None or (self._ddp is not False
                                 and self._ddp.module is not self.live_module):
            self._ddp = find_ddp(self.module) or False
        return self._ddp or None

    def buffers_broadcast(self) -> bool:
        """Whether a DistributedDataParallel broadcasts rank 0's buffers over the others at
        its next training forward, making rank 0's copy the one every rank goes on with."""
        ddp = self._wrapper()
        return ddp is not None and bool(ddp.broadcast_buffers)

    def _bucket_layout(self) -> DDPBucketLayout | None:
        """The layout of the DDP wrapping the module, carried with the model so that a resume
        under DDP sums gradients in the saved run's order (state/ddp.py), unless the
        declaration carries it itself (a DDPBucketLayout component) or there is no DDP."""
        if not self.carry_layout or not (dist.is_available() and dist.is_initialized()
                                         and dist.get_world_size() > 1):
            return None
        ddp = self._wrapper()
        if ddp is None:
            return None
        try:
            return DDPBucketLayout(ddp)
        except SpecError:  # a Python reducer: no layout to carry
            return None

    def _read(self) -> _LiveState:
        state = _LiveState()
        first_by_identity: dict[int, str] = {}
        module = self.live_module
        identities = _identities(module)
        params = {id(p) for p in module.parameters()}
        trainable = ({id(p) for p in module.parameters() if p.requires_grad}
                     if self.trainable_only else None)
        live = module.state_dict()
        state.versions = getattr(live, "_metadata", None)
        for key, value in live.items():
            if trainable is not None and identities.get(key) not in trainable:
                continue
            stored = self.stored_name(key)
            if stored in state.live_keys:
                raise SpecError(
                    f"component {self.name!r}: prefix rules map two keys to {stored!r}; "
                    "adjust prefix.drop / prefix.add"
                )
            state.live_keys[stored] = key
            if not is_plain_tensor(value):
                if isinstance(value, torch.Tensor) and value.is_nested:
                    raise SpecError(
                        f"component {self.name!r} (model): entry {key!r} is a nested tensor, "
                        "which torch cannot copy into the module's buffer on load; keep it out "
                        "of the state dict (register_buffer(..., persistent=False)) or store "
                        "its parts as separate tensors"
                    )
                state.entries[stored] = value
                continue
            identity = identities.get(key)
            if identity is None:  # computed by state_dict(), not a parameter or buffer
                state.derived.add(stored)
                state.tensors[stored] = value
                continue
            # By parameter identity, not storage pointer: shards can be empty on some ranks.
            if identity in first_by_identity:
                state.aliases[stored] = first_by_identity[identity]
                continue
            first_by_identity[identity] = stored
            state.tensors[stored] = value
            if identity not in params:
                state.buffers.add(stored)
        return state

    def _live_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        state = self._read()
        return state.tensors, state.aliases

    def capture(self) -> TensorCapture:
        """Stored name -> live tensor (no copy), manifest metadata (aliases, derived names),
        and the sidecar holding the entries DCP cannot store."""
        state = self._read()
        meta: dict[str, Any] = {}
        if state.aliases:
            meta["aliases"] = state.aliases
        if state.derived:
            meta["derived"] = sorted(state.derived)
        layout = self._bucket_layout()
        if layout is not None:
            meta["ddp_layout"] = layout.state_dict()
        sidecar = None
        if state.entries:
            meta["entries"] = sorted(state.entries)
            where = f"component {self.name!r} (model)"
            sidecar = {"entries": _encode_entries(state.entries, where)}
        return TensorCapture(state.tensors, meta, sidecar, frozenset(state.buffers))

    def sharded_keys(self) -> list[str]:
        return sharded_keys_of(self._live_tensors()[0])

    def key_differences(self, stored: dict[str, TensorMeta], meta: dict,
                        ) -> tuple[list[str], list[str]]:
        """(missing, unexpected): live keys the checkpoint lacks, stored names the model lacks.

        A stored tensor under a name that is tied to another in the live model is expected;
        entries saved in the sidecar count as stored.
        """
        return self._differences(self._read(), stored, meta)

    @staticmethod
    def _differences(state: _LiveState, stored: dict[str, TensorMeta], meta: dict,
                     ) -> tuple[list[str], list[str]]:
        """`key_differences` of the live state `state`."""
        saved_aliases = set(meta.get("aliases", {}))
        saved_entries = set(meta.get("entries", []))
        live = set(state.tensors) | set(state.entries)
        missing = sorted(k for k in live
                         if k not in stored and k not in saved_aliases
                         and k not in saved_entries)
        unexpected = sorted(k for k in set(stored) | saved_entries
                            if k not in live and k not in state.aliases)
        return missing, unexpected

    def load_targets(self, stored: dict[str, TensorMeta], meta: dict, strict: bool,
                     sidecar: dict | None = None, cast: bool = False) -> dict[str, torch.Tensor]:
        """The live tensors to load into, after checking every key, shape and dtype.

        `cast` lets floating-point tensors load into another floating dtype (an imported
        bf16 Hugging Face checkpoint into a float32 model). Raises CheckpointMismatchError
        before anything is modified.
        """
        # One read of the module's state dict for both (a state_dict() of 20,000 parameters
        # costs ~0.1 CPU-s).
        state = self._read()
        tensors = state.tensors
        missing, unexpected = self._differences(state, stored, meta)
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
        if meta.get("entries") and not (isinstance(sidecar, dict) and "entries" in sidecar):
            problems["saved entries without their sidecar"] = list(meta["entries"])
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
        """Fill weights that were tied when saved but are separate tensors in this model, and
        hand derived entries back to the module's own load_state_dict."""
        if meta.get("aliases") or meta.get("derived") or meta.get("entries"):
            # Only these need the live state dict (a read of 20,000 parameters costs ~0.1 s).
            self._restore_extras(meta, targets, sidecar)
        if meta.get("ddp_layout") is not None and self.carry_layout:
            layout = self._bucket_layout()
            if layout is not None:
                layout.load_state_dict(meta["ddp_layout"])
            elif dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                logger.warning(
                    "component %r: the checkpoint carries DistributedDataParallel's gradient "
                    "bucket layout, but no DDP wraps the model yet, so the resume will not be "
                    "bit-exact under DDP; wrap the model in DDP before calling load()",
                    self.name)

    def _restore_extras(self, meta: dict, targets: dict[str, torch.Tensor],
                        sidecar: dict | None) -> None:
        """`apply`'s tied weights, derived entries and sidecar entries."""
        state = self._read()
        with torch.no_grad():
            for alias, canonical in meta.get("aliases", {}).items():
                if alias in state.tensors and canonical in targets:
                    state.tensors[alias].copy_(targets[canonical])
        restore: dict[str, Any] = {}
        for stored in meta.get("derived", []):
            if stored in targets and stored in state.live_keys:
                restore[state.live_keys[stored]] = targets[stored]
        if meta.get("entries") and isinstance(sidecar, dict) and "entries" in sidecar:
            where = f"component {self.name!r} (model)"
            for stored, value in _decode_entries(sidecar["entries"], where).items():
                if stored in state.live_keys:
                    restore[state.live_keys[stored]] = value
        if restore:
            self._load_entries(restore, state.versions)

    def _load_entries(self, entries: dict[str, Any], versions: Any) -> None:
        """Derived entries through the module's own loading, which takes them back as it
        defines (set_extra_state, packed params, quantization scale)."""
        restore = OrderedDict(entries)
        if versions is not None:
            restore._metadata = versions  # type: ignore[attr-defined]
        try:
            result = self.live_module.load_state_dict(restore, strict=False)
        except Exception as exc:
            raise CheckpointMismatchError(
                f"component {self.name!r} (model): the module refused its saved entries "
                f"{sorted(restore)[:10]} ({_first_line(exc)}); build the "
                "model as it was saved (same quantization, same extra state), or load with "
                "exclude=[...] to leave it out"
            ) from None
        refused = sorted(set(result.unexpected_keys) & set(restore))
        if refused:
            raise CheckpointMismatchError(
                f"component {self.name!r} (model): the module does not take back the saved "
                f"entries {refused[:10]}; build the model as it was saved"
            )
