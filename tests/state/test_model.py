"""Model state: stored names follow the prefix rules, wrappers vanish, tied weights stay tied."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import statereg
from statereg.schemas import PrefixSpec
from statereg.state.model import to_stored_name, unwrap_module


class Wrapper(nn.Module):
    """What a training harness often does: hold the real model under `.model`."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


class TiedLM(nn.Module):
    """An embedding and an output head sharing one weight."""

    def __init__(self, tie: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(12, 6)
        self.body = nn.Linear(6, 6)
        self.head = nn.Linear(6, 12, bias=False)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.emb(tokens))))


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def stored_names(root) -> set[str]:
    """Tensor names in the newest checkpoint's model component, read from DCP metadata."""
    from torch.distributed.checkpoint import FileSystemReader

    step = sorted(p for p in root.iterdir() if p.name.startswith("step_"))[-1]
    metadata = FileSystemReader(str(step / "model")).read_metadata()
    return set(metadata.state_dict_metadata)


def model_manager(make_spec, model, prefix=None, **kwargs):
    decl = {"kind": "model"} if prefix is None else {"kind": "model", "prefix": prefix}
    return statereg.CheckpointManager(make_spec(components={"model": decl}, **kwargs),
                                      model=model)


# -- prefix rules ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "prefix", "stored"),
    [
        ("model.fc1.weight", None, "model.fc1.weight"),
        ("model.fc1.weight", {"drop": "model."}, "fc1.weight"),
        ("fc1.weight", {"drop": "model."}, "fc1.weight"),
        ("fc1.weight", {"add": "backbone."}, "backbone.fc1.weight"),
        ("model.fc1.weight", {"drop": "model.", "add": "backbone."}, "backbone.fc1.weight"),
        ("encoder.model.x", {"drop": "model."}, "encoder.model.x"),
    ],
)
def test_live_keys_map_to_stored_names(key, prefix, stored):
    rule = None if prefix is None else PrefixSpec(**prefix)
    assert to_stored_name(key, rule) == stored


def test_a_wrapped_model_saves_bare_keys_that_load_into_the_bare_model(make_spec, make_model,
                                                                       tmp_path):
    wrapped = Wrapper(make_model(seed=1))
    model_manager(make_spec, wrapped, prefix={"drop": "model."}).save(step=1)

    assert stored_names(tmp_path / "ckpt") == {"fc1.weight", "fc1.bias", "fc2.weight",
                                               "fc2.bias"}
    bare = make_model(seed=2)
    model_manager(make_spec, bare).load()
    assert_same_state(bare, wrapped.model)


def test_a_bare_checkpoint_loads_back_into_the_wrapper(make_spec, make_model):
    bare = make_model(seed=1)
    model_manager(make_spec, bare).save(step=1)

    wrapped = Wrapper(make_model(seed=2))
    model_manager(make_spec, wrapped, prefix={"drop": "model."}).load()
    assert_same_state(wrapped.model, bare)


def test_add_prefix_is_undone_on_load(make_spec, make_model, tmp_path):
    model = make_model(seed=1)
    model_manager(make_spec, model, prefix={"add": "student."}).save(step=1)
    assert stored_names(tmp_path / "ckpt") == {"student.fc1.weight", "student.fc1.bias",
                                               "student.fc2.weight", "student.fc2.bias"}

    fresh = make_model(seed=2)
    model_manager(make_spec, fresh, prefix={"add": "student."}).load()
    assert_same_state(fresh, model)


def test_prefix_rules_that_collapse_two_keys_are_a_spec_error(make_spec):
    class Clash(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(1))
            self.model = nn.Module()
            self.model.w = nn.Parameter(torch.ones(1))

    with pytest.raises(statereg.SpecError, match="prefix rules map two keys to 'w'"):
        model_manager(make_spec, Clash(), prefix={"drop": "model."})  # refused at construction


# -- wrappers that are not part of the model ------------------------------------------


def test_torch_compile_wrapper_is_not_saved(make_spec, make_model, tmp_path):
    model = make_model(seed=1)
    try:
        compiled = torch.compile(model, backend="eager")
    except RuntimeError as exc:  # e.g. a Python version dynamo does not support
        pytest.skip(f"torch.compile unsupported here: {exc}")
    assert any(k.startswith("_orig_mod.") for k in compiled.state_dict())
    assert unwrap_module(compiled) is model

    model_manager(make_spec, compiled).save(step=1)

    assert stored_names(tmp_path / "ckpt") == {"fc1.weight", "fc1.bias", "fc2.weight",
                                               "fc2.bias"}
    fresh = make_model(seed=2)
    model_manager(make_spec, fresh).load()
    assert_same_state(fresh, model)


def test_data_parallel_wrapper_is_not_saved(make_spec, make_model, tmp_path):
    model = make_model(seed=1)
    model_manager(make_spec, nn.DataParallel(model)).save(step=1)

    assert stored_names(tmp_path / "ckpt") == {"fc1.weight", "fc1.bias", "fc2.weight",
                                               "fc2.bias"}


# -- tied weights ---------------------------------------------------------------------


def test_tied_weights_are_stored_once_with_an_alias(make_spec, tmp_path):
    model = TiedLM()
    url = model_manager(make_spec, model).save(step=1)

    record = statereg.read_manifest(url).components["model"]
    assert record.tensors == 3  # emb.weight, body.weight, body.bias; head.weight is an alias
    assert record.meta["aliases"] == {"head.weight": "emb.weight"}
    assert stored_names(tmp_path / "ckpt") == {"emb.weight", "body.weight", "body.bias"}


def test_tie_holds_after_loading_into_a_fresh_model(make_spec):
    torch.manual_seed(0)
    model = TiedLM()
    model_manager(make_spec, model).save(step=1)

    torch.manual_seed(1)
    fresh = TiedLM()
    model_manager(make_spec, fresh).load()

    assert fresh.head.weight is fresh.emb.weight
    assert_same_state(fresh, model)
    with torch.no_grad():
        fresh.emb.weight.add_(1.0)
    assert torch.equal(fresh.head.weight, fresh.emb.weight)


def test_tied_checkpoint_fills_both_weights_of_an_untied_model(make_spec):
    torch.manual_seed(0)
    model = TiedLM()
    model_manager(make_spec, model).save(step=1)

    torch.manual_seed(1)
    untied = TiedLM(tie=False)
    model_manager(make_spec, untied).load()

    assert untied.head.weight is not untied.emb.weight
    assert torch.equal(untied.head.weight, model.emb.weight)
    assert torch.equal(untied.emb.weight, model.emb.weight)


# -- mismatches -----------------------------------------------------------------------


def test_shape_mismatch_names_the_key_and_changes_nothing(make_spec, make_model):
    model_manager(make_spec, make_model(seed=1)).save(step=1)

    other = make_model(seed=2)
    other.fc2 = nn.Linear(16, 3)
    before = copy.deepcopy(other)
    with pytest.raises(statereg.CheckpointMismatchError) as info:
        model_manager(make_spec, other).load()

    message = str(info.value)
    assert "component 'model'" in message
    assert "shape mismatch" in message
    assert "fc2.weight (checkpoint [1, 16], model [3, 16])" in message
    assert "fc2.bias (checkpoint [1], model [3])" in message
    assert "fc1" not in message
    assert_same_state(other, before)


def test_dtype_mismatch_names_the_key_and_changes_nothing(make_spec, make_model):
    model_manager(make_spec, make_model(seed=1)).save(step=1)

    other = make_model(seed=2)
    other.fc1.double()
    before = copy.deepcopy(other)
    with pytest.raises(statereg.CheckpointMismatchError) as info:
        model_manager(make_spec, other).load()

    message = str(info.value)
    assert "dtype mismatch" in message
    assert "fc1.weight (checkpoint torch.float32, model torch.float64)" in message
    assert "fc2" not in message
    assert_same_state(other, before)


def test_missing_key_names_it_and_suggests_strict_false(make_spec, make_model):
    model_manager(make_spec, make_model(seed=1)).save(step=1)

    bigger = make_model(seed=2)
    bigger.extra = nn.Linear(2, 2)
    before = copy.deepcopy(bigger)
    with pytest.raises(statereg.CheckpointMismatchError) as info:
        model_manager(make_spec, bigger).load()

    message = str(info.value)
    assert "missing in checkpoint: extra.bias, extra.weight" in message
    assert "strict=False" in message
    assert_same_state(bigger, before)


def test_unexpected_checkpoint_key_is_named(make_spec, make_model):
    saved = make_model(seed=1)
    saved.extra = nn.Linear(2, 2)
    model_manager(make_spec, saved).save(step=1)

    smaller = make_model(seed=2)
    before = copy.deepcopy(smaller)
    with pytest.raises(statereg.CheckpointMismatchError, match=r"not in model: extra\.bias"):
        model_manager(make_spec, smaller).load()
    assert_same_state(smaller, before)


def test_strict_false_loads_the_keys_that_match(make_spec, make_model, caplog):
    saved = make_model(seed=1)
    model_manager(make_spec, saved).save(step=1)

    bigger = make_model(seed=2)
    bigger.extra = nn.Linear(2, 2)
    extra_before = copy.deepcopy(bigger.extra)
    with caplog.at_level(logging.WARNING, logger="statereg"):
        result = model_manager(make_spec, bigger).load(strict=False)

    # The report says what stayed as it was, as for Hugging Face loads; so does the log.
    report = result.keys["model"]
    assert report.missing == ("extra.bias", "extra.weight")
    assert report.unexpected == ()
    assert set(report.loaded) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    assert any("strict=False" in r.getMessage() and "extra.bias" in r.getMessage()
               for r in caplog.records)

    for name in ("fc1", "fc2"):
        assert torch.equal(getattr(bigger, name).weight, getattr(saved, name).weight)
        assert torch.equal(getattr(bigger, name).bias, getattr(saved, name).bias)
    assert torch.equal(bigger.extra.weight, extra_before.weight)
    assert torch.equal(bigger.extra.bias, extra_before.bias)


def test_strict_false_still_refuses_a_shape_mismatch(make_spec, make_model):
    model_manager(make_spec, make_model(seed=1)).save(step=1)

    other = make_model(seed=2)
    other.fc2 = nn.Linear(16, 3)
    with pytest.raises(statereg.CheckpointMismatchError, match=r"fc2\.weight"):
        model_manager(make_spec, other).load(strict=False)


def test_a_model_component_needs_a_module(make_spec):
    with pytest.raises(statereg.SpecError, match="declared kind 'model' but got dict"):
        statereg.CheckpointManager(make_spec("model"), model={"weight": torch.zeros(1)})


def test_buffers_are_saved_and_restored(make_spec):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    model.train()
    model(torch.randn(8, 3))
    model_manager(make_spec, model).save(step=1)

    fresh = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    model_manager(make_spec, fresh).load()

    assert fresh[1].num_batches_tracked.item() == 1
    assert_same_state(fresh, model)
