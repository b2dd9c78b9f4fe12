"""Property: any nested state of tensors comes back exactly, through every backend, with
compression on and off: every dtype (bfloat16, float16, int8, bool, complex...), 0-d and
empty tensors, non-contiguous views, tensors sharing storage, and plain Python values.
STATEREG_ROUNDTRIP_EXAMPLES=500 runs more by hand."""

from __future__ import annotations

import os
import uuid
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_kit import assert_identical

import statereg

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
          torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64,
          torch.complex128]
COMPRESSION = {"none": None, "zstd": {"codec": "zstd"}}


def make(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point or dtype.is_complex:
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * 100).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(2**62)), min(info.max, 2**62), shape, generator=gen,
                         dtype=torch.int64).to(dtype)


@st.composite
def tensors(draw: Any, base: list[torch.Tensor]) -> torch.Tensor:
    """A tensor of any dtype and shape; sometimes a strided view, sometimes a view of a
    tensor drawn before (shared storage)."""
    if base and draw(st.integers(0, 4)) == 0:
        source = draw(st.sampled_from(base))
        if source.dim() and source.is_contiguous():
            return source.view(-1)[: source.numel() // 2]
        return source[..., :1] if source.dim() else source
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
    value = make(dtype, shape, draw(st.integers(0, 2**31 - 1)))
    if dtype.is_floating_point and value.numel() and draw(st.booleans()):
        value.view(-1)[0] = draw(st.sampled_from([float("inf"), float("-inf"), -0.0,
                                                 float("nan")]))
    layout = draw(st.sampled_from(["plain", "transposed", "strided"]))
    if layout == "transposed" and value.dim() >= 2:
        value = value.transpose(0, 1)
    elif layout == "strided" and value.dim() >= 1:
        value = value[::2]
    base.append(value)
    return value


@st.composite
def states(draw: Any) -> dict[str, Any]:
    base: list[torch.Tensor] = []
    leaves = tensors(base) | st.integers(-(2**40), 2**40) | st.text(max_size=8) \
        | st.floats(allow_nan=False) | st.booleans() | st.none()
    nested = st.recursive(leaves, lambda inner: st.dictionaries(
        st.text("abcxyz_", min_size=1, max_size=6), inner, min_size=1, max_size=3),
        max_leaves=10)
    state = draw(st.dictionaries(st.text("abcdef", min_size=1, max_size=5), nested,
                                 min_size=1, max_size=5))
    # In every state, whatever the draw: views of one storage (a transpose, a strided
    # slice, a row, the base itself), a 0-d tensor and an empty one.
    seed = draw(st.integers(0, 2**31 - 1))
    shared = make(draw(st.sampled_from(DTYPES)), (draw(st.integers(2, 4)), 4), seed)
    state["views"] = {"base": shared, "transposed": shared.t(), "strided": shared[:, ::2],
                      "row": shared[1]}
    state["scalar"] = make(draw(st.sampled_from(DTYPES)), (), seed + 1)
    state["empty"] = make(draw(st.sampled_from(DTYPES)), (0, 3), seed + 2)
    return state


class Holder:
    """A custom component holding a nested state dict."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


def blank(value: Any) -> Any:
    """A target of the same structure with other values (fresh, contiguous tensors)."""
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value, memory_format=torch.contiguous_format) \
            if value.dtype != torch.bool else torch.zeros(value.shape, dtype=torch.bool)
    if isinstance(value, dict):
        return {k: blank(v) for k, v in value.items()}
    return value


def same_nan_aware(actual: Any, expected: Any, where: str = "state") -> None:
    """Exact equality; tensors compared by their bytes (so NaN, -0.0 and inf count)."""
    assert_identical(actual, expected, where)


@pytest.mark.parametrize("compression", sorted(COMPRESSION))
@pytest.mark.parametrize("store", ["local", "memory", "s3", "gcs"], indirect=True)
def test_any_nested_state_comes_back_exactly(store, compression):
    if store.kind == "gcs" and compression != "none":
        pytest.skip("gcp-storage-emulator drops an upload's trailing \\r byte (see the test "
                    "below); a compressed file may end in any byte. Real GCS keeps it")
    storage: dict[str, Any] = {"url": store.url, "options": store.options}
    if COMPRESSION[compression] is not None:
        storage["compression"] = COMPRESSION[compression]
    examples = int(os.environ.get("STATEREG_ROUNDTRIP_EXAMPLES", 6 if store.remote else 12))

    @settings(max_examples=examples, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(state=states())
    def round_trip(state: dict[str, Any]) -> None:
        root = f"{store.url}/{uuid.uuid4().hex[:8]}"
        decl = {"storage": {**storage, "url": root},
                "components": {"holder": {"kind": "custom", "format": "dcp"}}}
        saved = {k: v for k, v in state.items()}
        url = statereg.CheckpointManager(decl, holder=Holder(state)).save(step=1)
        codecs = {f.codec for f in statereg.read_manifest(url, store.options).files
                  if f.path.endswith(".distcp")}
        if compression == "none":
            assert codecs == {"none"}, codecs
        else:
            assert codecs and all(c.startswith("zstd") for c in codecs), codecs
        target = Holder(blank(state))
        statereg.CheckpointManager(decl, holder=target).load(verify="full")
        same_nan_aware(target.state, saved)

    round_trip()


@pytest.mark.parametrize("store", ["gcs"], indirect=True)
def test_the_gcs_emulator_drops_a_trailing_carriage_return(store):
    """Why the compressed GCS round trip is skipped. Once this fails, the emulator is fixed:
    remove the skip above."""
    from statereg.backends.registry import open_backend

    backend = open_backend(store.url, store.options)
    backend.write_bytes("probe", b"abc\r")
    assert backend.read_bytes("probe") == b"abc"
