"""`pip wheel .` builds the patched llama.cpp into a portable wheel that runs in a fresh venv (docs/install.md).

Slow (marker `slow`) and opt-in (CLOVER_TEST_WHEEL=1; otherwise skipped with that reason): the wheel's native
build is the portable one (GGML_NATIVE=OFF, GGML_BACKEND_DL=ON, GGML_CPU_ALL_VARIANTS=ON: ggml's CPU backend once
per x86 level), a build folder of its own in $CLOVER_CACHE; ccache makes a rebuild fast, but the first one
compiles everything with other flags than `make native` (docs/install.md has the time). Run it with
`CLOVER_TEST_WHEEL=1 pytest -m slow tests/surfaces/test_wheel.py`.

The wheel is installed into a new venv (its dependencies from the package index, no torch), with no
PYTHONPATH, LLAMA_CPP_LIB_PATH or CLOVER_NATIVE_LIB: `clover-convert` makes the demo GGUF, `clover-cpp generate`
continues a prompt in ar mode, and the tokens must equal the checkout's engine (build/native, -march=native) on
the same GGUF. A plain `import llama_cpp` there loads the wheel's own libllama.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clover_dev import REPO_ROOT


pytestmark = [pytest.mark.slow, pytest.mark.native]

PROMPT = "def fibonacci(n):"


def clean_env(**extra: str) -> dict[str, str]:
    drop = {"PYTHONPATH", "LLAMA_CPP_LIB_PATH", "CLOVER_NATIVE_LIB", "CLOVER_LLAMA_LIB_DEFAULT", "VIRTUAL_ENV"}
    return {k: v for k, v in os.environ.items() if k not in drop} | extra


def run(cmd: list[str], cwd: Path, timeout: int, **env: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=timeout, env=clean_env(**env))
    assert done.returncode == 0, f"{' '.join(cmd)}:\n{(done.stdout + done.stderr)[-4000:]}"
    return done


def test_wheel_in_a_fresh_venv(tmp_path: Path) -> None:
    if os.environ.get("CLOVER_TEST_WHEEL") != "1":
        pytest.skip("the wheel build is opt-in: set CLOVER_TEST_WHEEL=1 (a portable native build, see the docstring)")
    from clover_cpp import Model

    wheels = tmp_path / "wheels"
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(wheels), str(REPO_ROOT)], REPO_ROOT, 5400)
    (wheel,) = wheels.glob("clover_toolkit-*.whl")
    assert "none-any" not in wheel.name, wheel.name  # platform-specific: it carries native libraries

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], tmp_path, 300)
    py = venv / "bin" / "python"
    run([str(py), "-m", "pip", "install", str(wheel)], tmp_path, 1800)
    done = subprocess.run([str(py), "-c", "import torch"], capture_output=True, text=True, env=clean_env())
    assert done.returncode != 0, "the base install pulled in torch"

    gguf = tmp_path / "demo-f16.gguf"
    run([str(venv / "bin" / "clover-convert"), str(REPO_ROOT / "models" / "clover-demo"), str(gguf),
         "--outtype", "f16"], tmp_path, 600)
    done = run([str(venv / "bin" / "clover-cpp"), "generate", "-m", str(gguf), "-p", PROMPT, "--mode", "ar",
                "-n", "12", "--json"], tmp_path, 600)
    got = json.loads(done.stdout)

    with Model(str(gguf), n_ctx=256) as model:
        want = model.run(model.tokenize(PROMPT), mode="ar", max_tokens=12).tokens
    assert got["tokens"] == want

    code = ("import pathlib, llama_cpp; print(pathlib.Path(llama_cpp.llama_cpp._base_path).resolve()); "
            "import clover_native.loader as n; print(n.lib_dir().resolve())")
    done = run([str(py), "-c", code], tmp_path, 300)
    lib, clover_lib = done.stdout.split()
    assert Path(lib) == Path(clover_lib) and Path(lib).is_relative_to(venv.resolve()), done.stdout
    for tool in ("llama-server", "llama-perplexity", "rpc-server", "llama-clover"):
        assert (Path(lib) / tool).is_file(), tool
    assert list(Path(lib).glob("libggml-cpu-*.so")), "no run-time CPU variants in the wheel"
