"""Which sharing patterns fit which kinds and formats: decided once, here, with the reason.

`ComponentSpec` refuses a combination marked "refuse" at `load_spec` and warns about one
marked "warn"; docs/distributed.md prints the same table (`render_table`), and the JSON
Schema's `sharing` description points at it. Torch-free, like the rest of `schemas`.
"""

from __future__ import annotations

from typing import Literal

Verdict = Literal["ok", "warn", "refuse"]

_NO_SHARDS = "its state has no shards to split over ranks; declare global (or per_rank)"
_RANK0_POSITION = (
    "only rank 0's state is saved and every rank resumes from it: right only when every "
    "rank reads the same data in the same order; declare per_rank (the default) otherwise"
)
_RNG_ONE_COPY = (
    "every rank would restore rank 0's generators, so dropout masks and sampling would be "
    "identical on all ranks; declare per_rank (the default), or per_group for ranks that "
    "must draw the same numbers (e.g. a tensor-parallel group)"
)

# (kind, sharing) -> (verdict, reason). Missing pairs are "ok".
KIND_SHARING: dict[tuple[str, str], tuple[Verdict, str]] = {
    ("scheduler", "sharded"): ("refuse", _NO_SHARDS),
    ("dataloader", "sharded"): ("refuse", _NO_SHARDS),
    ("dataloader", "global"): ("warn", _RANK0_POSITION),
    ("dataloader", "replicated"): ("warn", _RANK0_POSITION),
    ("rng", "sharded"): ("refuse", _NO_SHARDS),
    ("rng", "global"): ("refuse", _RNG_ONE_COPY),
    ("rng", "replicated"): ("warn", _RNG_ONE_COPY),
}

# (format, sharing) -> reason, for object state (not a model's tensors) in whole files.
OBJECT_FILE_SHARING: dict[str, str] = {
    "sharded": "a json or torch file holds whole objects, not shards; use format dcp, whose "
               "files hold each rank's shards, or declare global",
}


def verdict(kind: str, sharing: str, fmt: str) -> tuple[Verdict, str]:
    """Whether `kind` stored as `fmt` may be declared with `sharing`, and why not."""
    if fmt in ("json", "torch") and kind != "model" and sharing in OBJECT_FILE_SHARING:
        return "refuse", OBJECT_FILE_SHARING[sharing]
    return KIND_SHARING.get((kind, sharing), ("ok", ""))


def render_table() -> str:
    """The kind x sharing table as Markdown (docs/distributed.md holds this output)."""
    kinds = ("model", "optimizer", "scheduler", "dataloader", "rng", "custom")
    sharings = ("global", "replicated", "per_rank", "per_group", "sharded")
    lines = ["| kind | " + " | ".join(sharings) + " |",
             "|---|" + "---|" * len(sharings)]
    for kind in kinds:
        cells = [KIND_SHARING.get((kind, s), ("ok", ""))[0] for s in sharings]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
