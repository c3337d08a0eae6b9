"""Shared fixtures: random checkpoints made once per test session by the checkpoint factory."""

from __future__ import annotations

from pathlib import Path

import pytest

from clover_ref.factory import init_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tiny` preset (3 GDN + 1 attention layer, 8 experts top-2, vocab 3072, B = 8), bf16, seed 0."""
    out = tmp_path_factory.mktemp("tiny")
    init_checkpoint(out, "tiny", seed=0)
    return out


@pytest.fixture(scope="session")
def mid_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `mid` preset: real Qwen3.5-35B-A3B per-layer dims, 4 layers, 16 experts top-8, bf16, seed 0."""
    out = tmp_path_factory.mktemp("mid")
    init_checkpoint(out, "mid", seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoint: Path):
    from clover_ref.checkpoint import load_model

    return load_model(tiny_checkpoint)


@pytest.fixture(scope="session")
def mid_model(mid_checkpoint: Path):
    from clover_ref.checkpoint import load_model

    return load_model(mid_checkpoint)
