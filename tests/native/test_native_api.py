"""libclover exports its C API and nothing else: every dynamic symbol of build/native/lib/libclover.so is a function
declared with CLOVER_API in clover.h or clover-imatrix.h, every such declaration is exported, and every function
those headers declare carries CLOVER_API (no C++ internals, no libstdc++ template instances, no vendored code)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from clover_dev import REPO_ROOT
from tests.support.native import skip_or_fail

HEADERS = [REPO_ROOT / "cpp_patch" / "tools" / "clover" / name for name in ("clover.h", "clover-imatrix.h")]


def _declarations(header: Path) -> dict[str, bool]:
    """Function name -> whether its declaration carries CLOVER_API, for every function the header declares."""
    text = header.read_text()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', text)
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    out: dict[str, bool] = {}
    for m in re.finditer(r"\b(clover_\w+)\s*\(", text):
        start = max(text.rfind(c, 0, m.start()) for c in ";{}") + 1
        statement = text[start:m.start()]
        if "typedef" in statement or "(*" in text[m.start() - 2:m.start()]:
            continue
        if re.fullmatch(r"\s*(CLOVER_DEPRECATED\s*\(\s*)?", statement):
            raise AssertionError(f"{header.name}: {m[1]} looks like a call, not a declaration: {statement!r}")
        out[m[1]] = "CLOVER_API" in statement
    return out


def _exported(lib: Path) -> list[str]:
    nm = shutil.which("nm")
    if nm is None:
        skip_or_fail("nm (binutils) is not installed")
    out = subprocess.run([nm, "-D", "--defined-only", str(lib)], check=True, capture_output=True, text=True).stdout
    return [line.split()[-1] for line in out.splitlines() if line.strip()]


def test_headers_mark_every_function_clover_api() -> None:
    for header in HEADERS:
        decls = _declarations(header)
        assert decls, header
        unmarked = sorted(name for name, marked in decls.items() if not marked)
        assert not unmarked, f"{header.name}: declared without CLOVER_API: {unmarked}"
    assert {"clover_slot_generate", "clover_engine_slot", "clover_imatrix_eval_cb"} <= set(
        _declarations(HEADERS[0]) | _declarations(HEADERS[1]))


@pytest.mark.native
def test_libclover_exports_exactly_the_c_api() -> None:
    from clover_native import libclover

    lib = libclover.lib_path()
    assert lib.exists(), f"{lib} missing (make native builds it)"
    declared = set()
    for header in HEADERS:
        declared |= set(_declarations(header))
    exported = _exported(lib)
    mangled = [s for s in exported if s.startswith("_Z")]
    assert not mangled, f"C++ symbols exported: {mangled[:10]} ({len(mangled)} in all)"
    extra = sorted(set(exported) - declared)
    assert not extra, f"exported but not declared with CLOVER_API: {extra}"
    missing = sorted(declared - set(exported))
    assert not missing, f"declared with CLOVER_API but not exported: {missing}"
    # the Python bindings resolve every prototype they declare
    assert set(libclover._PROTOTYPES) <= set(exported)
