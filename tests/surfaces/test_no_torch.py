"""The base install works without torch (docs/install.md): convert, quantize, generate, chat and serve.

torch is an extra (`pip install 'clover-toolkit[reference]'`), needed only by clover-ref and training. Each
command runs in a subprocess whose import system refuses torch (and transformers, which would pull it in), so
a module-level `import torch` anywhere on these paths fails here. clover-ref itself says what to install.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from clover_dev import REPO_ROOT

BLOCK_TORCH = """
import importlib.abc, runpy, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
sys.meta_path.insert(0, NoTorch())
"""
# argv: MODULE ARGS...; runs MODULE as __main__ with torch unimportable
NO_TORCH = BLOCK_TORCH + """
module, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def run(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", NO_TORCH, module, *args], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=300)


def test_the_blocker_blocks() -> None:
    done = run("clover_ref.batched")  # the reference's model code imports torch at module level
    assert done.returncode != 0 and "blocked by the test" in done.stderr


@pytest.mark.native
def test_base_commands_run_without_torch(tmp_path: Path) -> None:
    f16, q8 = tmp_path / "demo-f16.gguf", tmp_path / "demo-Q8_0.gguf"
    done = run("clover_convert", str(REPO_ROOT / "models" / "clover-demo"), "--outfile", str(f16), "--outtype", "f16")
    assert done.returncode == 0, done.stderr[-2000:]
    done = run("clover_quantize.cli", str(f16), str(q8), "Q8_0")
    assert done.returncode == 0, done.stderr[-2000:]
    done = run("clover_cpp.cli", "generate", "-m", str(q8), "-p", "def add(a, b):", "-n", "8", "--mode", "spec",
               "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    assert '"tokens"' in done.stdout
    # chat and serve: their whole import graph, and their argument handling up to the model load
    missing = str(tmp_path / "missing.gguf")
    code = ("import clover_cpp.chat, clover_cpp.launch\n"
            "from clover_cpp.cli import main\n"
            f"sys.exit(10 * main(['chat', '-m', {missing!r}]) + main(['serve', '-m', {missing!r}]))")
    done = subprocess.run([sys.executable, "-c", BLOCK_TORCH + code], capture_output=True, text=True, cwd=REPO_ROOT)
    assert done.returncode == 22 and done.stderr.count("missing.gguf") == 2, (done.returncode, done.stderr[-2000:])


def test_clover_ref_names_the_extra() -> None:
    done = run("clover_ref.cli", "generate", "somewhere", "-p", "x")
    assert done.returncode == 2
    assert done.stderr.strip() == ("clover-ref: error: clover-ref needs PyTorch, which the base install leaves out: "
                                   "pip install 'clover-toolkit[reference]'")
