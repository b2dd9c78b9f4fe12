"""Fixtures of the engine tests: a checkpoint root and managers over a TinyNet saved there."""

from __future__ import annotations

import pytest

import statereg


@pytest.fixture
def root(tmp_path):
    return tmp_path / "ckpt"


@pytest.fixture
def manager(make_spec, make_model):
    """`manager(save={...}, ...)`: a CheckpointManager over a TinyNet rooted in tmp_path/ckpt."""

    def build(**sections):
        return statereg.CheckpointManager(make_spec("model", **sections), model=make_model())

    return build
