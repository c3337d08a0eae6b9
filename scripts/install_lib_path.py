#!/usr/bin/env python3
"""Make a plain `import llama_cpp` work in a venv: install a .pth that points llama-cpp-python at our libllama.

    python scripts/install_lib_path.py VENV LIBDIR      # `make native` runs: .venv build/native/lib

llama-cpp-python 0.3.36 is installed without its own native build (LLAMA_BUILD=OFF, see the Makefile), so
`import llama_cpp` fails with "Shared library with base name 'llama' not found" unless LLAMA_CPP_LIB_PATH
names the folder of libllama.so; clover_native.loader sets it, but only for code that imports clover_cpp first.
Python runs `import` lines of site-packages/*.pth at start-up, so this .pth sets LLAMA_CPP_LIB_PATH to LIBDIR
in every interpreter of the venv, only when it is not set already (an explicit value wins) and LIBDIR exists.
It also sets CLOVER_LLAMA_LIB_DEFAULT to the same value: clover_native.loader reads it as "this is the venv's
default, not a user's choice" and may then still use another build ($CLOVER_NATIVE_LIB, a git worktree).

Idempotent: the file is rewritten only when its content would change. Stdlib only.
"""

from __future__ import annotations

import sys
from pathlib import Path

PTH_NAME = "clover_llama_lib_path.pth"
HEADER = """\
# Installed by `make native` (scripts/install_lib_path.py; edits are overwritten). llama-cpp-python here has no
# bundled libllama (LLAMA_BUILD=OFF): this line points LLAMA_CPP_LIB_PATH at the Clover build when it is unset,
# so a plain `import llama_cpp` works. CLOVER_LLAMA_LIB_DEFAULT marks the value as this default.
"""


def site_packages(venv: Path) -> Path:
    """VENV/lib/pythonX.Y/site-packages (exactly one)."""
    found = sorted(venv.glob("lib/python*/site-packages"))
    if len(found) != 1:
        raise SystemExit(f"install_lib_path: expected one {venv}/lib/python*/site-packages, found {len(found)}")
    return found[0]


def pth_text(lib_dir: Path) -> str:
    p = repr(str(lib_dir))
    return HEADER + (f"import os; os.environ.get('LLAMA_CPP_LIB_PATH') or not os.path.isdir({p}) or "
                     f"os.environ.update(LLAMA_CPP_LIB_PATH={p}, CLOVER_LLAMA_LIB_DEFAULT={p})\n")


def install(venv: Path, lib_dir: Path) -> tuple[Path, bool]:
    """Write the .pth; (its path, whether it changed)."""
    target = site_packages(venv) / PTH_NAME
    text = pth_text(lib_dir.resolve())
    if target.is_file() and target.read_text(encoding="utf-8") == text:
        return target, False
    tmp = target.with_suffix(".pth.tmp")  # not a .pth while half-written
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(target)
    return target, True


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: install_lib_path.py VENV LIBDIR", file=sys.stderr)
        return 2
    target, changed = install(Path(argv[0]), Path(argv[1]))
    print(f"install_lib_path: {target} {'written' if changed else 'up to date'} "
          f"(LLAMA_CPP_LIB_PATH default {Path(argv[1]).resolve()})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
