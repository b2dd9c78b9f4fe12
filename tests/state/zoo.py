"""The stateful zoo: one row per kind of stateful object torch and its ecosystem hold, each
trained, killed and resumed through statereg, and compared bit for bit with a run that never
stopped (issue 40's differential test; tests/state/test_zoo.py generates the cases).

A row is a `Trainee` subclass (the live objects one process builds, the components it declares
for them, and how a step uses them) and what the row expects under each loop: an exact resume,
or a refusal by statereg (a `StateregError` naming the offending key) before anything is
written. A cell is row x loop x kill point:

- loops: `bare` (one process), `ddp` (3 gloo ranks, DistributedDataParallel with the documented
  `ddp` component, DDPBucketLayout), `ddp_plain` (3 ranks, no `ddp` component: issue 40 wants
  that exact by default) and `fsdp2` (2 ranks, `fully_shard` on the whole model);
- kill points (`KILLS`): the resumed checkpoint was saved mid-epoch, at an epoch's end, or the
  process died in the middle of a gradient accumulation, or before the first save.

Each cell runs, on every rank: A, the uninterrupted run (no manager at all); B, the same run
saving at the cadence, which dies at the kill point; and B's restart: fresh objects built from
another seed, the global generators scrambled, `mgr.load()`, then training to the end while it
keeps saving. A restart with nothing to load (killed before the first save) starts the way
the script does, from its own seeds. The cell records every micro-batch's training loss, the
eval loss after every optimizer step (on the unwrapped model in eval mode, so each rank's own
buffers count) and a digest of the final state: every tensor of the model (non-persistent
buffers too), the optimizer, the scheduler, the loader, every other component and the global
generators, each as the hash of its bytes.
"""

from __future__ import annotations

import hashlib
import json
import random
import traceback
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import statereg
from statereg.errors import StateregError

FEATURES, BATCH, BATCHES_PER_EPOCH = 8, 4, 8  # per rank: 8 micro-batches of 4 per epoch
LOOP_WORLD = {"bare": 1, "ddp": 3, "ddp_plain": 3, "fsdp2": 2}


@dataclass(frozen=True)
class Kill:
    """Where run B dies, and the run around it (steps are optimizer steps)."""

    name: str
    accumulate: int  # micro-batches per optimizer step
    total: int  # optimizer steps of the whole run
    every: int  # the save cadence
    at: int  # B dies after this step (and its save), or inside it when mid_accumulation
    mid_accumulation: bool = False

    @property
    def steps_per_epoch(self) -> int:
        return BATCHES_PER_EPOCH // self.accumulate


KILLS = {
    # saves at 3, 6, 9, 12; dies after step 7: resumes from step 6, mid-epoch 0 (8 steps)
    "mid_epoch": Kill("mid_epoch", 1, 12, 3, 7),
    # saves at 8 (the end of epoch 0) and 12; dies after step 10: resumes at the epoch's end
    "epoch_end": Kill("epoch_end", 1, 12, 8, 10),
    # 2 micro-batches a step; saves at 3, 6; dies after the first micro-batch of step 5
    "mid_accumulation": Kill("mid_accumulation", 2, 6, 3, 5, mid_accumulation=True),
    # saves at 8 and 12; dies after step 5, before anything was saved: starts again
    "before_first_save": Kill("before_first_save", 1, 12, 8, 5),
}


@dataclass(frozen=True)
class Place:
    """Where a trainee runs: the loop and this process's rank in it."""

    loop: str
    rank: int = 0
    world: int = 1

    @property
    def distributed(self) -> bool:
        return self.loop != "bare"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _fixed(seed: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, FEATURES, generator=gen)
    return x, x.sum(dim=1, keepdim=True) * 0.5 + 0.1 * torch.randn(rows, 1, generator=gen)


EVAL_X, EVAL_Y = _fixed(99, 16)


# -- the state digest -------------------------------------------------------------------------


def _tensor_digest(t: torch.Tensor) -> str:
    """dtype, shape and a hash of the bytes: equal iff bit-identical (quantized: the integer
    values and the quantization parameters; sparse: the dense values; nested: each part)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    t = t.detach()
    if t.is_nested:
        return "nested[" + ",".join(_tensor_digest(part) for part in t.unbind()) + "]"
    if t.layout != torch.strided:
        t = t.to_dense()
    extra = ""
    if t.is_quantized:
        if t.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            extra = f":{t.q_scale().hex()}:{t.q_zero_point()}"
        else:
            extra = (f":{_tensor_digest(t.q_per_channel_scales())}"
                     f":{_tensor_digest(t.q_per_channel_zero_points())}")
        t = t.int_repr()
    data = t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{t.dtype}{list(t.shape)}{extra}:{hashlib.sha256(data).hexdigest()[:16]}"


def flatten(prefix: str, value: Any, out: dict[str, str]) -> dict[str, str]:
    """Every leaf of a (nested) state as `path -> fingerprint`; floats by their hex."""
    if isinstance(value, torch.Tensor):
        out[prefix] = _tensor_digest(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            flatten(f"{prefix}.{key}", item, out)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            flatten(f"{prefix}[{i}]", item, out)
    elif isinstance(value, float):
        out[prefix] = value.hex()
    elif isinstance(value, np.ndarray):
        out[prefix] = f"{value.dtype}{list(value.shape)}:" + hashlib.sha256(
            np.ascontiguousarray(value).tobytes()).hexdigest()[:16]
    else:
        out[prefix] = repr(value)
    return out


# -- a trainee: one process's live objects for one row -----------------------------------------


class Mlp(nn.Module):
    """The plain model every row varies: Linear -> Tanh -> Dropout -> Linear."""

    def __init__(self, dropout: float = 0.1) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, 16)
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.tanh(self.fc1(x))))


class Trainee:
    """The live objects of one process for one row, the components they are declared as, and
    how the loop trains and evaluates with them. The base is the plain run (Mlp with dropout,
    AdamW, StepLR, a shuffled StatefulDataLoader, the rng component); a row overrides the part
    it is about."""

    replicas_per_rank = 1  # a row's DistributedSampler may split the data further

    def __init__(self, place: Place, seed: int, kill: Kill) -> None:
        self.place, self.kill = place, kill
        torch.manual_seed(seed)  # everything a row builds from the global generator
        self.model = self.build_model()
        self.net = self.wrap(self.model)
        self.optimizer = self.build_optimizer()
        self.scheduler = self.build_scheduler()
        self.sampler, self.loader = self.build_loader()
        self.extra: dict[str, tuple[dict[str, Any], Any]] = self.build_extra()

    # what a row varies
    def build_model(self) -> nn.Module:
        return Mlp()

    def build_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.01)

    def build_scheduler(self) -> Any:
        return torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=3, gamma=0.7)

    def build_extra(self) -> dict[str, tuple[dict[str, Any], Any]]:
        """Other components: name -> (declaration, object)."""
        return {}

    def dataset(self, rows: int) -> Dataset:
        return TensorDataset(*_fixed(1234, rows))

    def build_sampler(self, dataset: Dataset) -> Any:
        if self.place.distributed:
            return DistributedSampler(dataset, num_replicas=self.place.world,
                                      rank=self.place.rank, shuffle=True, seed=0)
        return None

    def loader_options(self) -> dict[str, Any]:
        return {}

    def build_loader(self) -> tuple[Any, StatefulDataLoader]:
        rows = BATCH * BATCHES_PER_EPOCH * self.place.world * self.replicas_per_rank
        dataset = self.dataset(rows)
        sampler = self.build_sampler(dataset)
        loader = StatefulDataLoader(dataset, batch_size=BATCH, sampler=sampler,
                                    shuffle=sampler is None, drop_last=True,
                                    **self.loader_options())
        assert len(loader) == BATCHES_PER_EPOCH
        return sampler, loader

    def wrap(self, model: nn.Module) -> Any:
        """What the loop calls: the model itself, in DDP, or sharded by FSDP2 in place."""
        if self.place.loop in ("ddp", "ddp_plain"):
            return nn.parallel.DistributedDataParallel(model)
        if self.place.loop == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            return fully_shard(model)
        return model

    def declarations(self) -> dict[str, dict[str, Any]]:
        components: dict[str, dict[str, Any]] = {
            "model": {"kind": "model"}, "optimizer": {"kind": "optimizer", "model": "model"},
            "dataloader": {"kind": "dataloader"}, "rng": {"kind": "rng"}}
        if self.scheduler is not None:
            components["scheduler"] = {"kind": "scheduler"}
        if self.place.loop == "ddp":
            components["ddp"] = {"kind": "custom"}
        components.update({name: decl for name, (decl, _) in self.extra.items()})
        return components

    def objects(self) -> dict[str, Any]:
        objects = {"model": self.model, "optimizer": self.optimizer, "dataloader": self.loader}
        if self.scheduler is not None:
            objects["scheduler"] = self.scheduler
        if self.place.loop == "ddp":
            from statereg.state.ddp import DDPBucketLayout

            objects["ddp"] = DDPBucketLayout(self.net)
        objects.update({name: obj for name, (_, obj) in self.extra.items()})
        return objects

    # the loop's calls
    def set_epoch(self, epoch: int) -> None:
        if isinstance(self.sampler, DistributedSampler):
            self.sampler.set_epoch(epoch)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.net(x), y)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def micro_step(self, batch: Any, last: bool) -> torch.Tensor:
        """Forward and backward of one micro-batch (DDP syncs on the last one only)."""
        x, y = batch
        sync = isinstance(self.net, nn.parallel.DistributedDataParallel) and not last
        with self.net.no_sync() if sync else nullcontext():
            loss = self.loss(x, y)
            self.backward(loss / self.kill.accumulate)
        return loss.detach()

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def after_step(self, eval_loss: torch.Tensor) -> None:
        if self.scheduler is not None:
            self.scheduler.step()

    def eval_module(self) -> nn.Module:
        return self.model

    def eval_loss(self) -> torch.Tensor:
        module = self.eval_module()
        modes = [(m, m.training) for m in module.modules()]
        module.eval()
        try:
            with torch.no_grad():
                return F.mse_loss(module(EVAL_X), EVAL_Y)
        finally:
            for m, mode in modes:
                m.training = mode

    def optimizer_state(self) -> Any:
        return self.optimizer.state_dict()

    def digest(self) -> dict[str, str]:
        out: dict[str, str] = {}
        model = getattr(self.model, "_orig_mod", self.model)
        flatten("model", model.state_dict(), out)
        for name, buffer in model.named_buffers():
            flatten(f"buffer.{name}", buffer, out)  # non-persistent ones too
        flatten("optimizer", self.optimizer_state(), out)
        if self.scheduler is not None:
            flatten("scheduler", self.scheduler.state_dict(), out)
        flatten("dataloader", _without_worker_generators(self.loader.state_dict()), out)
        for name, (_, obj) in self.extra.items():
            state = obj.get_state() if isinstance(obj, torch.Generator) else obj.state_dict()
            flatten(name, state, out)
        flatten("rng.torch", torch.get_rng_state(), out)
        flatten("rng.python", random.getstate(), out)
        flatten("rng.numpy", np.random.get_state(), out)
        return out


def _without_worker_generators(state: Any) -> Any:
    """A loader's state as the uninterrupted run (no manager) has it: statereg adds each
    worker's generators to the dataset state it saves (statereg/state/loader_workers.py);
    what they decide, the batches, is compared through the losses."""
    if isinstance(state, dict):
        return {key: (value.get("dataset") if key == "dataset_state"
                      and isinstance(value, dict) and "generators" in value
                      else _without_worker_generators(value))
                for key, value in state.items()}
    return state


# -- the rows' trainees ---------------------------------------------------------------------


class BatchNorm1dTrain(Trainee):
    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(FEATURES, 16), nn.BatchNorm1d(16), nn.Tanh(),
                             nn.Linear(16, 1))


class BatchNorm1dEval(BatchNorm1dTrain):
    """BatchNorm frozen in eval mode (fine-tuning): its affine weights train, its statistics
    do not."""

    def build_model(self) -> nn.Module:
        model = super().build_model()
        with torch.no_grad():
            model[1].running_mean.uniform_(-0.5, 0.5)
            model[1].running_var.uniform_(0.5, 1.5)
        model[1].eval()
        return model


class BatchNorm2dTrain(Trainee):
    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Unflatten(1, (2, 2, 2)), nn.Conv2d(2, 4, 1), nn.BatchNorm2d(4),
                             nn.ReLU(), nn.Flatten(), nn.Linear(16, 1))


class BatchNorm2dEval(BatchNorm2dTrain):
    def build_model(self) -> nn.Module:
        model = super().build_model()
        with torch.no_grad():
            model[2].running_mean.uniform_(-0.5, 0.5)
        model[2].eval()
        return model


class Scaled(nn.Module):
    """A fixed per-feature scale in a non-persistent buffer (derived, never saved)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Mlp()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, FEATURES), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x * self.scale)


class NonPersistentBuffer(Trainee):
    def build_model(self) -> nn.Module:
        return Scaled()


class Calibrated(nn.Module):
    """Divides its output by a calibration it keeps as extra state: a call counter and a dict
    (the running maximum of its weights, the same on every rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(FEATURES, 16)
        self.head = nn.Linear(16, 1)
        self.calls = 0
        self.calibration = {"max_abs": 1.0 + torch.rand(()).item()}  # differs per seed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            peak = float(self.lin.weight.detach().abs().max())
            self.calibration["max_abs"] = 0.8 * self.calibration["max_abs"] + 0.2 * peak
        return self.head(torch.tanh(self.lin(x)) / self.calibration["max_abs"])

    def get_extra_state(self) -> dict[str, Any]:
        return {"calls": self.calls, "calibration": dict(self.calibration)}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.calls = state["calls"]
        self.calibration = dict(state["calibration"])


class ExtraState(Trainee):
    def build_model(self) -> nn.Module:
        return Calibrated()


class FrozenBackbone(nn.Module):
    """A frozen (here: quantized) backbone and a trainable float head."""

    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.backbone(x)))


class DynamicQuantized(Trainee):
    def build_model(self) -> nn.Module:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notices
            backbone = torch.ao.quantization.quantize_dynamic(
                nn.Sequential(nn.Linear(FEATURES, 16)), {nn.Linear}, dtype=torch.qint8)
        return FrozenBackbone(backbone)


class StaticQuantized(Trainee):
    def build_model(self) -> nn.Module:
        from torch.ao.quantization import DeQuantStub, QuantStub

        float_model = nn.Sequential(QuantStub(), nn.Linear(FEATURES, 16), DeQuantStub()).eval()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            float_model.qconfig = torch.ao.quantization.get_default_qconfig("x86")
            prepared = torch.ao.quantization.prepare(float_model)
            prepared(torch.randn(64, FEATURES))  # calibration: seed-dependent scales
            backbone = torch.ao.quantization.convert(prepared)
        return FrozenBackbone(backbone)


class QuantizedTable(nn.Module):
    """A quantized (qint8, per-tensor) lookup table kept as a buffer, dequantized in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Mlp()
        self.register_buffer("table", torch.quantize_per_tensor(
            torch.rand(FEATURES) + 0.5, scale=0.01, zero_point=3, dtype=torch.qint8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x * self.table.dequantize())


class QuantizedTensor(Trainee):
    def build_model(self) -> nn.Module:
        return QuantizedTable()


class WeightNorm(Trainee):
    def build_model(self) -> nn.Module:
        model = Mlp()
        torch.nn.utils.parametrizations.weight_norm(model.fc1)
        return model


class SpectralNorm(Trainee):
    """spectral_norm's power iteration updates its `_u`/`_v` buffers on every training
    forward."""

    def build_model(self) -> nn.Module:
        model = Mlp()
        torch.nn.utils.parametrizations.spectral_norm(model.fc1)
        return model


class Orthogonal(Trainee):
    def build_model(self) -> nn.Module:
        model = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                              nn.Linear(16, 1))
        torch.nn.utils.parametrizations.orthogonal(model[2])
        return model


class TiedLinear(nn.Module):
    """Two layers of the same shape holding one Parameter (what tied embeddings are)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(FEATURES, FEATURES)
        self.second = nn.Linear(FEATURES, FEATURES)
        self.second.weight = self.first.weight
        self.head = nn.Linear(FEATURES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.second(torch.tanh(self.first(x)))))


class TiedWeights(Trainee):
    def build_model(self) -> nn.Module:
        return TiedLinear()


class Compiled(Trainee):
    """torch.compile'd model, given to statereg compiled (its keys start with `_orig_mod.`).
    The aot_eager backend runs dynamo and AOTAutograd without a C++ toolchain."""

    def wrap(self, model: nn.Module) -> Any:
        return torch.compile(model, backend="aot_eager")

    def objects(self) -> dict[str, Any]:
        return {**super().objects(), "model": self.net}


class Swa(Trainee):
    """Stochastic weight averaging: an AveragedModel (its own component) and SWALR."""

    def build_scheduler(self) -> Any:
        return torch.optim.swa_utils.SWALR(self.optimizer, swa_lr=5e-3, anneal_epochs=3)

    def build_extra(self) -> dict[str, tuple[dict[str, Any], Any]]:
        self.swa = torch.optim.swa_utils.AveragedModel(self.model)
        return {"swa": ({"kind": "model"}, self.swa)}

    def after_step(self, eval_loss: torch.Tensor) -> None:
        self.swa.update_parameters(self.model)
        super().after_step(eval_loss)

    def eval_module(self) -> nn.Module:
        return self.swa


class Ema(BatchNorm1dTrain):
    """An exponential moving average of weights and buffers (AveragedModel, use_buffers)."""

    def build_extra(self) -> dict[str, tuple[dict[str, Any], Any]]:
        self.ema = torch.optim.swa_utils.AveragedModel(
            self.model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9),
            use_buffers=True)
        return {"ema": ({"kind": "model"}, self.ema)}

    def after_step(self, eval_loss: torch.Tensor) -> None:
        self.ema.update_parameters(self.model)
        super().after_step(eval_loss)

    def eval_module(self) -> nn.Module:
        return self.ema


class EmaPerRank(Ema):
    """The same EMA declared per_rank: each rank's own averaged statistics come back."""

    def build_extra(self) -> dict[str, tuple[dict[str, Any], Any]]:
        extra = super().build_extra()
        return {"ema": ({"kind": "model", "sharing": "per_rank"}, extra["ema"][1])}


class GradScaling(Trainee):
    """bfloat16 autocast on the CPU and a GradScaler whose scale grows every other step."""

    def build_extra(self) -> dict[str, tuple[dict[str, Any], Any]]:
        self.scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=2)
        return {"scaler": ({"kind": "custom"}, self.scaler)}

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            prediction = self.net(x)
        return F.mse_loss(prediction.float(), y)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def optimizer_step(self) -> None:
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)


class SgdNesterov(Trainee):
    def build_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9, nesterov=True,
                               weight_decay=1e-4)


class Lbfgs(Trainee):
    """LBFGS with a closure; its state holds lists of tensors (the curvature history)."""

    def build_model(self) -> nn.Module:
        return Mlp(dropout=0.0)

    def build_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.LBFGS(self.model.parameters(), lr=0.5, max_iter=3, history_size=4)

    def micro_step(self, batch: Any, last: bool) -> torch.Tensor:
        self.batch = batch
        with torch.no_grad():
            return self.loss(*batch)

    def optimizer_step(self) -> None:
        def closure() -> torch.Tensor:
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.loss(*self.batch)
            loss.backward()
            return loss

        self.optimizer.step(closure)
        self.optimizer.zero_grad(set_to_none=True)


class Adafactor(Trainee):
    def build_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.Adafactor(self.model.parameters(), lr=1e-2)


class Zero(Trainee):
    """ZeroRedundancyOptimizer: each rank holds the optimizer state of its own parameters."""

    def build_optimizer(self) -> torch.optim.Optimizer:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(self.model.parameters(),
                                       optimizer_class=torch.optim.AdamW, lr=1e-2)

    def optimizer_state(self) -> Any:
        return self.optimizer.optim.state_dict()  # this rank's shard; no collective

    def declarations(self) -> dict[str, dict[str, Any]]:
        components = super().declarations()
        components["optimizer"] = {**components["optimizer"], "sharing": "per_rank"}
        return components


class ZeroSharded(Zero):
    """A ZeroRedundancyOptimizer left at the optimizer's default sharing (sharded)."""

    def declarations(self) -> dict[str, dict[str, Any]]:
        return Trainee.declarations(self)


class Plateau(Trainee):
    def build_scheduler(self) -> Any:
        return torch.optim.lr_scheduler.ReduceLROnPlateau(self.optimizer, factor=0.5,
                                                          patience=1, threshold=0.05)

    def after_step(self, eval_loss: torch.Tensor) -> None:
        self.scheduler.step(eval_loss)


class Sequential(Trainee):
    def build_scheduler(self) -> Any:
        sched = torch.optim.lr_scheduler
        return sched.SequentialLR(self.optimizer, [
            sched.LinearLR(self.optimizer, start_factor=0.3, total_iters=3),
            sched.ExponentialLR(self.optimizer, gamma=0.9)], milestones=[3])


class Chained(Trainee):
    def build_scheduler(self) -> Any:
        sched = torch.optim.lr_scheduler
        return sched.ChainedScheduler([
            sched.ConstantLR(self.optimizer, factor=0.5, total_iters=4),
            sched.ExponentialLR(self.optimizer, gamma=0.95)])


class OneCycle(Trainee):
    def build_scheduler(self) -> Any:
        return torch.optim.lr_scheduler.OneCycleLR(self.optimizer, max_lr=0.05,
                                                   total_steps=self.kill.total)


class MetricTracking(Trainee):
    """torchmetrics metrics updated on every micro-batch, their states made persistent (a
    Metric's states are left out of its state_dict otherwise): a tensor sum and a list state."""

    def build_extra(self) -> dict[str, tuple[dict[str, Any], Any]]:
        import torchmetrics

        self.mse = torchmetrics.MeanSquaredError()
        self.mse.persistent(True)
        return {"metric": ({"kind": "custom", "sharing": "per_rank", "format": "torch"},
                           self.mse)}

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        prediction = self.net(x)
        self.mse.update(prediction.detach(), y)
        return F.mse_loss(prediction, y)


class MetricListState(MetricTracking):
    def build_extra(self) -> dict[str, tuple[dict[str, Any], Any]]:
        import torchmetrics

        self.mse = torchmetrics.CatMetric()
        self.mse.persistent(True)
        return {"metric": ({"kind": "custom", "sharing": "per_rank", "format": "torch"},
                           self.mse)}

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        prediction = self.net(x)
        self.mse.update(prediction.detach().squeeze(1))
        return F.mse_loss(prediction, y)


class Noisy(Dataset):
    """Samples with augmentation noise drawn in the loader's worker processes."""

    def __init__(self, rows: int) -> None:
        self.x, self.y = _fixed(1234, rows)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.05 * torch.randn(FEATURES), self.y[i]


class LoaderWorkers(Trainee):
    """A StatefulDataLoader with 2 worker processes over a plain dataset."""

    def loader_options(self) -> dict[str, Any]:
        return {"num_workers": 2}


class LoaderWorkersAugmenting(LoaderWorkers):
    """The same loader over a dataset that draws augmentation noise in its workers."""

    def dataset(self, rows: int) -> Dataset:
        return Noisy(rows)


class DistributedSamplerAlone(Trainee):
    """A DistributedSampler as one data-parallel worker uses it (replica 1 of 2, shuffled,
    set_epoch every epoch), without a process group."""

    replicas_per_rank = 2

    def build_sampler(self, dataset: Dataset) -> Any:
        return DistributedSampler(dataset, num_replicas=2 * self.place.world,
                                  rank=2 * self.place.rank + 1, shuffle=True, seed=5)


class PrivateGenerator(Trainee):
    """Input noise from a torch.Generator of the script's own, seeded per rank."""

    def build_extra(self) -> dict[str, tuple[dict[str, Any], Any]]:
        self.generator = torch.Generator().manual_seed(int(torch.randint(1000, ())) +
                                                       self.place.rank)
        return {"noise": ({"kind": "custom", "sharing": "per_rank"}, self.generator)}

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return super().loss(x + 0.05 * torch.randn(x.shape, generator=self.generator), y)


class GeneratorState:
    """A private generator made a component: its state as a byte tensor."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def state_dict(self) -> dict[str, Any]:
        return {"state": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["state"])


class PrivateGeneratorWrapped(PrivateGenerator):
    def build_extra(self) -> dict[str, tuple[dict[str, Any], Any]]:
        extra = super().build_extra()
        decl, _ = extra["noise"]
        return {"noise": ({**decl, "format": "torch"}, GeneratorState(self.generator))}


class RankTally:
    """Per-rank bookkeeping (samples and target sum this rank saw): differs on every rank."""

    def __init__(self) -> None:
        self.samples, self.target_sum = 0, 0.0

    def state_dict(self) -> dict[str, Any]:
        return {"samples": self.samples, "target_sum": self.target_sum}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.samples, self.target_sum = state["samples"], state["target_sum"]


class PerRankObject(Trainee):
    sharing: str | None = "per_rank"

    def build_extra(self) -> dict[str, tuple[dict[str, Any], Any]]:
        self.tally = RankTally()
        decl = {"kind": "custom", **({"sharing": self.sharing} if self.sharing else {})}
        return {"tally": (decl, self.tally)}

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.tally.samples += len(x)
        self.tally.target_sum += float(y.sum())
        return super().loss(x, y)


class PerRankObjectAsGlobal(PerRankObject):
    """The same per-rank object left at the custom kind's default sharing (global)."""

    sharing = None


class SparseMixing(nn.Module):
    """A persistent sparse COO buffer mixing the hidden features."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Mlp()
        indices = torch.stack([torch.arange(16), torch.arange(16).roll(1)])
        self.register_buffer("mix", torch.sparse_coo_tensor(indices, torch.rand(16) + 0.5,
                                                            (16, 16)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.inner.fc1(x))
        return self.inner.fc2(torch.sparse.mm(self.mix, hidden.T).T)


class SparseBuffer(Trainee):
    def build_model(self) -> nn.Module:
        return SparseMixing()


class Ragged(nn.Module):
    """A nested (ragged) tensor buffer beside ordinary weights."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Mlp()
        self.register_buffer("lengths", torch.nested.nested_tensor(
            [torch.rand(2), torch.rand(3)]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class NestedBuffer(Trainee):
    def build_model(self) -> nn.Module:
        return Ragged()


class PartlyFrozen(nn.Module):
    """A frozen layer (requires_grad False) before the Mlp, and a layer forward never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(FEATURES, FEATURES).requires_grad_(False)
        self.body = Mlp()
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(torch.tanh(self.frozen(x)))


class FrozenAndUnused(Trainee):
    """Neither the frozen nor the unused layer has optimizer state; DDP is told to expect the
    unused one (find_unused_parameters)."""

    def build_model(self) -> nn.Module:
        return PartlyFrozen()

    def wrap(self, model: nn.Module) -> Any:
        if self.place.loop in ("ddp", "ddp_plain"):
            return nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        return super().wrap(model)


class Bfloat16(Trainee):
    def build_model(self) -> nn.Module:
        return Mlp().to(torch.bfloat16)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.net(x.to(torch.bfloat16)).float(), y)

    def eval_loss(self) -> torch.Tensor:
        with torch.no_grad():
            self.model.eval()
            try:
                return F.mse_loss(self.model(EVAL_X.to(torch.bfloat16)).float(), EVAL_Y)
            finally:
                self.model.train()


class Lstm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(2, 6, batch_first=True, num_layers=2, dropout=0.1)
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x.view(len(x), 4, 2))
        return self.head(out[:, -1])


class Recurrent(Trainee):
    def build_model(self) -> nn.Module:
        return Lstm()


class Transformer(Trainee):
    """A pre-norm transformer encoder layer with dropout (LayerNorm, attention)."""

    def build_model(self) -> nn.Module:
        return nn.Sequential(
            nn.Unflatten(1, (4, 2)), nn.Linear(2, 8),
            nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, 0.1, batch_first=True,
                                                             norm_first=True), 1,
                                  enable_nested_tensor=False),
            nn.Flatten(), nn.Linear(32, 1))


# -- the table -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One kind of stateful object: its trainee, the loops it runs in, and per loop what a
    resume must give: exact (the default), or `refused[loop]`, a text the StateregError's
    message must contain (the offending key). `wrong` marks the cells whose outcome is wrong
    on today's statereg, by loop or "loop/kill", with the defect (strict xfail): when a fix
    lands, its cells pass unexpectedly and fail, and the fix deletes the entry; a fix that
    refuses rather than restores moves the loop into `refused` with the key it names."""

    name: str
    trainee: type[Trainee]
    loops: tuple[str, ...] = ("bare", "ddp")
    refused: dict[str, str] = field(default_factory=dict)
    wrong: dict[str, str] = field(default_factory=dict)
    kills: tuple[str, ...] = tuple(KILLS)

    def expected(self, loop: str) -> str | None:
        """None for exact, else the text the refusal must contain."""
        return self.refused.get(loop)

    def defect(self, loop: str, kill: str) -> str | None:
        return self.wrong.get(f"{loop}/{kill}", self.wrong.get(loop))


ALL_LOOPS = ("bare", "ddp", "fsdp2")
LOADING_KILLS = ("mid_epoch", "epoch_end", "mid_accumulation")  # the kills that load


def wrong_where_loaded(reason: str, loops: tuple[str, ...] = ("bare",),
                       kills: tuple[str, ...] = LOADING_KILLS) -> dict[str, str]:
    """`Row.wrong` for the cells that load a checkpoint (before_first_save has none)."""
    return {f"{loop}/{kill}": reason for loop in loops for kill in kills}



ROWS: list[Row] = [
    Row("mlp_dropout_adamw", Trainee, loops=("bare", "ddp", "ddp_plain", "fsdp2")),
    # Under FSDP2 each rank updates its own statistics and nothing broadcasts them: one
    # stored copy cannot resume every rank, so the save is refused (declare per_rank).
    Row("batchnorm1d_train", BatchNorm1dTrain, loops=("bare", "ddp", "ddp_plain", "fsdp2"),
        refused={"fsdp2": "running_mean"}),
    Row("batchnorm1d_eval", BatchNorm1dEval, loops=ALL_LOOPS),
    Row("batchnorm2d_train", BatchNorm2dTrain),
    Row("batchnorm2d_eval", BatchNorm2dEval),
    Row("nonpersistent_buffer", NonPersistentBuffer, loops=ALL_LOOPS),
    Row("extra_state", ExtraState, loops=ALL_LOOPS),
    Row("dynamic_quantization", DynamicQuantized),
    # Not under DDP: DDP cannot broadcast quantized tensors (no c10d::broadcast_ for
    # QuantizedCPU), and a quantized Linear's forward has no deterministic implementation.
    Row("static_quantization", StaticQuantized, loops=("bare",)),
    Row("quantized_tensor_buffer", QuantizedTensor, loops=("bare",)),
    Row("weight_norm", WeightNorm),
    Row("spectral_norm", SpectralNorm),
    Row("orthogonal", Orthogonal),
    Row("tied_weights", TiedWeights, loops=ALL_LOOPS),
    Row("torch_compile", Compiled, loops=("bare",)),
    Row("swa_averaged_model", Swa),
    # The AveragedModel is a copy outside DDP: its statistics differ by rank, so one copy is
    # refused; declared per_rank, each rank's comes back.
    Row("ema_averaged_model", Ema, refused={"ddp": "running_mean"}),
    Row("ema_averaged_model_per_rank", EmaPerRank, loops=("ddp",)),
    Row("grad_scaler_autocast", GradScaling),
    Row("sgd_momentum_nesterov", SgdNesterov, loops=ALL_LOOPS),
    # Not under FSDP2: torch's Adafactor cannot update DTensor parameters in place
    # (aten.pow_ on a _NormPartial placement).
    Row("adafactor", Adafactor),
    Row("lbfgs", Lbfgs, loops=("bare",), kills=("mid_epoch", "epoch_end", "before_first_save")),
    Row("zero_redundancy_optimizer", Zero, loops=("ddp",)),
    Row("zero_redundancy_optimizer_sharded", ZeroSharded, loops=("ddp",),
        refused={"ddp": "ZeroRedundancyOptimizer"}),
    Row("reduce_lr_on_plateau", Plateau),
    Row("sequential_lr", Sequential),
    Row("chained_scheduler", Chained),
    Row("one_cycle_lr", OneCycle, loops=ALL_LOOPS),
    Row("torchmetrics_tensor_state", MetricTracking),
    Row("torchmetrics_list_state", MetricListState),
    Row("stateful_dataloader_workers", LoaderWorkers),
    Row("stateful_dataloader_workers_augmenting", LoaderWorkersAugmenting),
    Row("distributed_sampler", DistributedSamplerAlone, loops=("bare",)),
    Row("private_generator_undeclarable", PrivateGenerator,
        refused={"bare": "'noise'", "ddp": "'noise'"}),
    Row("private_generator_wrapped", PrivateGeneratorWrapped),
    Row("per_rank_object", PerRankObject, loops=ALL_LOOPS),
    Row("per_rank_object_as_global", PerRankObjectAsGlobal, refused={"ddp": "tally"}),
    Row("sparse_buffer", SparseBuffer, loops=("bare",)),
    Row("nested_buffer", NestedBuffer, loops=("bare",), refused={"bare": "lengths"}),
    Row("frozen_and_unused_params", FrozenAndUnused),
    Row("bfloat16_params", Bfloat16),
    Row("lstm", Recurrent),
    Row("transformer_layer", Transformer),
]
BY_NAME = {row.name: row for row in ROWS}


# -- one cell, on one rank ---------------------------------------------------------------------


@dataclass
class Record:
    """What a run did on one rank: losses by "step.micro", eval losses by step, digest."""

    losses: dict[str, str] = field(default_factory=dict)
    evals: dict[str, str] = field(default_factory=dict)
    digest: dict[str, str] = field(default_factory=dict)


def _hex(t: torch.Tensor) -> str:
    return float(t).hex()


def train(trainee: Trainee, record: Record, start: int, mgr: Any = None,
          dies_at: Kill | None = None) -> bool:
    """Train from optimizer step `start` to the kill's total, saving at its cadence through
    `mgr`; return False if the run died at `dies_at` on the way."""
    kill = trainee.kill
    step, micro = start, 0
    while step < kill.total:
        trainee.set_epoch(step // kill.steps_per_epoch)
        for batch in trainee.loader:
            last = micro == kill.accumulate - 1
            record.losses[f"{step + 1}.{micro}"] = _hex(trainee.micro_step(batch, last))
            if dies_at is not None and dies_at.mid_accumulation and step + 1 == dies_at.at:
                return False
            if not last:
                micro += 1
                continue
            micro = 0
            trainee.optimizer_step()
            step += 1
            eval_loss = trainee.eval_loss()
            record.evals[str(step)] = _hex(eval_loss)
            trainee.after_step(eval_loss)
            if mgr is not None and step % kill.every == 0:
                mgr.save(step=step)
            if dies_at is not None and not dies_at.mid_accumulation and step == dies_at.at:
                return False
            if step == kill.total:
                break
    return True


def _error(exc: BaseException, phase: str) -> dict[str, Any]:
    return {"phase": phase, "type": f"{type(exc).__module__}.{type(exc).__name__}",
            "statereg": isinstance(exc, StateregError), "message": str(exc),
            "traceback": "".join(traceback.format_exception(exc))[-3000:]}


def _spec(trainee: Trainee, root: str) -> dict[str, Any]:
    return {"storage": {"url": root}, "components": trainee.declarations()}


def run_cell(row_name: str, kill_name: str, place: Place, root: str) -> dict[str, Any]:
    """A, B until it dies, and B's restart, on this rank: the records and B's error, if any."""
    row, kill = BY_NAME[row_name], KILLS[kill_name]
    restart_seed = 0 if kill_name == "before_first_save" else 1

    def fresh(seed: int, generators: int) -> Trainee:
        trainee = row.trainee(place, seed, kill)
        seed_everything(generators + place.rank)
        return trainee

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        a, b = Record(), Record()
        trainee = fresh(0, 100)
        train(trainee, a, 0)
        a.digest = trainee.digest()
        result: dict[str, Any] = {"a": a.__dict__, "b": b.__dict__, "error": None,
                                  "restored": None}
        phase = "construct"
        try:
            trainee = fresh(0, 100)
            with statereg.CheckpointManager(_spec(trainee, root), **trainee.objects()) as mgr:
                phase = "train-and-save"
                finished = train(trainee, b, 0, mgr, dies_at=kill)
            assert not finished, "run B did not reach its kill point"
            phase = "restart"
            trainee = fresh(restart_seed, 987654 if restart_seed else 100)
            with statereg.CheckpointManager(_spec(trainee, root), **trainee.objects()) as mgr:
                phase = "load"
                loaded = mgr.load()
                result["restored"] = None if loaded is None else loaded.step
                phase = "resume-and-save"
                train(trainee, b, 0 if loaded is None else loaded.step, mgr)
            b.digest = trainee.digest()
        except Exception as exc:  # recorded, judged by the test (a refusal may be expected)
            result["error"] = _error(exc, phase)
            result["files"] = sorted(str(p.relative_to(root)) for p in Path(root).rglob("*")
                                     if p.is_file()) if Path(root).exists() else []
    return result


def run_ranks_cell(rank: int, world: int, row_name: str, kill_name: str, loop: str,
                   root: str, out: str) -> None:
    """run_cell on every rank of a gloo group (tests/distributed/harness.run_ranks)."""
    torch.use_deterministic_algorithms(True)
    result = run_cell(row_name, kill_name, Place(loop, rank, world), root)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()


def all_cells() -> list[tuple[str, str, str]]:
    """Every (row, loop, kill) of the table."""
    return [(row.name, loop, kill) for row in ROWS for loop in row.loops for kill in row.kills]


# The CI sample: every row once in the bare loop (its kill point rotating with the row's place
# in the table), and these distributed cells, the costly ones.
SAMPLED_DISTRIBUTED = [
    ("batchnorm1d_train", "ddp", "mid_epoch"),
    ("mlp_dropout_adamw", "ddp_plain", "mid_epoch"),
    ("per_rank_object_as_global", "ddp", "epoch_end"),
    ("zero_redundancy_optimizer", "ddp", "mid_accumulation"),
    ("extra_state", "fsdp2", "mid_accumulation"),
]


def ci_cells() -> list[tuple[str, str, str]]:
    cells = []
    for i, row in enumerate(ROWS):
        if "bare" in row.loops:
            cells.append((row.name, "bare", row.kills[i % len(row.kills)]))
    return cells + SAMPLED_DISTRIBUTED
