"""Fixtures shared by the server tests (test_serve_live.py, test_serve_endpoints.py): the tiny checkpoint's GGUF,
converted once per run, and the reference that answers as the server should."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.chat import Reference
from clover_dev.convert import clover_convert
from tests.support.serve import MODEL_ID


@pytest.fixture(scope="module")
def ref(tiny_checkpoint: Path, tiny_model: Any) -> Reference:
    return Reference(tiny_checkpoint, tiny_model)


@pytest.fixture(scope="session")
def tiny_gguf(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint as an f32 GGUF named after MODEL_ID (a server's model id is the file's name)."""
    return clover_convert(tiny_checkpoint, tmp_path_factory.mktemp("serve") / f"{MODEL_ID}.gguf", "f32")
