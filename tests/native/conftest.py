"""Fixtures the native tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from clover_dev import REPO_ROOT
from clover_dev.convert import clover_convert


@pytest.fixture(scope="session")
def demo_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped demo model as an f32 GGUF (llama.cpp's own tools and the RPC backend run it)."""
    out = tmp_path_factory.mktemp("demo") / "clover-demo-f32.gguf"
    return clover_convert(REPO_ROOT / "models" / "clover-demo", out, "f32")
