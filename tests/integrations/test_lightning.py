"""statereg.integrations.lightning: real Lightning fits saved, SIGKILLed and resumed.

The fits are examples/lightning_train.py itself (the script docs/integrations/lightning.md
shows), run as a user runs it: a process per fit, killed with SIGKILL mid-epoch, resumed by
running it again; every loss after the resume must equal the uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pl = pytest.importorskip("lightning.pytorch")

import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import statereg  # noqa: E402
from statereg.integrations.lightning import StateregCheckpoint  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "lightning_train.py"


def fit(tmp_path: Path, *args: str, env: dict[str, str] | None = None,
        killed: bool = False) -> None:
    """Run the example once, in a session of its own (a DDP run's ranks are killed as one)."""
    done = subprocess.run([sys.executable, str(EXAMPLE), *args], cwd=tmp_path,
                          env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          start_new_session=True, timeout=400)
    if killed:
        assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    else:
        assert done.returncode == 0, done.stderr[-3000:]


def losses(path: Path) -> dict[int, str]:
    """Each step's loss, as float.hex() (exact), from the example's --losses file."""
    return {int(step): value for step, value in (line.split() for line in path.open())}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Each step's loss of the uninterrupted fit, per strategy (run once each)."""
    runs: dict[tuple[str, ...], dict[int, str]] = {}

    def losses_of(devices: int, *flags: str) -> dict[int, str]:
        key = (str(devices), *flags)
        if key not in runs:
            where = tmp_path_factory.mktemp("uninterrupted")
            fit(where, "--root", "full", "--losses", "full.txt", "--devices", *key)
            runs[key] = losses(where / "full.txt")
            assert sorted(runs[key]) == list(range(1, 80 // devices + 1))
        return runs[key]

    return losses_of


# (processes, flags, save every N steps, SIGKILL after step K): 40 batches of 8 an epoch (20 a
# rank at 2 ranks, 10 at 4), 2 epochs; the resume starts after the last save before K (or
# the one before it, if the kill came while that one was written).
CASES: dict[str, tuple[int, tuple[str, ...], int, int]] = {
    "1-process-mid-epoch": (1, (), 5, 13),        # resumes at 11, in epoch 0
    "1-process-epoch-end": (1, (), 20, 43),       # resumes at 41, saved after epoch 0's end
    "ddp-4-ranks-mid-epoch": (4, (), 3, 13),      # resumes at 13, in epoch 1
    "fsdp2-2-ranks-mid-epoch": (2, ("--fsdp",), 4, 13),  # resumes at 13, in epoch 0
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_fit_killed_mid_run_resumes_bit_identical(tmp_path: Path, uninterrupted: Any,
                                                    case: str) -> None:
    devices, flags, every, kill = CASES[case]
    common = ["--devices", str(devices), *flags, "--every", str(every)]
    full = uninterrupted(devices, *flags)
    fit(tmp_path, "--root", "run", "--losses", "killed.txt", "--kill-at", str(kill), *common,
        killed=True)
    # Saves are asynchronous by default: the kill may land while the last save before it is
    # still being written, and the resume then starts from the one before.
    newest = committed_steps(tmp_path / "run")[-1]
    assert newest in (kill // every * every, kill // every * every - every)
    fit(tmp_path, "--root", "run", "--losses", "resumed.txt", *common)
    resumed = losses(tmp_path / "resumed.txt")
    first = newest + 1
    assert sorted(resumed) == list(range(first, 80 // devices + 1))
    differ = [step for step in resumed if resumed[step] != full[step]]
    assert differ == [], f"{len(differ)} of {len(resumed)} resumed losses differ: {differ}"
    # The killed run lost nothing it logged before the kill (under DDP another rank may
    # reach step K and kill them all before rank 0 logs it).
    killed = losses(tmp_path / "killed.txt")
    assert killed == {s: full[s] for s in killed} and max(killed) >= first - 1


def test_a_fit_saves_to_s3_by_changing_only_the_url_and_a_finetune_loads_the_model(
        tmp_path: Path, s3_server: Any, s3_admin: Any) -> None:
    from storage_servers import S3_KEY, S3_SECRET, new_bucket

    url = f"s3://{new_bucket(s3_admin)}/lightning"
    env = {"AWS_ENDPOINT_URL": s3_server.endpoint, "AWS_ACCESS_KEY_ID": S3_KEY,
           "AWS_SECRET_ACCESS_KEY": S3_SECRET}
    fit(tmp_path, "--root", url, "--epochs", "1", "--every", "20", env=env)
    example = load_example()
    model = example.TinyModel()
    options = {"key": S3_KEY, "secret": S3_SECRET,
               "client_kwargs": {"endpoint_url": s3_server.endpoint}}
    spec = {"storage": {"url": url, "options": options},
            "components": {"model": {"kind": "model"},
                           "optimizer": {"kind": "optimizer", "required": False}},
            "profiles": {"finetune": {"include": ["model"]}}}
    with statereg.CheckpointManager(spec, model=model) as mgr:
        assert [u.rsplit("/", 1)[1] for u in mgr.list()] == ["step_00000020", "step_00000040"]
        result = mgr.load(profile="finetune")
    assert result is not None and result.step == 40 and result.components == ("model",)
    manifest = statereg.read_manifest(f"{url}/step_00000040", options)
    assert {"model", "optimizer", "scheduler", "train_dataloader", "rng",
            "fit_loop"} <= set(manifest.components)


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("lightning_train", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Metrics(pl.loggers.Logger):
    """Collects what is logged, in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.append((step, dict(metrics)))


class LossAtStep(pl.Callback):
    def __init__(self) -> None:
        self.loss: dict[int, float] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.loss[trainer.global_step] = float(trainer.callback_metrics["train_loss"])


def in_process_fit(root: Path, callback: StateregCheckpoint, *more: pl.Callback,
                   logger: Any = False, **trainer_args: Any) -> None:
    example = load_example()
    torch.manual_seed(0)
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=logger,
                         callbacks=[callback, *more], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         log_every_n_steps=1, **trainer_args)
    trainer.fit(example.TinyModel())


def test_monitor_keeps_the_best_and_each_save_reaches_the_logger(tmp_path: Path) -> None:
    """monitor / save_top_k map to keep_best: with keep_last 1, the newest and the two best
    saved steps by train_loss stay. Every save's statistics reach the trainer's logger."""
    spec = {"storage": {"url": str(tmp_path / "ckpt")}, "save": {"keep_last": 1}}
    metrics, seen = Metrics(), LossAtStep()
    callback = StateregCheckpoint(spec, every_n_train_steps=4, monitor="train_loss",
                                  save_top_k=2)
    in_process_fit(tmp_path, callback, seen, logger=metrics)
    saved = {step: seen.loss[step] for step in range(4, 41, 4)}
    best = sorted(saved, key=saved.get)[:2]
    left = sorted(int(p.name.removeprefix("step_")) for p in (tmp_path / "ckpt").glob("step_*"))
    assert left == sorted({40, *best})
    for step in left:
        manifest = statereg.read_manifest(str(tmp_path / "ckpt" / f"step_{step:08d}"))
        assert manifest.extra["train_loss"] == saved[step]
    stats = {step: m for step, m in metrics.logged if "statereg/stall_s" in m}
    assert sorted(stats) == list(range(4, 41, 4))
    assert all(m["statereg/bytes"] > 0 and m["statereg/committed_s"] >= m["statereg/stall_s"]
               for m in stats.values())


def test_a_loader_that_cannot_resume_is_refused_with_the_fix(tmp_path: Path) -> None:
    class PlainLoader(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.layer(batch[0]).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2)

    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False,
                         callbacks=[StateregCheckpoint({"storage": {"url": str(tmp_path)}})],
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    with pytest.raises(statereg.SpecError, match="StatefulDataLoader"):
        trainer.fit(PlainLoader())
    assert not list(tmp_path.glob("step_*"))


def test_importing_statereg_and_its_integrations_imports_no_trainer() -> None:
    code = ("import sys, statereg, statereg.integrations; "
            "print([m for m in ('lightning', 'pytorch_lightning', 'transformers', "
            "'accelerate', 'torchtitan') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "[]"


# -- gradient accumulation: saves only at optimizer steps ----------------------------------


class Killed(Exception):
    """Raised from a callback to end a fit where a crash would."""


class MicroBatches(pl.Callback):
    """Records every micro-batch's loss (exact), and raises Killed after micro-batch
    `kill_at` (0-based, counted over the fit)."""

    def __init__(self, kill_at: int | None = None) -> None:
        self.kill_at = kill_at
        self.loss: dict[tuple[int, int], str] = {}
        self.count = 0

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.loss[(trainer.current_epoch, batch_idx)] = outputs["loss"].item().hex()
        if self.count == self.kill_at:
            raise Killed(f"killed after micro-batch {self.count}")
        self.count += 1


def committed_steps(root: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step_")) for p in root.glob("step_*")
                  if (p / "manifest.json").exists())


@pytest.mark.parametrize(("kill_at", "resumes_from"), [
    (6, None),   # micro-batch 6 = step 4's first half: before the first save (step 5)
    (14, 5),     # step 8's first half: after the save of step 5
])
def test_accumulation_killed_mid_accumulation_resumes_exactly(
        tmp_path: Path, kill_at: int, resumes_from: int | None) -> None:
    """accumulate_grad_batches=2, every 5 optimizer steps: no checkpoint is committed
    between the two micro-batches of a step (the old callback committed step_00000000 after
    the first micro-batch, without its gradient, and a run killed before step 5 resumed from
    it on another stream), so the resume continues bit for bit."""
    spec = {"storage": {"url": str(tmp_path / "full")}}
    full = MicroBatches()
    in_process_fit(tmp_path, StateregCheckpoint(spec, every_n_train_steps=5), full,
                   accumulate_grad_batches=2)
    assert len(full.loss) == 40
    spec = {"storage": {"url": str(tmp_path / "run")}}
    with pytest.raises(Killed):
        in_process_fit(tmp_path, StateregCheckpoint(spec, every_n_train_steps=5),
                       MicroBatches(kill_at=kill_at), accumulate_grad_batches=2)
    assert committed_steps(tmp_path / "run") == ([] if resumes_from is None else [resumes_from])
    resumed = MicroBatches()
    in_process_fit(tmp_path, StateregCheckpoint(spec, every_n_train_steps=5), resumed,
                   accumulate_grad_batches=2)
    first = 0 if resumes_from is None else 2 * resumes_from
    assert sorted(resumed.loss) == [(0, b) for b in range(first, 40)]
    differ = [k for k in resumed.loss if resumed.loss[k] != full.loss[k]]
    assert differ == [], f"{len(differ)} of {len(resumed.loss)} resumed losses differ"


class FitLoopRecord:
    """Reads a checkpoint's fit_loop component (Lightning's loop progress)."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


def test_a_time_cadence_saves_only_after_optimizer_steps(tmp_path: Path) -> None:
    """Due at every batch (every_seconds ~ 0), with accumulate_grad_batches=2 the callback
    saves after each optimizer step and never after a first micro-batch: each checkpoint's
    loop progress is 2 micro-batches per step; none is step 0."""
    spec = {"storage": {"url": str(tmp_path / "ckpt")}}
    in_process_fit(tmp_path, StateregCheckpoint(spec, train_time_interval=1e-9),
                   accumulate_grad_batches=2, max_steps=6)
    assert committed_steps(tmp_path / "ckpt") == [1, 2, 3, 4, 5, 6]
    record = FitLoopRecord()
    reader_spec = {"storage": {"url": str(tmp_path / "ckpt")},
                   "components": {"fit_loop": {"kind": "custom", "format": "torch"}}}
    with statereg.CheckpointManager(reader_spec, fit_loop=record) as reader:
        for step in range(1, 7):
            reader.load(step=step, strict=False)
            done = record.state["epoch_loop.batch_progress"]["total"]["processed"]
            assert done == 2 * step, f"step {step} was saved after {done} micro-batches"


def async_mode(checkpoint: Path) -> str:
    """The save.async a checkpoint was saved with (its manifest records the declaration)."""
    return statereg.read_manifest(str(checkpoint)).spec.get("save", {}).get("async", "off")


def test_saves_are_asynchronous_by_default_and_committed_when_the_fit_ends(
        tmp_path: Path) -> None:
    callback = StateregCheckpoint({"storage": {"url": str(tmp_path / "a")}},
                                  every_n_train_steps=10)
    in_process_fit(tmp_path, callback)
    assert committed_steps(tmp_path / "a") == [10, 20, 30, 40]
    assert async_mode(tmp_path / "a" / "step_00000040") == "thread"
    # An explicit declaration wins, `off` included.
    explicit = StateregCheckpoint({"storage": {"url": str(tmp_path / "b")},
                                   "save": {"async": "off"}}, every_n_train_steps=10)
    in_process_fit(tmp_path, explicit, max_steps=10)
    assert async_mode(tmp_path / "b" / "step_00000010") == "off"
    # An exception waits for the save in flight: the resume finds it.
    with pytest.raises(Killed):
        in_process_fit(tmp_path, StateregCheckpoint({"storage": {"url": str(tmp_path / "c")}},
                                                    every_n_train_steps=10),
                       MicroBatches(kill_at=9))
    assert committed_steps(tmp_path / "c") == [10]


# -- a resume with another train dataloader ----------------------------------------------


def fit_with_loader(root: Path, callback: pl.Callback | None = None, **loader: Any) -> None:
    """The example's model, its loader built with `loader` changes, 10 steps, saved at 5."""
    example = load_example()

    class Model(example.TinyModel):  # type: ignore[name-defined,misc]
        def train_dataloader(self) -> Any:
            from torchdata.stateful_dataloader import StatefulDataLoader

            data = torch.Generator().manual_seed(0)
            samples = loader.get("samples", 320)
            x = torch.randn(samples, 16, generator=data)
            return StatefulDataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)),
                                      batch_size=loader.get("batch_size", 8),
                                      shuffle=loader.get("shuffle", True))

    torch.manual_seed(0)
    trainer = pl.Trainer(max_steps=10, accelerator="cpu", devices=1, logger=False,
                         callbacks=[StateregCheckpoint({"storage": {"url": str(root)}},
                                                       every_n_train_steps=5),
                                    *([callback] if callback else [])],
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(Model())


@pytest.mark.parametrize(("changed", "named"), [
    ({"samples": 40}, "dataset length 320 -> 40"),   # torchdata: StopIteration
    ({"shuffle": False}, "shuffle True -> False"),   # torchdata: AssertionError
    ({"batch_size": 4}, "batch size 8 -> 4"),        # silently another data stream
])
def test_a_resume_with_another_loader_is_refused_naming_the_change(
        tmp_path: Path, changed: dict[str, Any], named: str) -> None:
    with pytest.raises(Killed):
        fit_with_loader(tmp_path, MicroBatches(kill_at=6))
    assert committed_steps(tmp_path) == [5]
    with pytest.raises(statereg.CheckpointMismatchError, match=(
            rf"component 'train_dataloader': the data loader is not the one the checkpoint "
            rf"saved \({named}\)")):
        fit_with_loader(tmp_path, **changed)
