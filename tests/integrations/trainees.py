"""Real training runs for the integration tests, run in child processes forked from the
suite's forkserver (tests/child_processes.py preloads this module, so a child starts without
importing transformers and accelerate again: seconds of CPU per rank on two cores).

`launch(entry, config, nprocs)` runs `entry(rank, config)` on `nprocs` processes (joined in a
gloo group through torch.distributed's env:// rendezvous when nprocs > 1, as torchrun would)
and returns their exit codes. A run told `kill_after=K` sends itself SIGKILL right after
step K: no cleanup, no final save, no `finally`, as when a node dies; when one rank dies
the launcher SIGKILLs the others, as torchrun does.

Each rank appends one JSON line per optimizer step to `<records>/rank<r>.jsonl` (the exact
loss, gradient norm and learning rate, as float.hex), and at the end one line with a digest of
its parameters: the tests compare these bit for bit.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import random
import resource
import signal
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

import statereg
from statereg.integrations import accelerate as sr_accelerate
from statereg.integrations import transformers as sr_transformers

VOCAB = 32
SEQ = 8


class MarkovTokens(torch.utils.data.Dataset):
    """`n` token sequences from a fixed random Markov chain, the same in every process."""

    def __init__(self, n: int, seed: int = 1234) -> None:
        gen = torch.Generator().manual_seed(seed)
        trans = torch.softmax(torch.randn(VOCAB, VOCAB, generator=gen) * 3, dim=-1)
        tokens = torch.empty(n, SEQ, dtype=torch.long)
        tokens[:, 0] = torch.randint(VOCAB, (n,), generator=gen)
        for t in range(SEQ - 1):
            tokens[:, t + 1] = torch.multinomial(trans[tokens[:, t]], 1, generator=gen)[:, 0]
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    """A 2-layer GPT-2 built from a config, with dropout everywhere."""
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=2, n_head=2,
                        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    return GPT2LMHeadModel(config)


def digest(module: nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Records:
    """One rank's record file: a JSON line per step, flushed at once (a SIGKILL keeps it)."""

    def __init__(self, directory: str, rank: int) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.file = open(Path(directory) / f"rank{rank}.jsonl", "a")  # noqa: SIM115

    def write(self, **fields: Any) -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        fields["cpu_s"] = round(usage.ru_utime + usage.ru_stime, 3)
        self.file.write(json.dumps(fields) + "\n")
        self.file.flush()


def _hex(value: Any) -> str | None:
    return None if value is None else float(value).hex()


class RecordAndKill(TrainerCallback):
    """Records each step's logged loss, grad norm and LR; SIGKILLs the process after
    step `kill_after`."""

    def __init__(self, records: Records, kill_after: int | None) -> None:
        self.records = records
        self.kill_after = kill_after

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.records.write(start=state.global_step)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if logs and "loss" in logs:
            self.records.write(step=state.global_step, loss=_hex(logs["loss"]),
                               grad_norm=_hex(logs.get("grad_norm")),
                               lr=_hex(logs.get("learning_rate")))

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        # After the step's log and save (the Trainer calls on_step_end before them, so the
        # kill happens at the next step's start: the state of step K is never saved).
        if self.kill_after is not None and state.global_step > self.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)


def _distributed_env(rank: int, config: dict[str, Any]) -> None:
    world = config.get("world_size", 1)
    if world > 1:
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank),
                           "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(config["port"])})


def _deterministic() -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    warnings.filterwarnings("ignore")


def _hook(config: dict[str, Any], *objects: Any) -> None:
    """Call `config["hook"]` ("module:function") with the run's objects: where a recipe for
    DDP's first-iteration behaviour (issue 26) plugs in."""
    spec = config.get("hook") or os.environ.get("STATEREG_TEST_DDP_HOOK")
    if spec:
        module, _, name = spec.partition(":")
        getattr(importlib.import_module(module), name)(*objects)


# -- the Hugging Face Trainer ----------------------------------------------------------------


def trainer_args(config: dict[str, Any]) -> TrainingArguments:
    return TrainingArguments(
        output_dir=config["output_dir"], max_steps=config["max_steps"],
        per_device_train_batch_size=4, learning_rate=3e-3, lr_scheduler_type="cosine",
        warmup_steps=3, weight_decay=0.1, max_grad_norm=1.0, logging_steps=1,
        save_strategy=config.get("save_strategy", "steps"), save_steps=config["save_steps"],
        save_total_limit=config.get("save_total_limit"),
        eval_strategy=config.get("eval_strategy", "no"),
        eval_steps=config.get("eval_steps"),
        metric_for_best_model=config.get("metric_for_best_model"),
        load_best_model_at_end=config.get("load_best_model_at_end", False),
        save_only_model=config.get("save_only_model", False),
        per_device_eval_batch_size=4, seed=0, report_to="none", disable_tqdm=True,
        use_cpu=True, dataloader_drop_last=True, ddp_backend="gloo" if
        config.get("world_size", 1) > 1 else None)


def train_hf(rank: int, config: dict[str, Any]) -> None:
    """One StateregTrainer run (or one rank of it): the user's script, plus recording."""
    _distributed_env(rank, config)
    _deterministic()
    records = Records(config["records"], rank)
    args = trainer_args(config)
    model = tiny_gpt2()
    trainer = sr_transformers.StateregTrainer(
        model=model, args=args, train_dataset=MarkovTokens(config.get("samples", 48)),
        eval_dataset=MarkovTokens(8, seed=99) if config.get("eval_strategy") else None,
        callbacks=[RecordAndKill(records, config.get("kill_after"))],
        statereg=config.get("statereg"))
    _hook(config, trainer)
    trainer.train(resume_from_checkpoint=config.get("resume"))
    records.write(final=digest(trainer.model), best=trainer.state.best_model_checkpoint,
                  global_step=trainer.state.global_step)


# -- Accelerate -------------------------------------------------------------------------------


def train_accelerate(rank: int, config: dict[str, Any]) -> None:
    """A plain Accelerate loop, checkpointed with statereg's save_state / load_state."""
    from accelerate import Accelerator, DataLoaderConfiguration
    from torchdata.stateful_dataloader import StatefulDataLoader

    _distributed_env(rank, config)
    _deterministic()
    records = Records(config["records"], rank)
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
        use_stateful_dataloader=True, use_seedable_sampler=True))
    random.seed(0)
    np.random.seed(0)
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    total = config["max_steps"]
    # Accelerate steps a scheduler once per process per step: the schedule spans them all.
    span = total * config.get("world_size", 1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 3) * (1 - s / (span + 1)))
    # torchdata's loader keeps its own sampler's state (one process); a torch DataLoader gets
    # accelerate's seedable sampler, whose order comes from seed + epoch.
    make = StatefulDataLoader if config.get("loader") == "torchdata" else \
        torch.utils.data.DataLoader
    loader = make(MarkovTokens(config.get("samples", 48)), batch_size=4, shuffle=True,
                  drop_last=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader,
                                                              scheduler)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    spec = config["statereg"]
    restored = sr_accelerate.load_state(accelerator, spec)
    step = restored.step if restored is not None else 0
    records.write(start=step)
    kill_after = config.get("kill_after")
    model.train()
    while step < total:
        for batch in loader:
            out = model(**batch)
            accelerator.backward(out.loss)
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            counter.seen += len(batch["input_ids"])
            records.write(step=step, loss=_hex(out.loss.item()), grad_norm=_hex(grad_norm),
                          lr=_hex(scheduler.get_last_lr()[0]))
            if step % config["save_steps"] == 0:
                sr_accelerate.save_state(accelerator, spec, step,
                                         extra={"loss": out.loss.item()})
            if kill_after is not None and step == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
            if step == total:
                break
    sr_accelerate.wait(accelerator)
    records.write(final=digest(accelerator.unwrap_model(model)), seen=counter.seen)


class Counter:
    """A custom object registered with accelerator.register_for_checkpointing."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seen = state["seen"]


# -- the launcher (runs in the test process) --------------------------------------------------


def launch(entry: Any, config: dict[str, Any], nprocs: int = 1, timeout: float = 120) -> list[int]:
    """Run entry(rank, config) on `nprocs` forkserver children; their exit codes."""
    from child_processes import forkserver_context
    from storage_servers import free_port

    context = forkserver_context()
    config = {**config, "world_size": nprocs, "port": free_port()}
    procs = [context.Process(target=entry, args=(rank, config)) for rank in range(nprocs)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    try:
        while any(p.exitcode is None for p in procs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{entry.__name__} did not finish in {timeout} s")
            if any(p.exitcode not in (None, 0) for p in procs):
                break  # one rank died: take the others down, as torchrun does
            time.sleep(0.05)
    finally:
        for proc in procs:
            if proc.exitcode is None:
                proc.kill()
            proc.join()
    return [p.exitcode for p in procs]


@dataclass
class Run:
    """One rank's records of one run: where it started, each step, and its last line."""

    start: int
    steps: dict[int, dict[str, Any]]
    final: dict[str, Any]
    cpu_s: float


def read_records(directory: Path, rank: int = 0) -> Run:
    """The records one rank of one run wrote (the CPU seconds exclude the forkserver's
    imports, which every child shares)."""
    rows = [json.loads(line) for line in (directory / f"rank{rank}.jsonl").read_text()
            .splitlines()]
    start = next(r["start"] for r in rows if "start" in r)
    final = next((r for r in rows if "final" in r), {})
    # step records lose the bookkeeping so that runs compare field by field
    steps = {r["step"]: {k: v for k, v in r.items() if k != "cpu_s"} for r in rows
             if "step" in r}
    return Run(start, steps, final, rows[-1]["cpu_s"])


__all__ = ["launch", "read_records", "statereg", "train_accelerate", "train_hf"]
