"""A plain `import llama_cpp` works in the project's venv (ecosystem issue).

llama-cpp-python is installed without a bundled libllama (LLAMA_BUILD=OFF), so it finds ours only through
LLAMA_CPP_LIB_PATH. `make native` runs scripts/install_lib_path.py, which puts a .pth into the venv that sets
it when unset. The script is tested against a temporary "venv" (the tests never modify the real one); the
real venv is checked as `make native` leaves it. Either way, llama_cpp.Llama's greedy completion must equal
`clover-cpp generate --mode ar` on the same prompt.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from clover_dev import REPO_ROOT
from clover_dev.convert import clover_convert
from tests.support.native import skip_or_fail
from tests.support.tmp import MkTemp

SCRIPT = REPO_ROOT / "scripts" / "install_lib_path.py"
PTH_NAME = "clover_llama_lib_path.pth"
PROMPT = "def fibonacci(n):"
N = 6

# Greedy completion with llama-cpp-python's high-level API; argv: [SITE_DIR or ""] MODEL PROMPT N
LLAMA_SCRIPT = """
import json, site, sys
if sys.argv[1]:
    site.addsitedir(sys.argv[1])  # what the interpreter does at start-up for the venv's site-packages
import llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[2], n_ctx=256, verbose=False)
ids = llm.tokenize(sys.argv[3].encode(), add_bos=False, special=True)
out = []
for t in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, reset=True):
    if len(out) == int(sys.argv[4]) or llama_cpp.llama_vocab_is_eog(llm._model.vocab, t):
        break
    out.append(int(t))
print(json.dumps({"lib": str(llama_cpp.llama_cpp._base_path), "prompt_ids": ids, "tokens": out}))
"""


def clean_env(**extra: str) -> dict[str, str]:
    """No PYTHONPATH, no LLAMA_CPP_LIB_PATH: what a user's fresh shell has."""
    return {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"), "LANG": "C.UTF-8", **extra}


def fake_venv(root: Path) -> Path:
    sp = root / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    sp.mkdir(parents=True)
    return sp


def install(venv: Path, lib: Path) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, str(SCRIPT), str(venv), str(lib)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done


def env_after_pth(site_dir: Path, **env: str) -> dict[str, str | None]:
    code = ("import json, os, site, sys; site.addsitedir(sys.argv[1]); "
            "print(json.dumps({k: os.environ.get(k) for k in ('LLAMA_CPP_LIB_PATH', 'CLOVER_LLAMA_LIB_DEFAULT')}))")
    # -S: not the venv's own site-packages, whose .pth (from `make native`) would set the variables first
    done = subprocess.run([sys.executable, "-S", "-c", code, str(site_dir)], capture_output=True, text=True,
                          env=clean_env(**env))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def tiny_gguf(tiny_checkpoint: Path, module_tmp: MkTemp) -> Path:
    return clover_convert(tiny_checkpoint, module_tmp("llama-import") / "tiny-f32.gguf", "f32")


@pytest.fixture(scope="module")
def clover_tokens(tiny_gguf: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "clover_cpp.cli", "generate", "-m", str(tiny_gguf), "-p", PROMPT,
                           "--mode", "ar", "-n", str(N), "--json"], capture_output=True, text=True, cwd=REPO_ROOT,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def llama_cpp_completion(site_dir: Path | None, gguf: Path, env: dict[str, str]) -> dict:
    done = subprocess.run([sys.executable, "-c", LLAMA_SCRIPT, str(site_dir or ""), str(gguf), PROMPT, str(N)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


# ------------------------------------------------------------------------------------------ the script
def test_install_script_is_idempotent(tmp_path: Path) -> None:
    sp = fake_venv(tmp_path / "venv")
    lib = tmp_path / "native" / "lib"
    lib.mkdir(parents=True)
    first = install(tmp_path / "venv", lib)
    pth = sp / PTH_NAME
    assert pth.is_file() and "written" in first.stderr
    text, mtime = pth.read_text(), pth.stat().st_mtime_ns
    assert str(lib.resolve()) in text and "LLAMA_CPP_LIB_PATH" in text
    again = install(tmp_path / "venv", lib)
    assert "up to date" in again.stderr and pth.read_text() == text and pth.stat().st_mtime_ns == mtime
    assert sorted(p.name for p in sp.iterdir()) == [PTH_NAME]  # no temporary file left
    other = tmp_path / "other"
    other.mkdir()
    install(tmp_path / "venv", other)
    assert str(other.resolve()) in pth.read_text() and str(lib.resolve()) not in pth.read_text()


def test_install_script_errors(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), str(tmp_path)], capture_output=True, text=True)
    assert done.returncode != 0 and "site-packages" in done.stderr
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 2 and "usage" in done.stderr


def test_pth_sets_the_path_only_when_unset(tmp_path: Path) -> None:
    sp = fake_venv(tmp_path / "venv")
    lib = tmp_path / "lib"
    lib.mkdir()
    install(tmp_path / "venv", lib)
    assert env_after_pth(sp) == {"LLAMA_CPP_LIB_PATH": str(lib.resolve()),
                                 "CLOVER_LLAMA_LIB_DEFAULT": str(lib.resolve())}
    # an explicit value wins, and is not marked as the default
    assert env_after_pth(sp, LLAMA_CPP_LIB_PATH="/somewhere") == {"LLAMA_CPP_LIB_PATH": "/somewhere",
                                                                  "CLOVER_LLAMA_LIB_DEFAULT": None}
    lib.rmdir()  # `make clean`: no default rather than a path that does not exist
    assert env_after_pth(sp) == {"LLAMA_CPP_LIB_PATH": None, "CLOVER_LLAMA_LIB_DEFAULT": None}


@pytest.mark.native
def test_plain_import_through_the_pth(tmp_path: Path, tiny_gguf: Path, clover_tokens: dict) -> None:
    """The .pth the script writes makes `import llama_cpp` load our libllama, and Llama's greedy completion
    equals clover-cpp's ar output."""
    from clover_native import loader

    lib = loader.lib_dir().resolve()
    sp = fake_venv(tmp_path / "venv")
    install(tmp_path / "venv", lib)
    bare = subprocess.run([sys.executable, "-c", "import llama_cpp"], capture_output=True, text=True, env=clean_env())
    if bare.returncode != 0:  # without the .pth (a venv before `make native` installed it): the failure
        assert "Shared library with base name 'llama' not found" in bare.stderr, bare.stderr[-2000:]
    got = llama_cpp_completion(sp, tiny_gguf, clean_env())
    assert Path(got["lib"]).resolve() == lib
    assert got["prompt_ids"] == clover_tokens["prompt_ids"]
    assert got["tokens"] == clover_tokens["tokens"] and len(got["tokens"]) == N


# ------------------------------------------------------------------------------------------ the real venv
@pytest.mark.native
def test_venv_imports_llama_cpp(tiny_gguf: Path, clover_tokens: dict) -> None:
    """The project's venv as `make native` leaves it (never modified here)."""
    pth = Path(sysconfig.get_paths()["purelib"]) / PTH_NAME
    if not pth.is_file():
        skip_or_fail(f"{pth} is missing: run `make native` (it installs the .pth that lets a plain "
                     "`import llama_cpp` find build/native/lib)")
    got = llama_cpp_completion(None, tiny_gguf, clean_env())
    assert got["prompt_ids"] == clover_tokens["prompt_ids"]
    assert got["tokens"] == clover_tokens["tokens"]


# ------------------------------------------------------------------------------------------ clover_cpp and the default
@pytest.mark.native
def test_clover_cpp_overrides_only_the_venv_default(tmp_path: Path) -> None:
    """clover_native.loader may replace the .pth's default (another build: $CLOVER_NATIVE_LIB, a git worktree), but
    not a LLAMA_CPP_LIB_PATH that a user set."""
    elsewhere = str(tmp_path)
    code = ("import os; from clover_native import loader; loader.llama(); "
            "print(os.environ['LLAMA_CPP_LIB_PATH'])")
    env = dict(os.environ, LLAMA_CPP_LIB_PATH=elsewhere, CLOVER_LLAMA_LIB_DEFAULT=elsewhere)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO_ROOT)
    from clover_native import loader

    assert done.returncode == 0, done.stderr[-2000:]
    assert Path(done.stdout.strip()).resolve() == loader.lib_dir().resolve()
    env.pop("CLOVER_LLAMA_LIB_DEFAULT")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO_ROOT)
    assert done.returncode != 0 and "points elsewhere" in done.stderr
