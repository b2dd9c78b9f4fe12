"""The `json` format: small non-tensor state (scheduler, dataloader, RNG) as tagged JSON.

Loading never unpickles: only JSON types and a closed set of tags (tuple, bytes, float
specials, non-string dict keys, torch tensors and numpy arrays as raw bytes) are understood.
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any

import numpy as np
import torch

from statereg.errors import CorruptCheckpointError, SpecError

_TAGS = ("__tuple__", "__bytes__", "__float__", "__items__", "__tensor__", "__ndarray__",
         "__npscalar__")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _encode(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, (list, tuple)):
        items = [_encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else {"__tuple__": items}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not any(k in _TAGS for k in value):
            return {k: _encode(v, f"{where}.{k}") for k, v in value.items()}
        return {"__items__": [[_encode(k, where), _encode(v, f"{where}.{k}")]
                              for k, v in value.items()]}
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, torch.Tensor):
        cpu = value.detach().cpu().contiguous()
        raw = cpu.reshape(-1).view(torch.uint8) if cpu.numel() else cpu
        data = raw.numpy().tobytes() if cpu.numel() else b""
        return {"__tensor__": {"dtype": _dtype_name(cpu.dtype), "shape": list(cpu.shape),
                               "data": base64.b64encode(data).decode()}}
    if isinstance(value, np.ndarray):
        arr = np.ascontiguousarray(value)
        return {"__ndarray__": {"dtype": arr.dtype.str, "shape": list(arr.shape),
                                "data": base64.b64encode(arr.tobytes()).decode()}}
    if isinstance(value, np.generic):
        return {"__npscalar__": {"dtype": value.dtype.str, "value": _encode(value.item(), where)}}
    raise SpecError(
        f"{where}: a value of type {type(value).__name__} cannot be stored in the json format; "
        "return only numbers, strings, lists, dicts, tensors or numpy arrays from state_dict()"
    )


def _decode(value: Any, where: str) -> Any:
    if isinstance(value, list):
        return [_decode(v, where) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        (tag, body), = value.items()
        if tag == "__tuple__":
            return tuple(_decode(v, where) for v in body)
        if tag == "__bytes__":
            return base64.b64decode(body)
        if tag == "__float__":
            return float(body)
        if tag == "__items__":
            return {_decode(k, where): _decode(v, where) for k, v in body}
        if tag == "__tensor__":
            dtype = getattr(torch, body["dtype"], None)
            if not isinstance(dtype, torch.dtype):
                raise CorruptCheckpointError(f"{where}: unknown tensor dtype {body['dtype']!r}")
            data = bytearray(base64.b64decode(body["data"]))
            flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0)
            return flat.view(dtype).reshape(body["shape"]).clone() if data else torch.empty(
                body["shape"], dtype=dtype)
        if tag == "__ndarray__":
            return np.frombuffer(base64.b64decode(body["data"]), dtype=np.dtype(body["dtype"])
                                 ).reshape(body["shape"]).copy()
        if tag == "__npscalar__":
            return np.dtype(body["dtype"]).type(_decode(body["value"], where))
    return {k: _decode(v, where) for k, v in value.items()}


def encode_state(state: Any, where: str) -> bytes:
    """Serialize a state object; `where` names it in errors (e.g. the component)."""
    return json.dumps(_encode(state, where), separators=(",", ":")).encode()


def decode_state(data: bytes, where: str) -> Any:
    """Parse bytes written by `encode_state`; damage is a CorruptCheckpointError naming `where`."""
    try:
        return _decode(json.loads(data.decode("utf-8")), where)
    except CorruptCheckpointError:
        raise
    except (ValueError, TypeError, KeyError, RuntimeError) as exc:
        raise CorruptCheckpointError(f"{where}: state cannot be decoded ({exc})") from None
