"""A PyTorch Lightning fit that statereg saves and resumes exactly (docs/integrations/lightning.md).

    python examples/lightning_train.py --root /tmp/ckpt            # trains; run it again to resume
    python examples/lightning_train.py --root /tmp/ckpt --devices 4  # DDP on 4 CPU processes
    python examples/lightning_train.py --root /tmp/ckpt --devices 2 --fsdp  # FSDP2

The lines marked `# statereg` are all that differ from a plain Lightning script. The rest is
a tiny model with dropout, a shuffled StatefulDataLoader and a per-step LR schedule: every
source of randomness and state that a resume has to bring back. `--kill-at STEP` SIGKILLs
the whole run after that step (to try a resume); `--losses FILE` appends each step's loss.
`--lightning-checkpoints` uses Lightning's own ModelCheckpoint and `fit(ckpt_path="last")`
instead, for comparison.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from statereg.integrations.lightning import StateregCheckpoint  # statereg


class TinyModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))

    def configure_model(self) -> None:
        if isinstance(self.trainer.strategy, pl.strategies.ModelParallelStrategy):  # --fsdp
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + 0.05 * step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def train_dataloader(self) -> StatefulDataLoader:
        data = torch.Generator().manual_seed(0)
        x = torch.randn(320, 16, generator=data)
        y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(320, 1, generator=data)
        return StatefulDataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)


class Chaos(pl.Callback):
    """Records each step's loss (rank 0) and SIGKILLs the run after a chosen step."""

    def __init__(self, losses: Path | None, kill_at: int | None) -> None:
        self.losses, self.kill_at = losses, kill_at

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule,
                           outputs: dict, batch: list[torch.Tensor], batch_idx: int) -> None:
        if self.losses is not None and trainer.is_global_zero:
            with self.losses.open("a") as out:
                out.write(f"{trainer.global_step} {outputs['loss'].item().hex()}\n")
        if trainer.global_step == self.kill_at:
            if module.trainer.world_size > 1:
                os.killpg(os.getpgid(0), signal.SIGKILL)  # every rank at once
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--losses", type=Path)
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 (ModelParallelStrategy)")
    parser.add_argument("--lightning-checkpoints", action="store_true")
    args = parser.parse_args()

    pl.seed_everything(1234)
    torch.set_num_threads(1)
    chaos = Chaos(args.losses, args.kill_at)
    if args.lightning_checkpoints:
        keep = pl.callbacks.ModelCheckpoint(args.root, every_n_train_steps=args.every,
                                            save_last=True)
        callbacks, checkpointing, resume = [keep, chaos], True, "last"
    else:
        statereg = StateregCheckpoint({"storage": {"url": args.root}},  # statereg
                                      every_n_train_steps=args.every)  # statereg
        callbacks, checkpointing, resume = [statereg, chaos], False, None  # statereg
    strategy: str | pl.strategies.Strategy = "ddp" if args.devices > 1 else "auto"
    if args.fsdp:
        strategy = pl.strategies.ModelParallelStrategy(data_parallel_size=args.devices,
                                                       tensor_parallel_size=1)
    trainer = pl.Trainer(max_epochs=args.epochs, accelerator="cpu", devices=args.devices,
                         strategy=strategy, callbacks=callbacks,
                         enable_checkpointing=checkpointing, logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(TinyModel(), ckpt_path=resume)


if __name__ == "__main__":
    main()
