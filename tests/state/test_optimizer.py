"""Optimizer state: keyed by parameter name, restored exactly into a freshly built optimizer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import statereg


class WithUnused(nn.Module):
    """TinyNet-like model with a layer that never takes part in forward (so gets no grad)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 1)
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = WithUnused()
    decay = [model.fc1.weight, model.fc2.weight, model.unused.weight]
    no_decay = [model.fc1.bias, model.fc2.bias, model.unused.bias]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-2, betas=(0.8, 0.95),
    )
    return model, optimizer


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(99)
    return [(torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen))
            for _ in range(n)]


def state_by_name(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: entries for p, entries in optimizer.state.items()}


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


@pytest.fixture
def trained(make_spec, train_step):
    """A model and AdamW after 3 steps, saved as checkpoint 3."""
    model, optimizer = build(seed=0)
    for batch in batches(3):
        train_step(model, optimizer, batch)
    spec = make_spec("model", "optimizer")
    statereg.CheckpointManager(spec, model=model, optimizer=optimizer).save(step=3)
    return spec, model, optimizer


def test_resume_into_a_fresh_adamw_restores_every_state_tensor(trained):
    spec, model, optimizer = trained
    fresh_model, fresh_opt = build(seed=1)
    assert len(fresh_opt.state) == 0

    statereg.CheckpointManager(spec, model=fresh_model, optimizer=fresh_opt).load()

    saved, loaded = state_by_name(model, optimizer), state_by_name(fresh_model, fresh_opt)
    assert set(loaded) == set(saved)
    for pname, entries in saved.items():
        assert set(loaded[pname]) == set(entries) == {"step", "exp_avg", "exp_avg_sq"}
        for key, value in entries.items():
            restored = loaded[pname][key]
            assert restored.dtype == value.dtype, (pname, key)
            assert torch.equal(restored, value), (pname, key)
    assert hyperparameters(fresh_opt) == hyperparameters(optimizer)
    assert fresh_opt.param_groups[0]["betas"] == (0.8, 0.95)
    assert [len(g["params"]) for g in fresh_opt.param_groups] == [3, 3]


def test_a_parameter_without_gradient_has_no_state_before_or_after(trained):
    spec, model, optimizer = trained
    assert model.unused.weight not in optimizer.state
    assert model.unused.bias not in optimizer.state

    fresh_model, fresh_opt = build(seed=1)
    statereg.CheckpointManager(spec, model=fresh_model, optimizer=fresh_opt).load()

    assert fresh_model.unused.weight not in fresh_opt.state
    assert fresh_model.unused.bias not in fresh_opt.state
    assert len(fresh_opt.state) == 4


def test_adam_step_counter_is_not_advanced_by_loading(trained):
    spec, _, _ = trained
    fresh_model, fresh_opt = build(seed=1)
    statereg.CheckpointManager(spec, model=fresh_model, optimizer=fresh_opt).load()

    steps = {n: e["step"].item() for n, e in state_by_name(fresh_model, fresh_opt).items()}
    assert steps == {"fc1.weight": 3.0, "fc1.bias": 3.0, "fc2.weight": 3.0, "fc2.bias": 3.0}


def test_training_continued_after_load_matches_the_original_bit_for_bit(trained, train_step):
    spec, model, optimizer = trained
    fresh_model, fresh_opt = build(seed=1)
    statereg.CheckpointManager(spec, model=fresh_model, optimizer=fresh_opt).load()

    for batch in batches(8)[3:]:
        assert torch.equal(train_step(model, optimizer, batch),
                           train_step(fresh_model, fresh_opt, batch))
    for (name, a), (_, b) in zip(model.named_parameters(), fresh_model.named_parameters(),
                                 strict=True):
        assert torch.equal(a, b), name


def test_loading_overwrites_existing_optimizer_state(trained, train_step):
    spec, model, optimizer = trained
    other_model, other_opt = build(seed=1)
    for batch in batches(10):
        train_step(other_model, other_opt, batch)

    statereg.CheckpointManager(spec, model=other_model, optimizer=other_opt).load()

    saved, loaded = state_by_name(model, optimizer), state_by_name(other_model, other_opt)
    for pname, entries in saved.items():
        for key, value in entries.items():
            assert torch.equal(loaded[pname][key], value), (pname, key)


def test_optimizer_state_is_portable_between_wrappings(make_spec, train_step):
    class Wrapper(nn.Module):
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model = model

    model, optimizer = build(seed=0)
    for batch in batches(2):
        train_step(model, optimizer, batch)
    wrapped_spec = make_spec(components={"model": {"kind": "model", "prefix": {"drop": "model."}},
                                         "optimizer": {"kind": "optimizer"}})
    statereg.CheckpointManager(wrapped_spec, model=Wrapper(model), optimizer=optimizer).save(2)

    fresh_model, fresh_opt = build(seed=1)
    statereg.CheckpointManager(make_spec("model", "optimizer"), model=fresh_model,
                               optimizer=fresh_opt).load()

    saved, loaded = state_by_name(model, optimizer), state_by_name(fresh_model, fresh_opt)
    assert set(saved) == set(loaded)
    for pname, entries in saved.items():
        for key, value in entries.items():
            assert torch.equal(loaded[pname][key], value), (pname, key)


def test_different_parameter_groups_are_a_mismatch(trained):
    spec, _, _ = trained
    torch.manual_seed(1)
    fresh_model = WithUnused()
    one_group = torch.optim.AdamW(fresh_model.parameters(), lr=1e-2)

    with pytest.raises(statereg.CheckpointMismatchError, match="2 parameter groups") as info:
        statereg.CheckpointManager(spec, model=fresh_model, optimizer=one_group).load()
    assert "the optimizer has 1" in str(info.value)
    assert len(one_group.state) == 0


def test_group_membership_change_names_the_parameters(trained):
    spec, _, _ = trained
    torch.manual_seed(1)
    m = WithUnused()
    swapped = torch.optim.AdamW(
        [{"params": [m.fc1.weight, m.fc2.weight, m.unused.weight, m.fc1.bias]},
         {"params": [m.fc2.bias, m.unused.bias]}], lr=1e-2)

    with pytest.raises(statereg.CheckpointMismatchError) as info:
        statereg.CheckpointManager(spec, model=m, optimizer=swapped).load()
    message = str(info.value)
    assert "parameter group 0" in message
    assert "missing in checkpoint: fc1.bias" in message


def test_an_optimizer_over_foreign_parameters_is_a_spec_error(make_spec):
    model, _ = build(seed=0)
    stranger = nn.Linear(3, 5)
    optimizer = torch.optim.SGD(list(model.parameters()) + list(stranger.parameters()), lr=0.1)
    with pytest.raises(statereg.SpecError, match=r"parameter of shape \[5, 3\]"):
        statereg.CheckpointManager(make_spec("model", "optimizer"), model=model,
                                   optimizer=optimizer)  # refused at construction


def test_an_optimizer_component_needs_an_optimizer(make_spec):
    model, _ = build(seed=0)
    with pytest.raises(statereg.SpecError, match="declared kind 'optimizer' but got dict"):
        statereg.CheckpointManager(make_spec("model", "optimizer"), model=model, optimizer={})


def test_sgd_momentum_round_trips(make_spec, train_step):
    torch.manual_seed(0)
    model = WithUnused()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    for batch in batches(2):
        train_step(model, optimizer, batch)
    spec = make_spec("model", "optimizer")
    statereg.CheckpointManager(spec, model=model, optimizer=optimizer).save(step=2)

    torch.manual_seed(1)
    fresh_model = WithUnused()
    fresh_opt = torch.optim.SGD(fresh_model.parameters(), lr=0.5)
    statereg.CheckpointManager(spec, model=fresh_model, optimizer=fresh_opt).load()

    assert fresh_opt.param_groups[0]["momentum"] == 0.9
    assert fresh_opt.param_groups[0]["nesterov"] is True
    assert fresh_opt.param_groups[0]["lr"] == 0.1
    assert torch.equal(fresh_opt.state[fresh_model.fc1.weight]["momentum_buffer"],
                       optimizer.state[model.fc1.weight]["momentum_buffer"])
