"""`make demo`'s script (scripts/demo.py) on what `make demo` runs: the demo model converted to f16 and quantized to
Q4_K_M by clover-quantize. It prints each mode's continuation and the table of modes, then a chat exchange in which
the model calls the tool it is offered, gets its result and answers."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from clover_dev import REPO_ROOT, VENV_PYTHON
from clover_dev.convert import clover_convert

pytestmark = pytest.mark.native


def test_make_demo_script(tmp_path: Path) -> None:
    f16 = clover_convert(REPO_ROOT / "models" / "clover-demo", tmp_path / "clover-demo-f16.gguf", "f16")
    q4 = tmp_path / "clover-demo-Q4_K_M.gguf"
    subprocess.run([str(VENV_PYTHON.parent / "clover-quantize"), str(f16), str(q4), "Q4_K_M"], check=True,
                   capture_output=True, timeout=300)
    done = subprocess.run([str(VENV_PYTHON), str(REPO_ROOT / "scripts" / "demo.py"), str(q4)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    for mode in ("ar", "auto", "diffusion", "spec"):
        assert f"--- {mode} (B=32" in out and f"\n| {mode} | " in out, out
    chat = out[out.index("--- chat: a tool call"):]
    assert 'assistant calls read_file({"path": "' in chat and "\ntool: " in chat, chat
    final = chat.splitlines()[-1]
    assert final.startswith("assistant: ") and len(final) > len("assistant: "), chat
