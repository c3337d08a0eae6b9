"""`pip install .` / `pip wheel .` build the patched llama.cpp into the wheel (docs/install.md).

The build hook runs scripts/build_native.sh (the pinned llama-cpp-python sdist, its sha256 check and the patch
series' dry-runs, the build cache in $CLOVER_CACHE with ccache) with PORTABLE=1: GGML_NATIVE=OFF, GGML_BACKEND_DL=ON and
GGML_CPU_ALL_VARIANTS=ON, so the wheel runs on other x86 CPUs than the builder's (llama.cpp's release recipe; the
best ggml-cpu variant is chosen at run time). CMAKE_ARGS is honoured as llama-cpp-python honours it
(CMAKE_ARGS="-DGGML_CUDA=on" pip install .). Into the wheel go:

- llama_cpp/          llama-cpp-python 0.3.36's Python bindings from the same sdist, so `import llama_cpp` works;
- llama_cpp/lib/      libllama, libggml*, libclover and ggml's run-time modules (libggml-cpu-<level>.so,
                      libggml-rpc.so), where llama_cpp looks by default; and the tools llama-server, llama-cli,
                      llama-bench, llama-perplexity, llama-quantize, llama-clover, rpc-server (RUNPATH $ORIGIN).

Editable installs (`pip install -e .`, what `make setup` does) skip the hook: a checkout uses build/native from
`make native` (-march=native). CLOVER_SKIP_NATIVE=1 skips it for any install (a pure-Python package that expects
$CLOVER_NATIVE_LIB).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent
TOOLS = ["llama-server", "llama-cli", "llama-bench", "llama-perplexity", "llama-quantize", "llama-clover", "rpc-server"]


# Appended to the wheel's llama_cpp/__init__.py: ggml's CPU backend is a run-time module here (GGML_BACKEND_DL),
# which ggml looks for beside the executable and in the working directory only; load it from llama_cpp/lib.
LOAD_BACKENDS = """

# clover-toolkit's wheel: load ggml's run-time backend modules (libggml-cpu-<level>.so, ...) from llama_cpp/lib
def _clover_load_backends() -> None:
    import ctypes as _ctypes
    import logging as _logging

    from ._logger import logger as _logger

    _l = llama_cpp._lib
    _l.ggml_backend_reg_count.restype = _ctypes.c_size_t
    if _l.ggml_backend_reg_count() == 0:
        _l.ggml_backend_load_all_from_path.argtypes = [_ctypes.c_char_p]
        level = _logger.level
        _logger.setLevel(_logging.ERROR)  # quiet, as an import with linked backends is
        try:
            _l.ggml_backend_load_all_from_path(str(llama_cpp._base_path).encode())
        finally:
            _logger.setLevel(level)


_clover_load_backends()
"""


def skip_native() -> bool:
    return os.environ.get("CLOVER_SKIP_NATIVE") == "1"


class BinaryDistribution(Distribution):
    """The wheel holds native libraries: platform-specific, not py3-none-any."""

    def has_ext_modules(self) -> bool:
        return not skip_native()


class BuildWithNative(build_py):
    def run(self) -> None:
        super().run()
        if skip_native() or self.editable_mode:
            return
        out = Path(self.build_lib).resolve()
        native = out.parent / "clover-native"
        env = dict(os.environ, PORTABLE="1", CLOVER_NATIVE_OUT=str(native), PYTHON=sys.executable)
        subprocess.run(["bash", str(ROOT / "scripts" / "build_native.sh")], check=True, env=env, stdout=sys.stderr)
        info = dict(ln.split("=", 1) for ln in (native / "BUILD_INFO").read_text().splitlines() if "=" in ln)
        pkg = out / "llama_cpp"
        if pkg.exists():
            shutil.rmtree(pkg)
        shutil.copytree(Path(info["sdist"]) / "llama_cpp", pkg, ignore=shutil.ignore_patterns("lib", "__pycache__"))
        with open(pkg / "__init__.py", "a") as f:
            f.write(LOAD_BACKENDS)
        lib = pkg / "lib"
        lib.mkdir()
        for so in sorted((native / "lib").iterdir()):
            shutil.copy2(so.resolve(), lib / so.name)  # real files, under every name the links used
        for name in TOOLS:  # RUNPATH $ORIGIN (PORTABLE=1): next to the libraries
            if (native / "bin" / name).exists():
                shutil.copy2((native / "bin" / name).resolve(), lib / name)
        shutil.copy2(native / "BUILD_INFO", pkg / "BUILD_INFO")


setup(distclass=BinaryDistribution, cmdclass={"build_py": BuildWithNative})
