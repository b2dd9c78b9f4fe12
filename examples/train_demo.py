"""Train a tiny language model, kill it with SIGKILL, resume it, and check the resume is exact.

    python examples/train_demo.py                  # the whole demo, about 30 s on 2 CPU cores
    python examples/train_demo.py --device cuda    # the same on a GPU
    python examples/train_demo.py train --ckpt-dir DIR --losses FILE   # one training run

The demo runs the same training script three times, each in its own process:

  1. reference:   300 steps without interruption, recording the loss of every step;
  2. interrupted: the same run in a fresh checkpoint directory, killed with SIGKILL
                  after step 120 (checkpoints are written every 50 steps);
  3. resumed:     a new process on that directory; `mgr.load()` restores the latest complete
                  checkpoint (step 100) and training continues to step 300.

Then it compares the losses of steps 101..300 of the resumed run with the reference, bit for
bit. They match only if everything that shapes a step came back exactly: weights, AdamW
moments and step counts, the LR schedule, the dataloader's position inside a shuffled epoch,
and the random generators that dropout draws from. Everything the training script does for
checkpointing is in `train()`: build the objects, `CheckpointManager(...)`, `load()`, `save()`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

import statereg

HERE = Path(__file__).resolve().parent
SPEC_PATH = HERE / "statereg.yaml"

TOTAL_STEPS = 300
SAVE_EVERY = 50
KILL_AFTER = 120  # not a multiple of SAVE_EVERY: the kill loses the steps since the last save
BATCH_SIZE = 16
SEQ_LEN = 32
VOCAB = 64
N_SEQUENCES = 1024  # 64 batches per epoch, so the run crosses epochs and resumes mid-epoch
PEAK_LR = 3e-3
WARMUP_STEPS = 30


# -- the model and the data -----------------------------------------------------------------


class TinyLM(nn.Module):
    """A 2-layer pre-norm transformer language model with tied input/output embeddings."""

    def __init__(self, vocab: int = VOCAB, d_model: int = 64, n_layers: int = 2,
                 n_heads: int = 4, seq_len: int = SEQ_LEN, dropout: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq_len, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: statereg stores the tensor once
        mask = nn.Transformer.generate_square_subsequent_mask(seq_len)
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        x = self.embed(tokens) + self.pos[:n]
        x = self.blocks(x, mask=self.causal_mask[:n, :n], is_causal=True)
        return self.head(self.norm(x))


def synthetic_corpus(seed: int = 1234) -> torch.utils.data.TensorDataset:
    """Sequences from a fixed random Markov chain: learnable, and the same in every process."""
    gen = torch.Generator().manual_seed(seed)
    transitions = torch.softmax(torch.randn(VOCAB, VOCAB, generator=gen) * 3, dim=-1)
    tokens = torch.empty(N_SEQUENCES, SEQ_LEN + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(VOCAB, (N_SEQUENCES,), generator=gen)
    for t in range(SEQ_LEN):
        tokens[:, t + 1] = torch.multinomial(transitions[tokens[:, t]], 1, generator=gen)[:, 0]
    return torch.utils.data.TensorDataset(tokens)


def warmup_cosine(step: int) -> float:
    """LR multiplier: linear warmup, then cosine decay to 10% of the peak."""
    if step < WARMUP_STEPS:
        return (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, TOTAL_STEPS - WARMUP_STEPS)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# -- one training run (runs in a subprocess of the demo) --------------------------------------


def train(ckpt_dir: str, losses_path: str, device: str = "cpu") -> None:
    """Train to TOTAL_STEPS, resuming from the latest complete checkpoint in `ckpt_dir` if any.

    Prints one line per step (`step N loss HEX`) for the demo driver to follow.
    """
    torch.set_num_threads(1)  # same thread count as the saved run: same reduction order
    if device.startswith("cuda"):
        # cuBLAS is deterministic only with a fixed workspace; it must be set before CUDA
        # starts (docs/exact-resume.md#on-a-gpu).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    # torchdata 0.11 calls a torch API that newer torch deprecates; nothing to act on here.
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
    seed_everything(0)

    model = TinyLM().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=PEAK_LR, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine)
    loader = StatefulDataLoader(synthetic_corpus(), batch_size=BATCH_SIZE, shuffle=True,
                                drop_last=True)

    spec = statereg.load_spec(SPEC_PATH, overrides={"storage.url": ckpt_dir})
    with statereg.CheckpointManager(spec, model=model, optimizer=optimizer,
                                    scheduler=scheduler, dataloader=loader) as mgr:
        # load() before the first iter(loader): the loader then continues mid-epoch.
        restored = mgr.load()  # the latest complete checkpoint, or None in a fresh directory
        step = 0
        if restored is None:
            print(f"no checkpoint in {ckpt_dir}: starting at step 0", flush=True)
        else:
            step = restored.step
            print(f"resumed from step {step} ({restored.path}, "
                  f"saved loss {restored.extra['loss']:.4f})", flush=True)

        losses: dict[int, str] = {}
        model.train()
        while step < TOTAL_STEPS:
            for (batch,) in loader:  # a new epoch each time round, except right after a resume
                step += 1
                batch = batch.to(device)
                inputs, targets = batch[:, :-1], batch[:, 1:]
                logits = model(inputs)
                loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()

                value = loss.item()
                losses[step] = value.hex()  # float.hex is exact: compares bit for bit
                print(f"step {step} loss {value.hex()}", flush=True)
                if step % SAVE_EVERY == 0:
                    url = mgr.save(step=step, tokens_seen=step * BATCH_SIZE * SEQ_LEN,
                                   extra={"loss": value})
                    print(f"checkpoint {url}", flush=True)
                if step == TOTAL_STEPS:
                    break

    record = {"resumed_from": None if restored is None else restored.step, "losses": losses}
    Path(losses_path).write_text(json.dumps(record, indent=1))


# -- the demo driver ------------------------------------------------------------------------


def train_command(ckpt_dir: Path, losses: Path, device: str) -> list[str]:
    return [sys.executable, "-u", __file__, "train", "--ckpt-dir", str(ckpt_dir),
            "--losses", str(losses), "--device", device]


def follow(name: str, proc: subprocess.Popen[str], kill_after: int | None = None) -> int:
    """Echo a run's progress (every SAVE_EVERY steps); SIGKILL it after step `kill_after`.

    Returns the last step the run reported.
    """
    assert proc.stdout is not None
    last_step = 0
    for line in proc.stdout:
        words = line.split()
        if words[:1] == ["step"]:
            last_step = int(words[1])
            if last_step % SAVE_EVERY == 0:
                print(f"  [{name}] step {last_step:3d}  loss {float.fromhex(words[3]):.4f}")
            if kill_after is not None and last_step >= kill_after and proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)  # no cleanup, no final save: a crash
                kill_after = None
        elif words[:1] == ["checkpoint"]:
            print(f"  [{name}] checkpoint {words[1].rsplit('/', 1)[-1]}")
        else:
            print(f"  [{name}] {line.rstrip()}")
    proc.wait()
    return last_step


def run(name: str, ckpt_dir: Path, losses: Path, device: str,
        kill_after: int | None = None) -> None:
    """Start one training run in a subprocess and follow it to its end (or its kill)."""
    started = time.perf_counter()
    proc = subprocess.Popen(train_command(ckpt_dir, losses, device), stdout=subprocess.PIPE,
                            text=True)
    last_step = follow(name, proc, kill_after)
    seconds = time.perf_counter() - started
    if kill_after is not None:
        if proc.returncode != -signal.SIGKILL:
            sys.exit(f"the {name} run ended with exit code {proc.returncode} before it was killed")
        print(f"  [{name}] killed with SIGKILL after step {last_step} ({seconds:.1f} s)")
    elif proc.returncode != 0:
        sys.exit(f"the {name} run failed with exit code {proc.returncode}")
    else:
        print(f"  [{name}] done in {seconds:.1f} s")


def complete_checkpoints(ckpt_dir: Path) -> list[str]:
    # A checkpoint is complete once its manifest.json exists: statereg writes it last.
    return sorted(p.parent.name for p in ckpt_dir.glob("step_*/manifest.json"))


def compare(reference: dict, resumed: dict) -> int:
    """Print the verdict; 0 if every resumed step's loss equals the reference bit for bit."""
    start = resumed["resumed_from"]
    if start is None:
        print("FAILED: the resumed run found no checkpoint to resume from")
        return 1
    steps = range(start + 1, TOTAL_STEPS + 1)
    for step in steps:
        want = reference["losses"][str(step)]
        got = resumed["losses"].get(str(step))
        if got != want:
            print(f"FAILED: resumed from step {start}, the loss first differs at step {step}: "
                  f"uninterrupted {float.fromhex(want)!r} ({want}), "
                  f"resumed {got and float.fromhex(got)!r} ({got})")
            return 1
    print(f"resumed from step {start}: losses for steps {steps[0]}..{steps[-1]} are "
          "bit-identical to the uninterrupted run")
    return 0


def demo(workdir: Path, device: str = "cpu") -> int:
    print(f"statereg demo: {TOTAL_STEPS} steps of a tiny transformer LM on {device}, "
          f"checkpoint every {SAVE_EVERY} steps\nwork directory: {workdir}\n")

    print(f"[1/3] reference run: {TOTAL_STEPS} steps, uninterrupted")
    run("reference", workdir / "reference", workdir / "reference_losses.json", device)

    print(f"\n[2/3] interrupted run: fresh checkpoint directory, SIGKILL after step {KILL_AFTER}")
    run("interrupted", workdir / "run", workdir / "interrupted_losses.json", device,
        KILL_AFTER)
    print(f"  complete checkpoints left behind: {', '.join(complete_checkpoints(workdir / 'run'))}")

    print(f"\n[3/3] resumed run: a new process calls mgr.load() and trains to step {TOTAL_STEPS}")
    run("resumed", workdir / "run", workdir / "resumed_losses.json", device)

    print(f"\n$ statereg ls {workdir / 'run'}    # keep_last: 3 retention at work")
    subprocess.run([sys.executable, "-m", "statereg.cli", "ls", str(workdir / "run")], check=True)

    reference = json.loads((workdir / "reference_losses.json").read_text())
    resumed = json.loads((workdir / "resumed_losses.json").read_text())
    print()
    return compare(reference, resumed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the demo writes checkpoints and losses (default: a new "
                        "temporary directory)")
    parser.add_argument("--device", default="cpu",
                        help="where the model trains: cpu (default), cuda, cuda:1, ...")
    sub = parser.add_subparsers(dest="command")
    one = sub.add_parser("train", help="one training run (what the demo starts three times)")
    one.add_argument("--ckpt-dir", required=True, help="checkpoint root: a path or a URL")
    one.add_argument("--losses", required=True, help="JSON file for the loss of every step")
    one.add_argument("--device", default="cpu", help="where the model trains")
    args = parser.parse_args()
    if args.command == "train":
        train(args.ckpt_dir, args.losses, args.device)
        return 0
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="statereg-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if any(workdir.iterdir()):
        sys.exit(f"--workdir {workdir} is not empty; the demo needs fresh checkpoint "
                 "directories (remove it, or pass another)")
    return demo(workdir, args.device)


if __name__ == "__main__":
    sys.exit(main())
