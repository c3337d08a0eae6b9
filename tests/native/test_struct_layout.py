"""Every ctypes struct of clover_native/libclover.py has clover.h's layout: the same fields in the same order
(read from the header), and the same sizeof and offsetof of each field (a C program compiled against the header
prints them). A field added on one side only, a type changed on one side, or a struct that one side lacks fails."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from clover_native import libclover
from tests.support.native import REPO_ROOT, skip_or_fail

HEADER = REPO_ROOT / "cpp_patch" / "tools" / "clover" / "clover.h"


def ctypes_structs() -> dict[str, type[ctypes.Structure]]:
    return {name: obj for name, obj in vars(libclover).items()
            if isinstance(obj, type) and issubclass(obj, ctypes.Structure) and name.startswith("clover_")}


def header_structs() -> dict[str, list[str]]:
    """Each ``struct clover_X { ... };`` of clover.h: its field names, in order."""
    text = re.sub(r"//[^\n]*", "", HEADER.read_text(encoding="utf-8"))
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    out: dict[str, list[str]] = {}
    for name, body in re.findall(r"struct\s+(clover_\w+)\s*\{(.*?)\};", text, flags=re.S):
        fields: list[str] = []
        for decl in body.split(";"):
            decl = re.sub(r"\[[^\]]*\]", "", decl).strip()
            if not decl:
                continue
            first, *more = decl.split(",")
            fields.append(re.findall(r"\w+", first)[-1])
            fields.extend(m.strip() for m in more)
        out[name] = fields
    return out


def include_dirs() -> list[Path]:
    """llama.h and the ggml headers it includes: the vendored llama.cpp of the native build's sdist
    (build/native/BUILD_INFO), else of the build tree."""
    info = REPO_ROOT / "build" / "native" / "BUILD_INFO"
    if not info.exists():
        skip_or_fail(f"{info} is missing (scripts/build_native.sh writes it)")
    keys = dict(line.split("=", 1) for line in info.read_text().splitlines() if "=" in line)
    roots = [Path(keys.get("sdist", "")) / "vendor" / "llama.cpp", Path(keys.get("build_dir", "")).parent / "src"]
    for root in roots:
        if (root / "include" / "llama.h").exists():
            return [HEADER.parent, root / "include", root / "ggml" / "include"]
    skip_or_fail(f"no llama.h under {' or '.join(map(str, roots))}")
    raise AssertionError  # unreachable


def c_layout(structs: dict[str, type[ctypes.Structure]], tmp: Path) -> dict[str, int]:
    """``"S"`` -> sizeof(struct S) and ``"S.f"`` -> offsetof(struct S, f), as the C compiler lays them out."""
    cc = shutil.which("cc")
    if cc is None:
        skip_or_fail("no C compiler (cc) on PATH")
    lines = ["#include <stddef.h>", "#include <stdio.h>", '#include "clover.h"', "int main(void) {"]
    for name, cls in structs.items():
        lines.append(f'    printf("{name} %zu\\n", sizeof(struct {name}));')
        for field, *_ in cls._fields_:
            lines.append(f'    printf("{name}.{field} %zu\\n", offsetof(struct {name}, {field}));')
    lines += ["    return 0;", "}"]
    src, exe = tmp / "layout.c", tmp / "layout"
    src.write_text("\n".join(lines) + "\n")
    flags = [f"-I{d}" for d in include_dirs()]
    build = subprocess.run([cc, "-std=c11", *flags, str(src), "-o", str(exe)], capture_output=True, text=True)
    assert build.returncode == 0, f"the layout program does not compile against clover.h:\n{build.stderr}"
    run = subprocess.run([str(exe)], capture_output=True, text=True, check=True)
    return {key: int(value) for key, value in (line.split() for line in run.stdout.splitlines())}


@pytest.mark.native
def test_ctypes_structs_match_clover_h(tmp_path: Path) -> None:
    structs = ctypes_structs()
    header = header_structs()
    assert set(structs) == set(header), "structs of clover.h and of libclover.py differ"
    for name, cls in structs.items():
        assert [f for f, *_ in cls._fields_] == header[name], f"{name}: fields differ from clover.h"
    layout = c_layout(structs, tmp_path)
    for name, cls in structs.items():
        assert ctypes.sizeof(cls) == layout[name], f"sizeof(struct {name})"
        for field, *_ in cls._fields_:
            assert getattr(cls, field).offset == layout[f"{name}.{field}"], f"offsetof(struct {name}, {field})"


def test_header_parser_reads_every_field() -> None:
    """The parser the layout test relies on: arrays, pointers and a callback are fields."""
    fields = header_structs()
    assert "auto_rounds" in fields["clover_stats"] and "steps_per_block" in fields["clover_stats"]
    assert "on_logprobs" in fields["clover_gen_params"] and fields["clover_gen_params"][-1] == "spec_fused"
    assert fields["clover_device_memory"][0] == "name"
