"""The synthetic training state: a decoder-style transformer after one real AdamW step.

Weights come from PyTorch's default initialisation; the two Adam moments come from a real
forward, backward and `AdamW.step()` on random tokens, so every tensor kind has the value
distribution a checkpoint of an early training step has. The bf16 variant is the same model
cast to bfloat16 and stepped once more with its own bf16 AdamW.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

KINDS = ("weights", "exp_avg", "exp_avg_sq", "other")


def tensor_kind(key: str) -> str:
    """Which kind of tensor a state key names (flat keys and statereg's stored keys alike)."""
    if key.endswith(".exp_avg_sq"):
        return "exp_avg_sq"
    if key.endswith(".exp_avg"):
        return "exp_avg"
    if key.endswith(".step"):
        return "other"
    return "weights"


class Transformer(nn.Module):
    """Token embedding, pre-norm encoder blocks, final norm and an untied output head."""

    def __init__(self, vocab: int, width: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, max(1, width // 64), 4 * width, dropout=0.0,
                                       batch_first=True, norm_first=True)
            for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def shape_for(params: float) -> tuple[int, int, int]:
    """(vocab, width, layers) of a transformer with about `params` parameters."""
    width = 1024 if params >= 1e8 else 512 if params >= 1e7 else 256 if params >= 1e6 else 64
    # Embedding and head together hold about a quarter of the parameters, as in GPT-2 small.
    vocab = max(256, min(32 * width, int(0.125 * params / width) // 64 * 64))
    per_layer = 12 * width * width + 13 * width
    layers = max(1, round((params - 2 * vocab * width) / per_layer))
    return vocab, width, layers


def backward_once(model: nn.Module, vocab: int, seed: int) -> None:
    """Gradients of a next-token loss on random tokens."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(vocab, (2, 33), generator=generator)
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()


def train_one_step(model: nn.Module, optimizer: torch.optim.Optimizer, vocab: int,
                   seed: int) -> None:
    backward_once(model, vocab, seed)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@dataclass
class TrainingState:
    """A model and its AdamW optimizer, plus the flat name -> tensor view peers save."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    dtype: torch.dtype

    @property
    def flat(self) -> dict[str, torch.Tensor]:
        names = {id(p): n for n, p in self.model.named_parameters()}
        flat = {f"model.{k}": v for k, v in self.model.state_dict().items()}
        for param, entries in self.optimizer.state.items():
            for key, value in entries.items():
                if isinstance(value, torch.Tensor):
                    flat[f"optim.{names[id(param)]}.{key}"] = value
        return flat

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.flat.values())

    @property
    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def bytes_by_kind(self) -> dict[str, int]:
        sizes = dict.fromkeys(KINDS, 0)
        for key, tensor in self.flat.items():
            sizes[tensor_kind(key)] += tensor.nbytes
        return sizes

    def mutate(self) -> None:
        """What optimizer.step() does to the state in place (values kept), for async saves."""
        with torch.no_grad():
            for param in self.model.parameters():
                param.mul_(1.0)


def build_fp32(params: float, seed: int = 0) -> TrainingState:
    vocab, width, layers = shape_for(params)
    torch.manual_seed(seed)
    model = Transformer(vocab, width, layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_one_step(model, optimizer, vocab, seed)
    return TrainingState(model, optimizer, torch.float32)


def build_bf16(fp32: TrainingState, seed: int = 1) -> TrainingState:
    """The fp32 model's weights in bf16 after one bf16 AdamW step.

    Gradients are computed in fp32 and cast with the weights (`Module.to` casts `.grad`
    too), as mixed precision does: bf16 matmuls on CPUs without bf16 units are ~10x slower.
    """
    model = copy.deepcopy(fp32.model)
    backward_once(model, model.embed.num_embeddings, seed)
    model.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return TrainingState(model, optimizer, torch.bfloat16)


def linear_stack(gb: float, width: int = 2048) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A stack of square fp32 Linear layers (`width`) plus AdamW moments after one real step.

    The state of the standalone scripts (bench_async, bench_tiers, bench_replica, the suite's
    save_load scenario): `gb` of weights and two moments, at least one layer.
    """
    per_layer = width * width * 4 * 3  # weights + two Adam moments
    layers = max(1, round(gb * 1e9 / per_layer))
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return model, opt
