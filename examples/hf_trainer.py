"""Train a tiny GPT-2 with the Hugging Face Trainer, checkpointed by statereg.

    python examples/hf_trainer.py --output-dir /tmp/hf-run     # trains 60 steps
    python examples/hf_trainer.py --output-dir /tmp/hf-run     # again: nothing left to do
    STATEREG_STORAGE__URL=s3://bucket/run python examples/hf_trainer.py ...  # to S3

Kill it (Ctrl-C, or SIGKILL) and run the same command again: it resumes from the latest
committed checkpoint, and every later loss is bit-identical to a run never interrupted
(tests/integrations/test_transformers.py proves it on 1 process and on 4 DDP ranks; launch
this script with torchrun --nproc-per-node 4 for DDP on CPU).

It differs from the same script with the plain Trainer in the three lines marked
`# statereg` (docs/integrations/transformers.md shows the plain lines beside them).
"""

from __future__ import annotations

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from statereg.integrations.transformers import StateregTrainer  # statereg

VOCAB, SEQ = 64, 32


class MarkovTokens(torch.utils.data.Dataset):
    """Sequences from a fixed random Markov chain: learnable, the same in every process."""

    def __init__(self, n: int = 512, seed: int = 1234) -> None:
        gen = torch.Generator().manual_seed(seed)
        trans = torch.softmax(torch.randn(VOCAB, VOCAB, generator=gen) * 3, dim=-1)
        self.tokens = torch.empty(n, SEQ, dtype=torch.long)
        self.tokens[:, 0] = torch.randint(VOCAB, (n,), generator=gen)
        for t in range(SEQ - 1):
            self.tokens[:, t + 1] = torch.multinomial(trans[self.tokens[:, t]], 1,
                                                      generator=gen)[:, 0]

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", default="./checkpoints/hf-trainer")
    parser.add_argument("--max-steps", type=int, default=60)
    options = parser.parse_args()

    torch.use_deterministic_algorithms(True)
    args = TrainingArguments(
        output_dir=options.output_dir, max_steps=options.max_steps,
        per_device_train_batch_size=16, learning_rate=3e-3, lr_scheduler_type="cosine",
        warmup_steps=10, weight_decay=0.1, logging_steps=10, save_steps=20,
        save_total_limit=2, seed=0, report_to="none", use_cpu=True, disable_tqdm=True)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)  # dropout 0.1 in every block
    trainer = StateregTrainer(model=model, args=args, train_dataset=MarkovTokens())  # statereg
    trainer.train(resume_from_checkpoint=trainer.statereg.latest() is not None)  # statereg
    print(f"trained to step {trainer.state.global_step}")


if __name__ == "__main__":
    main()
