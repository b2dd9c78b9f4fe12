"""BatchNorm under DDP through the real trainers: Lightning (DDPStrategy, 3 processes) and
Accelerate (2 processes), saved mid-epoch, killed, and resumed in fresh processes.

Under DDP each rank updates its own BatchNorm running statistics in its forward; DDP
broadcasts rank 0's at the next forward that syncs buffers. Each rank here trains on data of
its own scale, so the ranks' statistics really differ when the checkpoint is saved. A
checkpoint once held a state no rank ever had (DCP's write balancing took one buffer from one
rank and the next from another): every training loss resumed exactly, every validation loss
and the final buffers did not. statereg now stores rank 0's buffers, the copy every rank goes
on with, so every rank's later training losses, validation losses and final buffers equal
the uninterrupted run's bit for bit (tests/distributed/test_one_copy.py is the bare loop).

Every run is a forkserver child (tests/integrations/trainees.py's launcher, which has torch,
transformers and accelerate imported already): the Accelerate ranks themselves, or one
Lightning fit whose DDP launcher forks its 3 ranks. A killed run waits for the save in flight,
then every rank SIGKILLs itself, so the resume point is fixed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import resource
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8),
                         nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))


def _samples(n: int, seed: int, rank: int) -> TensorDataset:
    """`n` samples; each rank's of its own scale, so the ranks' running statistics differ."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=gen) * (1 + rank)
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


def _buffers(module: nn.Module) -> dict[str, str]:
    """Each floating-point buffer's exact values (float.hex)."""
    return {name: repr([v.hex() for v in b.flatten().tolist()])
            for name, b in module.named_buffers() if b.is_floating_point()}


def _digest(values: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()


def _committed(root: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step_")) for p in root.glob("step_*")
                  if (p / "manifest.json").exists())


def assert_resumed_exactly(reference: list[dict[str, Any]], resumed: list[dict[str, Any]],
                           saved: int) -> None:
    """Every rank's training losses, validation losses and final buffers after step `saved`
    equal the uninterrupted run's; the ranks' buffers differed when step `saved` was saved."""
    for rank, (want, got) in enumerate(zip(reference, resumed, strict=True)):
        assert got["start"] == saved, f"rank {rank} did not resume from step {saved}"
        later = {key: {k: v for k, v in want[key].items() if int(k.split(":")[0]) > saved}
                 for key in ("train", "eval")}
        assert sorted(got["train"]) == sorted(later["train"]) and later["train"], rank
        differ = [k for k in later["train"] if got["train"][k] != later["train"][k]]
        assert not differ, f"rank {rank}: training losses differ at {differ}"
        assert sorted(got["eval"]) == sorted(later["eval"]) and later["eval"], rank
        differ = [k for k in later["eval"] if got["eval"][k] != later["eval"][k]]
        assert not differ, f"rank {rank}: validation losses differ at {differ}"
        differ = [n for n in want["buffers"] if got["buffers"][n] != want["buffers"][n]]
        assert not differ, f"rank {rank}: final buffers differ: {differ}"
    # The ranks' statistics really differed at the save (else this would prove nothing).
    at_save = [want["buffers_at"][str(saved)] for want in reference]
    assert len(set(at_save)) == len(reference), at_save


# -- Lightning: DDP on 3 CPU processes ---------------------------------------------------------

RANKS = 3
# 72 samples, batches of 4: 6 steps a rank per epoch, 2 epochs. Validation after every 2nd
# step (and at each epoch's end), 2 batches a rank. (save every N steps, kill after step K
# once the save in flight is committed, the step the resume starts from):
CASES = {
    # mid-epoch 0, at a step whose validation the uninterrupted run ran right after the save
    # (Lightning's restart skips it: the resumed run validates next after step 6)
    "mid-epoch": (4, 5, 4),
    # the last batch of epoch 0, validated after the save; the resume starts epoch 1
    "epoch-end": (6, 7, 6),
}


def lightning_fit(rank: int, config: dict[str, Any]) -> None:
    """One fit, in a forkserver child that Lightning's DDP launcher forks the 3 ranks from
    (DDPStrategy(start_method="fork"), Lightning's "ddp_fork": the same DDPStrategy and
    DistributedDataParallel as strategy="ddp", whose launcher instead runs the script again
    per rank, importing Lightning three times a fit: seconds of CPU each on two cores).
    Each rank writes `<out>/rank<r>.json`: each step's training loss and buffer digest, each
    validation batch's loss, the step the fit started from, and the final buffers."""
    import lightning.pytorch as pl
    from torchdata.stateful_dataloader import StatefulDataLoader

    from statereg.integrations.lightning import StateregCheckpoint

    kill_at, out = config.get("kill_at"), config["out"]

    class BatchNormModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.mse_loss(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.mse_loss(self.net(x), y)
            self.log("val_loss", loss, on_step=True, on_epoch=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

        def train_dataloader(self) -> StatefulDataLoader:
            return StatefulDataLoader(_samples(72, 0, self.global_rank), batch_size=4,
                                      shuffle=True)

        def val_dataloader(self) -> DataLoader:
            return DataLoader(_samples(24, 1, self.global_rank), batch_size=4)

    class Record(pl.Callback):
        def __init__(self, checkpoint: StateregCheckpoint) -> None:
            self.checkpoint = checkpoint
            self.record: dict[str, Any] = {"train": {}, "eval": {}, "buffers_at": {}}

        def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            self.record["start"] = trainer.global_step

        def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule,
                               outputs: Any, batch: Any, batch_idx: int) -> None:
            step = trainer.global_step
            self.record["train"][str(step)] = outputs["loss"].item().hex()
            self.record["buffers_at"][str(step)] = _digest(_buffers(module))
            if step == kill_at:
                assert self.checkpoint.mgr is not None
                self.checkpoint.mgr.wait()  # the save before the kill is committed
                torch.distributed.barrier()  # no rank is inside a collective
                os.kill(os.getpid(), signal.SIGKILL)

        def on_validation_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule,
                                    outputs: Any, batch: Any, batch_idx: int,
                                    dataloader_idx: int = 0) -> None:
            if not trainer.sanity_checking:
                key = f"{trainer.global_step}:{batch_idx}:{trainer.current_epoch}"
                self.record["eval"][key] = outputs.item().hex()

        def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            self.record["buffers"] = _buffers(module)
            self.record["cpu_s"] = _cpu_s()
            Path(out, f"rank{trainer.global_rank}.json").write_text(json.dumps(self.record))

    pl.seed_everything(1234, verbose=False)
    torch.set_num_threads(1)
    checkpoint = StateregCheckpoint({"storage": {"url": config["url"]}},
                                    every_n_train_steps=config["every"])
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", devices=RANKS,
                         strategy=pl.strategies.DDPStrategy(start_method="fork"),
                         callbacks=[checkpoint, Record(checkpoint)], val_check_interval=2,
                         enable_checkpointing=False, logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(BatchNormModule())


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return round(usage.ru_utime + usage.ru_stime, 2)


def run(entry: Any, tmp_path: Path, name: str, processes: int, ranks: int,
        **config: Any) -> list[dict]:
    """One run of `entry` on `processes` forkserver children; each of its `ranks` ranks'
    record, or [] for a run told to kill itself (which must have died)."""
    from integrations.trainees import launch

    out = tmp_path / name
    out.mkdir()
    codes = launch(entry, {"url": str(tmp_path / "ckpt"), "out": str(out), **config},
                   processes)
    if config.get("kill_at") is not None:
        assert codes[0] != 0, codes
        return []
    assert codes == [0] * processes, codes
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


needs_lightning = pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                     reason="needs lightning")


@pytest.fixture(scope="module")
def lightning_reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Every rank's record of the uninterrupted fit (saving every 4 steps)."""
    return run(lightning_fit, tmp_path_factory.mktemp("reference"), "out", 1, RANKS, every=4)


@needs_lightning
@pytest.mark.parametrize("case", list(CASES))
def test_lightning_ddp_3_ranks_batchnorm_resumes_validation_and_buffers_exactly(
        tmp_path: Path, lightning_reference: list[dict], case: str) -> None:
    every, kill_at, saved = CASES[case]
    run(lightning_fit, tmp_path, "killed", 1, RANKS, every=every, kill_at=kill_at)
    assert _committed(tmp_path / "ckpt") == [saved]
    resumed = run(lightning_fit, tmp_path, "resumed", 1, RANKS, every=every)
    assert_resumed_exactly(lightning_reference, resumed, saved)


# -- Accelerate: 2 gloo processes -------------------------------------------------------------

PROCESSES = 2
# 48 samples, batches of 4: 6 steps a process per epoch; 10 steps, an eval after each; saves
# every 4; the kill after step 6 (the save of step 4 committed) resumes mid-epoch 0.
A_STEPS, A_EVERY, A_KILL, A_SAVED = 10, 4, 6, 4


def accelerate_bn(rank: int, config: dict[str, Any]) -> None:
    """A plain Accelerate loop with BatchNorm: a step, a save every A_EVERY steps (before the
    eval, while each rank holds its own statistics), then an eval of the bare module (each
    rank's own statistics) and one through the prepared model (DDP broadcasts rank 0's
    buffers first). Writes `<out>/rank<r>.json` as lightning_fit does."""
    from accelerate import Accelerator, DataLoaderConfiguration
    from integrations.trainees import _deterministic, _distributed_env

    from statereg.integrations import accelerate as sr_accelerate

    _distributed_env(rank, config)
    _deterministic()
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
        use_stateful_dataloader=True, use_seedable_sampler=True))
    torch.manual_seed(0)
    net = _net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(_samples(48, 0, 0), batch_size=4, shuffle=True, drop_last=True)
    model, optimizer, loader = accelerator.prepare(net, optimizer, loader)
    spec = {"storage": {"url": config["url"]}}
    restored = sr_accelerate.load_state(accelerator, spec)
    step = 0 if restored is None else restored.step
    scale = 1 + accelerator.process_index  # each rank's data of its own scale
    record: dict[str, Any] = {"start": step, "train": {}, "eval": {}, "buffers_at": {}}
    evaluate = _samples(8, 100 + rank, rank)[:]
    while step < A_STEPS:
        for x, y in loader:
            model.train()
            loss = F.mse_loss(model(x * scale), y * scale)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            record["train"][str(step)] = loss.item().hex()
            record["buffers_at"][str(step)] = _digest(_buffers(net))
            if step % A_EVERY == 0:
                sr_accelerate.save_state(accelerator, spec, step)
            model.eval()
            with torch.no_grad():
                for how, forward in (("bare", net), ("ddp", model)):
                    eval_loss = F.mse_loss(forward(evaluate[0]), evaluate[1])
                    record["eval"][f"{step}:{how}"] = eval_loss.item().hex()
            if step == config.get("kill_at"):
                sr_accelerate.wait(accelerator)  # the save of step A_SAVED is committed
                torch.distributed.barrier()  # no rank is inside a collective
                os.kill(os.getpid(), signal.SIGKILL)
            if step == A_STEPS:
                break
    sr_accelerate.wait(accelerator)
    record["buffers"] = _buffers(net)
    record["cpu_s"] = _cpu_s()
    Path(config["out"], f"rank{rank}.json").write_text(json.dumps(record))


def test_accelerate_2_processes_batchnorm_resumes_eval_and_buffers_exactly(
        tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    (tmp_path / "ref").mkdir()
    reference = run(accelerate_bn, tmp_path / "ref", "out", PROCESSES, PROCESSES)
    run(accelerate_bn, tmp_path, "killed", PROCESSES, PROCESSES, kill_at=A_KILL)
    assert _committed(tmp_path / "ckpt") == [A_SAVED]
    resumed = run(accelerate_bn, tmp_path, "resumed", PROCESSES, PROCESSES)
    assert_resumed_exactly(reference, resumed, A_SAVED)


