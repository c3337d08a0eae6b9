"""Developer tooling that the tests and the benchmarks share, and that the installed wheel does not carry: making
model files (convert.py), native passes (native.py), logit metrics (metrics.py), processes (process.py) and the
transformers oracle (reference.py). Nothing here asserts: the checks belong to the tests (tests/support/)."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
VENV_PYTHON = REPO_ROOT / ".venv" / "bin" / "python"
