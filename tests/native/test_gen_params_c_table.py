"""The generation parameters' ranges exist once in C (cpp_patch/tools/clover/clover-gen-params.h: the engine's checks
and llama-clover's flags) and once in Python (the bounds of clover_cpp.gen_params.PARAMS: GenParams, clover-cpp and
the server's schema). The rows must be equal, and the C check, compiled from the header, must accept and word what
Python's Bound accepts and words (tests/engine/test_engine.py has the engine refuse a value that bypasses Python).
Only a C++ compiler is needed, no native build."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from pathlib import Path

from clover_cpp.gen_params import PARAMS
from tests.support.native import REPO_ROOT, skip_or_fail

HEADER = REPO_ROOT / "cpp_patch" / "tools" / "clover" / "clover-gen-params.h"
ROW = re.compile(r'^\s*X\((\w+),\s*(\w+),\s*(-?\w+),\s*(-?\w+),\s*([01]),\s*([01]),\s*(\w+),\s*"([^"]*)"\)\s*\\?\s*$')
PROBES = (-2.0, -1.0, -0.5, 0.0, 1e-6, 0.5, 1.0, 1.5, 3.0, 1e9, math.nan, math.inf, -math.inf)
UNSET = {"NONE": lambda v: False, "ZERO": lambda v: v == 0, "NEGATIVE": lambda v: v < 0,
         "NONPOSITIVE": lambda v: v <= 0, "NAN": math.isnan}


def _end(text: str) -> float | None:
    return None if text.lstrip("-") == "INFINITY" else float(text)


def header_rows() -> list[dict]:
    rows = [ROW.match(line) for line in HEADER.read_text().splitlines()]
    return [{"id": m[1], "field": m[2], "lo": _end(m[3]), "hi": _end(m[4]), "lo_open": m[5] == "1",
             "integer": m[6] == "1", "unset": m[7], "off": m[8]} for m in rows if m]


def _python_row(field: str) -> tuple[str, object]:
    matches = [(name, spec) for name, spec in PARAMS.items() if spec.c_field == field]
    assert len(matches) == 1, f"{field}: {len(matches)} GenParams fields set it"
    return matches[0]


def test_the_c_table_equals_the_python_bounds() -> None:
    rows = header_rows()
    assert len(rows) == 11, f"expected 11 X(...) rows in {HEADER}, parsed {len(rows)}"
    bounded = {spec.c_field for spec in PARAMS.values() if spec.c_field and spec.bound}
    assert {r["field"] for r in rows} == bounded
    for row in rows:
        name, spec = _python_row(row["field"])
        b = spec.bound
        got = {"lo": b.low, "hi": b.high, "lo_open": b.low_open, "integer": b.integer, "off": b.off}
        want = {k: row[k] for k in got}
        assert got == want and not b.high_open, (name, got, want)
        unset = UNSET[row["unset"]]
        if spec.c_unset is None:  # no GGUF value
            assert row["unset"] == "NONE", name
        else:
            assert unset(spec.c_unset), f"{name}: Python's C unset value {spec.c_unset} is not C's {row['unset']}"
        assert not any(unset(v) and b.ok(v) for v in PROBES), f"{name}: an unset value is also a valid one"


def _compile_probe(tmp: Path) -> Path:
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        skip_or_fail("no C++ compiler to compile clover-gen-params.h")
    src = tmp / "probe.cpp"
    probes = ", ".join("NAN" if math.isnan(v) else ("INFINITY" if v > 0 else "-INFINITY") if math.isinf(v) else repr(v)
                       for v in PROBES)
    src.write_text(f"""#include "clover-gen-params.h"
#include <cstdio>
int main() {{
    const double probes[] = {{ {probes} }};
    for (int id = 0; id < CLOVER_GEN_PARAM_COUNT; ++id) {{
        const auto pid = (clover_gen_param_id) id;
        printf("rule\\t%s\\t%s\\n", clover_gen_param(pid).field, clover_gen_param_rule(pid).c_str());
        for (double v : probes) {{
            printf("probe\\t%s\\t%d\\t%s\\n", clover_gen_param(pid).field, clover_gen_param_ok(pid, v) ? 1 : 0,
                   clover_gen_param_check(pid, v).c_str());
        }}
    }}
}}
""")
    exe = tmp / "probe"
    done = subprocess.run([cxx, "-std=c++17", "-I", str(HEADER.parent), str(src), "-o", str(exe)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return exe


def test_the_c_check_accepts_and_words_what_python_does(tmp_path: Path) -> None:
    out = subprocess.run([str(_compile_probe(tmp_path))], capture_output=True, text=True, timeout=60, check=True)
    lines = [line.split("\t") for line in out.stdout.splitlines()]
    rules = {f: r for kind, f, r in (x for x in lines if x[0] == "rule")}
    probes = [x[1:] for x in lines if x[0] == "probe"]
    assert len(probes) == len(rules) * len(PROBES)
    for i, (field, ok, message) in enumerate(probes):
        name, spec = _python_row(field)
        value = PROBES[i % len(PROBES)]
        assert rules[field] == spec.bound.rule, name
        whole = not spec.bound.integer or (math.isfinite(value) and value == int(value))
        assert (ok == "1") == (whole and spec.bound.ok(value)), (name, value)
        if ok == "1" or (spec.c_unset is not None and UNSET[_unset_kind(field)](value)):
            assert message == "", (name, value, message)
        else:
            assert message.startswith(f"{field} {spec.bound.rule}") and message.endswith(f"got {value:g}"), message


def _unset_kind(field: str) -> str:
    return next(r["unset"] for r in header_rows() if r["field"] == field)
