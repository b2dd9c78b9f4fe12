"""statereg.integrations.torchtitan: a TorchTitan-style loop (tiny transformer with dropout,
FSDP2 on 2 gloo ranks, AdamW, a per-step LambdaLR, a StatefulDataLoader over a
DistributedSampler) stopped after a save and resumed in fresh processes: every later loss is
bit-identical. Then a world-size change, S3, Hugging Face in and out, seed checkpoints and
several model parts.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from harness import run_ranks

import statereg
from statereg.integrations.torchtitan import TitanCheckpointManager

VOCAB, DIM, SEQ = 32, 16, 8
STEPS = 10


class Block(nn.Module):
    """Pre-norm causal self-attention and an MLP, each with dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.wo = nn.Linear(DIM, DIM)
        self.ffn_norm = nn.LayerNorm(DIM)
        self.ffn = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Dropout(0.2),
                                 nn.Linear(4 * DIM, DIM))
        self.drop = nn.Dropout(0.2)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.attention_norm(h)).chunk(3, dim=-1)
        h = h + self.drop(self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True)))
        return h + self.ffn(self.ffn_norm(h))


class TinyLM(nn.Module):
    """TorchTitan's model shape: tok_embeddings, layers (a ModuleDict, so a pipeline split
    keeps the full model's names), norm, output; a part lacking one skips it."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings: nn.Module | None = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(2)})
        self.norm: nn.Module | None = nn.LayerNorm(DIM)
        self.output: nn.Module | None = nn.Linear(DIM, VOCAB)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(h) if self.tok_embeddings is not None else h
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


class TrainState:
    """TorchTitan's train_state: the step and the epoch, Stateful."""

    def __init__(self) -> None:
        self.step = 0
        self.epoch = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.epoch = state["step"], state["epoch"]


def dataset() -> TensorDataset:
    tokens = torch.randint(0, VOCAB, (48, SEQ + 1), generator=torch.Generator().manual_seed(3))
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def build(rank: int, world: int, parts: int = 1) -> dict[str, Any]:
    """The run's objects, the same on every launch; dropout streams differ per rank."""
    from torch.distributed.fsdp import fully_shard
    from torchdata.stateful_dataloader import StatefulDataLoader

    torch.manual_seed(0)
    model = TinyLM()
    if world > 1:
        for layer in model.layers.values():
            fully_shard(layer)
        fully_shard(model)
    if parts == 1:
        model_parts: list[nn.Module] = [model]
    else:  # two pipeline stages on this rank, named as in the full model
        first, second = TinyLM(), TinyLM()
        first.load_state_dict(model.state_dict())
        second.load_state_dict(model.state_dict())
        del first.layers["1"]
        first.norm = first.output = None
        del second.layers["0"]
        second.tok_embeddings = None
        model_parts = [first, second]
    optimizers = [torch.optim.AdamW(p.parameters(), lr=1e-2) for p in model_parts]
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + 0.1 * s))
                  for o in optimizers]
    data = dataset()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=7)
    loader = StatefulDataLoader(data, batch_size=4, sampler=sampler)
    torch.manual_seed(100 + rank)
    return {"parts": model_parts, "optimizers": optimizers, "schedulers": schedulers,
            "sampler": sampler, "loader": loader, "train_state": TrainState()}


def manager(run: dict[str, Any], config: dict[str, Any], **options: Any,
            ) -> TitanCheckpointManager:
    parts, opts, scheds = run["parts"], run["optimizers"], run["schedulers"]
    return TitanCheckpointManager(
        run["loader"], parts if len(parts) > 1 else parts[0],
        opts if len(opts) > 1 else opts[0], scheds if len(scheds) > 1 else scheds[0],
        {"train_state": run["train_state"]}, config, **options)


def train(rank: int, world: int, config: dict[str, Any], steps: int = STEPS,
          stop_at: int | None = None, parts: int = 1, on_step: Any = None,
          **options: Any) -> dict[int, float]:
    """TorchTitan's Trainer.train: load, then step / maybe_wait_for_staging / save."""
    run = build(rank, world, parts)
    ckpt = manager(run, config, **options)
    state, losses = run["train_state"], {}
    ckpt.load()
    while state.step < steps:
        run["sampler"].set_epoch(state.epoch)
        for x, y in run["loader"]:
            state.step += 1
            h = x
            for part in run["parts"]:
                h = part(h)
            loss = F.cross_entropy(h.reshape(-1, VOCAB), y.reshape(-1))
            loss.backward()
            ckpt.maybe_wait_for_staging()
            for opt, sched in zip(run["optimizers"], run["schedulers"], strict=True):
                opt.step()
                sched.step()
                opt.zero_grad()
            losses[state.step] = loss.item()
            ckpt.save(state.step, last_step=state.step == steps)
            if on_step is not None:
                on_step(state.step, run)
            if state.step in (steps, stop_at):
                break
        else:
            state.epoch += 1
        if state.step == stop_at:
            break
    ckpt.close()
    return losses


def full_state(run: dict[str, Any]) -> dict[str, Any]:
    """Every tensor of the model and optimizer whole (collective for DTensors)."""
    def whole(t: Any) -> Any:
        return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()

    model = {k: whole(v) for k, v in run["parts"][0].state_dict().items()}
    names = {id(p): n for n, p in run["parts"][0].named_parameters()}
    optim = {f"{names[id(p)]}.{k}": whole(v) for p, s in run["optimizers"][0].state.items()
             for k, v in s.items()}
    return {"model": model, "optimizer": optim,
            "scheduler": run["schedulers"][0].state_dict(),
            "train_state": run["train_state"].state_dict()}


FSDP_CONFIG = {"interval": 4, "keep_latest_k": 0, "async_mode": "async_with_pinned_mem"}


def _reference_then_stopped(rank: int, world: int, tmp: str) -> None:
    def keep_step_4(step: int, run: dict[str, Any]) -> None:
        if step == 4:
            state = full_state(run)
            if rank == 0:
                torch.save(state, f"{tmp}/state4.pt")

    ref = train(rank, world, {**FSDP_CONFIG, "folder": f"{tmp}/ref"}, on_step=keep_step_4)
    stopped = train(rank, world, {**FSDP_CONFIG, "folder": f"{tmp}/run"}, stop_at=6)
    Path(f"{tmp}/losses-{rank}.json").write_text(json.dumps({"ref": ref, "stopped": stopped}))


def _resume(rank: int, world: int, tmp: str) -> None:
    resumed = train(rank, world, {**FSDP_CONFIG, "folder": f"{tmp}/run"})
    Path(f"{tmp}/resumed-{rank}.json").write_text(json.dumps(resumed))


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two gloo ranks, FSDP2: an uninterrupted run (saves at 4, 8; model only at 10) and a
    run stopped at step 6 after its save at 4; then the second resumed in new processes."""
    tmp = tmp_path_factory.mktemp("titan")
    run_ranks(2, _reference_then_stopped, tmp, str(tmp))
    run_ranks(2, _resume, tmp, str(tmp))
    return tmp


def test_fsdp2_resume_in_fresh_processes_is_bit_identical(fsdp_runs: Path) -> None:
    for rank in range(2):
        runs = json.loads((fsdp_runs / f"losses-{rank}.json").read_text())
        resumed = json.loads((fsdp_runs / f"resumed-{rank}.json").read_text())
        ref = runs["ref"]
        assert sorted(map(int, runs["stopped"])) == list(range(1, 7))
        assert all(runs["stopped"][s] == ref[s] for s in runs["stopped"])
        # Resumed from step 4 (mid-epoch: 6 batches per rank per epoch), across the epoch end.
        assert sorted(map(int, resumed)) == list(range(5, STEPS + 1))
        assert {s: resumed[s] for s in resumed} == {s: ref[s] for s in resumed}, rank
    # The saves TorchTitan's settings asked for: every 4 steps, the last one model only.
    steps = {statereg.read_manifest(u).step: statereg.read_manifest(u).components
             for u in statereg.CheckpointManager(
                 {"storage": {"url": str(fsdp_runs / "run")},
                  "components": {"model": {"kind": "model", "required": False}}}).list()}
    assert set(steps) == {4, 8, 10}
    assert steps[10] == {"model": steps[10]["model"]} and "optimizer" in steps[8]


def test_world_size_change_to_one_is_refused_then_loads_without_per_rank_state(
        fsdp_runs: Path) -> None:
    """2 -> 1 rank: the data position and the dropout streams are per rank, so an exact
    resume is impossible and load() refuses, naming both; excluding them, the model,
    optimizer, scheduler and train state load resharded, bit for bit."""
    run = build(0, 1)
    config = {**FSDP_CONFIG, "folder": str(fsdp_runs / "ref"), "load_step": 4}
    with pytest.raises(statereg.CheckpointMismatchError) as refused:
        manager(run, config).load()
    message = str(refused.value)
    assert "'dataloader'" in message and "'rng'" in message
    assert "checkpoint=2, current=1" in message

    run = build(0, 1)
    ckpt = manager(run, {**config, "exclude_from_loading": ["dataloader", "rng"]})
    assert ckpt.load() is True
    ckpt.close()
    saved, now = torch.load(fsdp_runs / "state4.pt"), full_state(run)
    assert saved["train_state"] == now["train_state"] == {"step": 4, "epoch": 0}
    assert saved["scheduler"] == now["scheduler"]
    for part in ("model", "optimizer"):
        assert saved[part].keys() == now[part].keys() and saved[part]
        for key, tensor in saved[part].items():
            assert torch.equal(tensor, now[part][key]), key


def test_load_step_that_was_never_saved_names_the_saved_steps(fsdp_runs: Path) -> None:
    run = build(0, 1)
    ckpt = manager(run, {**FSDP_CONFIG, "folder": str(fsdp_runs / "ref"), "load_step": 5})
    with pytest.raises(statereg.CheckpointNotFoundError,
                       match=r"load_step=5: .* committed steps: 4, 8, 10"):
        ckpt.load()


@pytest.mark.parametrize("store", ["s3"], indirect=True)
def test_s3_by_changing_only_the_folder_and_a_model_only_load_through_it(
        store: Any, tmp_path: Path) -> None:
    config = {"interval": 2, "keep_latest_k": 1, "async_mode": "async"}
    ref = train(0, 1, {**config, "folder": str(tmp_path / "local")}, steps=4)
    on_s3 = {**config, "folder": store.url}
    s3 = {"storage_options": store.options}
    stopped = train(0, 1, on_s3, steps=4, stop_at=3, **s3)
    resumed = train(0, 1, on_s3, steps=4, **s3)
    assert {**stopped, **resumed} == ref and min(resumed) == 3
    # keep_latest_k: 1 (statereg deletes only after the next commit, so 1 is safe): step 2
    # outlived by nothing yet, the model-only last save at 4 beside it (TorchTitan does not
    # purge at the last save either).
    kept = {f.split("/")[0] for f in store.files() if f.startswith("step_")}
    assert sorted(kept) == ["step_00000002", "step_00000004"]

    # A fine-tune starts from the S3 checkpoint's weights, nothing else.
    run = build(0, 1)
    ckpt = manager(run, {"folder": f"{store.url}-finetune",
                         "initial_load_path": f"{store.url}/step_00000002"}, **s3)
    assert ckpt.load() is True
    ckpt.close()
    pretrained = build(0, 1)
    manager(pretrained, {**on_s3, "load_step": 2}, **s3).load()
    for key, tensor in pretrained["parts"][0].state_dict().items():
        assert torch.equal(run["parts"][0].state_dict()[key], tensor), key
    assert not run["optimizers"][0].state and run["train_state"].step == 0
    # exclude_from_loading on the same S3 root: the model and train state only.
    run = build(0, 1)
    excluded = ["optimizer", "lr_scheduler", "dataloader", "rng"]
    ckpt = manager(run, {**on_s3, "load_step": 2, "exclude_from_loading": excluded}, **s3)
    assert ckpt.load() is True
    assert run["train_state"].step == 2 and not run["optimizers"][0].state


def test_initial_load_from_hugging_face_and_last_save_exported_in_bfloat16(
        tmp_path: Path) -> None:
    torch.manual_seed(5)
    pretrained = TinyLM()
    hf = tmp_path / "hf-in"
    hf.mkdir()
    safetensors.torch.save_file(pretrained.state_dict(), str(hf / "model.safetensors"))
    config = {"folder": str(tmp_path / "ckpt"), "interval": 100, "initial_load_path": str(hf),
              "initial_load_in_hf": True, "last_save_in_hf": True, "export_dtype": "bfloat16"}

    loaded_before_training: dict[str, torch.Tensor] = {}

    def record(step: int, run: dict[str, Any]) -> None:
        if step == 3:
            loaded_before_training.update(run["parts"][0].state_dict())

    run = build(0, 1)
    ckpt = manager(run, config)
    assert ckpt.load() is True
    for key, tensor in pretrained.state_dict().items():
        assert torch.equal(run["parts"][0].state_dict()[key], tensor), key
    ckpt.close()
    train(0, 1, config, steps=3, on_step=record)
    final = {k: v.detach().clone() for k, v in loaded_before_training.items()}

    out = tmp_path / "ckpt" / "hf" / "step-3"
    exported: dict[str, torch.Tensor] = {}
    for file in sorted(out.glob("*.safetensors")):
        exported.update(safetensors.torch.load_file(str(file)))
    assert exported.keys() == final.keys()
    for key, tensor in final.items():
        assert exported[key].dtype == torch.bfloat16, key
        assert torch.equal(exported[key], tensor.to(torch.bfloat16)), key
    # The last save is a model-only statereg checkpoint; a later load() takes the model.
    assert statereg.read_manifest(str(tmp_path / "ckpt" / "step_00000003")).components.keys() \
        == {"model"}
    again = build(0, 1)
    ckpt = manager(again, config)
    assert ckpt.load() is True and not again["optimizers"][0].state
    for key, tensor in final.items():
        assert torch.equal(again["parts"][0].state_dict()[key], tensor), key


def test_seed_checkpoint_is_the_model_at_step_zero(tmp_path: Path) -> None:
    config = {"folder": str(tmp_path / "ckpt"), "create_seed_checkpoint": True}
    seed = build(0, 1)
    with manager(seed, config) as ckpt:
        ckpt.save(curr_step=0, last_step=True)
    assert [statereg.read_manifest(u).components.keys() for u in
            [str(tmp_path / "ckpt" / "step_00000000")]] == [{"model"}]
    torch.manual_seed(9)
    run = build(0, 1)
    for p in run["parts"][0].parameters():
        nn.init.normal_(p)
    assert manager(run, config).load() is True
    for key, tensor in seed["parts"][0].state_dict().items():
        assert torch.equal(run["parts"][0].state_dict()[key], tensor), key
    assert run["train_state"].step == 0 and not run["optimizers"][0].state


def test_two_model_parts_with_their_own_optimizers_resume_exactly(tmp_path: Path) -> None:
    """Virtual pipeline stages on one rank: one model component with the full model's keys,
    one optimizer component over both optimizers, the schedulers as a list."""
    config = {"folder": str(tmp_path / "ref"), "interval": 3, "last_save_model_only": False}
    ref = train(0, 1, config, steps=7, parts=2)
    config["folder"] = str(tmp_path / "run")
    stopped = train(0, 1, config, steps=7, stop_at=4, parts=2)
    resumed = train(0, 1, config, steps=7, parts=2)
    assert min(resumed) == 4 and {**stopped, **resumed} == ref


def test_settings_torchtitan_refuses_or_statereg_cannot_keep_are_named(tmp_path: Path) -> None:
    run = build(0, 1)
    cases = {
        "unknown key(s) intervall": {"intervall": 3},
        "export_dtype 'bfloat16' applies to the Hugging Face export": {"export_dtype":
                                                                         "bfloat16"},
        "last_save_in_hf needs last_save_model_only: true": {"last_save_in_hf": True,
                                                             "last_save_model_only": False},
        "exclude_from_loading names 'optimiser'": {"exclude_from_loading": ["optimiser"]},
        "async_mode 'pinned'": {"async_mode": "pinned"},
    }
    for message, bad in cases.items():
        with pytest.raises(statereg.SpecError, match=re.escape(message)):
            manager(run, {"folder": str(tmp_path), **bad})
    from torch.utils.data import DataLoader

    with pytest.raises(statereg.SpecError, match="StatefulDataLoader"):
        TitanCheckpointManager(DataLoader(dataset()), run["parts"][0], run["optimizers"][0],
                               checkpoint_config={"folder": str(tmp_path)})


def test_disabled_manager_neither_saves_nor_loads(tmp_path: Path) -> None:
    run = build(0, 1)
    ckpt = manager(run, {"enable": False, "folder": str(tmp_path / "none"), "interval": 1})
    assert ckpt.load() is False
    ckpt.save(1, last_step=True)
    ckpt.close()
    assert not (tmp_path / "none").exists()
    assert not dist.is_initialized()


class LoaderRecord:
    """Reads a checkpoint's dataloader component as saved."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


def test_save_between_micro_batches_commits_nothing(tmp_path: Path) -> None:
    """A loop with two micro-batches per optimizer step that calls save() after each, with
    the steps done so far: only the saves after an optimizer step commit (the first call,
    step 0 after one micro-batch, used to commit), so each checkpoint's data position is two
    batches per step."""
    run = build(0, 1)
    config = {"folder": str(tmp_path / "ckpt"), "interval": 2, "keep_latest_k": 0,
              "last_save_model_only": False}
    ckpt = manager(run, config)
    assert ckpt.spec.save.async_mode == "thread"  # asynchronous unless async_mode says
    assert ckpt.load() is False
    (optimizer,), step = run["optimizers"], 0
    for micro, (x, y) in enumerate(run["loader"]):
        h = run["parts"][0](x)
        (F.cross_entropy(h.reshape(-1, VOCAB), y.reshape(-1)) / 2).backward()
        if micro % 2 == 1:
            optimizer.step()
            optimizer.zero_grad()
            step += 1
        ckpt.save(step)
    ckpt.close()
    steps = sorted(int(p.name.removeprefix("step_")) for p in (tmp_path / "ckpt").glob("step_*"))
    assert steps == [2, 4, 6]
    record = LoaderRecord()
    spec = {"storage": {"url": str(tmp_path / "ckpt")},
            "components": {"dataloader": {"kind": "dataloader"}}}
    with statereg.CheckpointManager(spec, dataloader=record) as reader:
        for saved in steps:
            reader.load(step=saved, include=["dataloader"])
            assert record.state["_num_yielded"] == 2 * saved
    off = manager(build(0, 1), {**config, "async_mode": "disabled"})
    assert off.spec.save.async_mode == "off"
    off.close()


def test_a_resume_with_another_dataloader_is_refused_naming_the_change(tmp_path: Path) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    config = {"folder": str(tmp_path / "ckpt"), "interval": 2}
    train(0, 1, config, steps=4, stop_at=3)  # saved at step 2, mid-epoch
    run = build(0, 1)
    run["loader"] = StatefulDataLoader(dataset(), batch_size=8, sampler=run["sampler"])
    with manager(run, config) as ckpt, pytest.raises(statereg.CheckpointMismatchError, match=(
            r"component 'dataloader': the data loader is not the one the checkpoint saved "
            r"\(batch size 4 -> 8\)")):
        ckpt.load()
