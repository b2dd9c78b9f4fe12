"""Component options across the schema's matrix: each option below, on every kind x sharing
x format the schema accepts it with (the schema decides), saved by 1 and by 2 real gloo
ranks, loads into fresh objects bit for bit. `trainable_only` leaves buffers out by design
(docs/formats.md): its parameters come back exactly and its buffer keeps the fresh value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from harness import run_ranks
from matrix import (
    ACCEPTED,
    Case,
    assert_none_failed,
    bitwise_equal,
    declaration,
    pipeline_groups,
    reported,
    seed_for,
)
from pydantic import ValidationError

import statereg
from statereg.schemas.spec import ComponentSpec

OPTIONS: dict[str, dict[str, Any]] = {
    "prefix add": {"prefix": {"add": "net."}},
    "prefix drop and add": {"prefix": {"drop": "lin.", "add": "layer."}},
    "max_shard_size": {"max_shard_size": 64},  # several safetensors files for 6x4 floats
    "trainable_only": {"trainable_only": True},
    "validate_replicas": {"validate_replicas": True},
    "on_world_size_change reshard": {"on_world_size_change": "reshard"},
    "on_world_size_change reset": {"on_world_size_change": "reset"},
}
BUFFERS = {"count"}  # Net's buffer (matrix.py): not a parameter


class OptionCase(Case):
    """A matrix case whose component declares `options` too."""

    def __init__(self, combo: tuple[str, str, str], root: Path, world: int,
                 options: dict[str, Any]) -> None:
        super().__init__(combo, root, world)
        self.declared = options

    def spec(self, url: str | None = None) -> dict[str, Any]:
        spec = super().spec(url)
        spec["components"]["c"].update(self.declared)
        return spec


def _accepts(combo: tuple[str, str, str], options: dict[str, Any]) -> bool:
    try:
        ComponentSpec.model_validate(declaration(*combo) | options)
    except ValidationError:
        return False
    return True


def options_pass(rank: int, world: int, root: Path) -> None:
    groups = pipeline_groups(rank, world)
    failures: list[str] = []
    for label, options in OPTIONS.items():
        for combo in (c for c in ACCEPTED if _accepts(c, options)):
            case = OptionCase(combo, root / label.replace(" ", "-"), world, options)
            where = f"{label} on {'/'.join(combo)}"
            with reported(failures, where):
                objects = case.objects(seed_for(1, case.sharing, rank, groups))
                with statereg.CheckpointManager(case.spec(), groups=groups,
                                                **objects) as mgr:
                    mgr.save(step=1)
                saved = case.snapshot(case.objects(seed_for(1, case.sharing, rank, groups)))
                fresh = case.objects(seed_for(5000, case.sharing, rank, groups))
                with statereg.CheckpointManager(case.spec(), groups=groups, **fresh) as mgr:
                    mgr.load()
                loaded = case.snapshot(fresh)
                if "trainable_only" in options:
                    left_out = {k: saved.pop(k) for k in BUFFERS}
                    if bitwise_equal(left_out, {k: loaded.pop(k) for k in BUFFERS}):
                        failures.append(f"{where}: a buffer came back")
                if not bitwise_equal(saved, loaded):
                    failures.append(f"{where}: not bit-identical on rank {rank}")
    assert_none_failed(failures, world)


@pytest.mark.parametrize("world", [1, 2])
def test_every_component_option_round_trips_on_every_combination_it_applies_to(
        tmp_path: Path, world: int) -> None:
    run_ranks(world, options_pass, tmp_path, tmp_path / "matrix")
