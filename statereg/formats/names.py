"""File names of every stored format, torch-free: the plan predicts them, writers use them."""

from __future__ import annotations

from collections.abc import Iterable

from statereg.dcp import METADATA_NAME

# DCP's own names: one metadata file per checkpoint directory, data files per rank.
DCP_METADATA_NAME = METADATA_NAME
DCP_DATA_SUFFIX = ".distcp"
# An optimizer's param groups and scalar state, beside its DCP tensors.
SIDECAR_NAME = "extra.json"
# format torch keeps a model's full state dict in one file.
TORCH_MODEL_NAME = "model.pt"
# Hugging Face safetensors directories.
SAFETENSORS_SUFFIX = ".safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
SAFETENSORS_SINGLE_NAME = "model.safetensors"
# Object state: one file per copy.
STATE_STEM = "state"


def dcp_data_files(collective_rank: int) -> str:
    """The glob of the data files DCP names after a rank's place in its collective."""
    return f"__{collective_rank}_*{DCP_DATA_SUFFIX}"


def shard_file_name(index: int, count: int) -> str:
    return f"model-{index:05d}-of-{count:05d}{SAFETENSORS_SUFFIX}"


def object_suffix(fmt: str) -> str:
    return ".pt" if fmt == "torch" else ".json"


def rank_file(rank: int, fmt: str = "json") -> str:
    return f"rank_{rank:05d}{object_suffix(fmt)}"


def group_by_size(sizes: Iterable[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Names grouped into files of at most `max_bytes`, in order; a larger tensor is alone.

    Deterministic from names and sizes, so every rank (and `statereg plan`) computes the same
    files.
    """
    groups: list[list[str]] = []
    size = 0
    for name, nbytes in sizes:
        if not groups or (size + nbytes > max_bytes and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups
