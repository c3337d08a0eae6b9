"""The block-diffusion key table exists once in C++ (cpp_patch/src/clover-keys.h, read by the model loader and the
engine's header reader) and once in Python (clover_convert.model_keys.BD_KEYS, used by the writer): the two must
be equal, row for row. The header is parsed as text, so this test needs no native build."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from clover_common.config_numbers import MAX_BLOCK_SIZE
from clover_convert.model_keys import BD_KEYS

HEADER = Path(__file__).resolve().parents[2] / "cpp_patch" / "src" / "clover-keys.h"
ROW = re.compile(r'^\s*X\((\w+),\s*(\w+),\s*(ARCH|GLOBAL),\s*"([^"]+)",\s*(\w+),\s*([-\w.]+),\s*([-\w.]+),\s*'
                 r'([-\w.]+),\s*([01])\)\s*\\?\s*$')


def _num(text: str) -> float:
    return math.nan if text == "NAN" else float(text)


def header_rows() -> list[tuple]:
    rows = [ROW.match(line) for line in HEADER.read_text().splitlines()]
    return [(m[1], m[3], m[4], m[5], _num(m[6]), _num(m[7]), _num(m[8]), m[9] == "1") for m in rows if m]


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def test_the_python_table_equals_the_header() -> None:
    rows = header_rows()
    assert len(rows) == 9, f"expected 9 X(...) rows in {HEADER}, parsed {len(rows)}"
    assert [r[0] for r in rows] == [k.name for k in BD_KEYS]
    for row, key in zip(rows, BD_KEYS):
        name, scope, suffix, gguf_type, default, lo, hi, lo_open = row
        assert (scope, suffix, gguf_type, lo_open) == (key.scope, key.suffix, key.gguf_type, key.lo_open), name
        for field, c, py in (("default", default, key.default), ("lo", lo, key.lo), ("hi", hi, key.hi)):
            assert _same(c, float(py)), f"{name}.{field}: header {c}, Python {py}"


def test_the_block_size_limit_is_the_converters() -> None:
    by_name = {k.name: k for k in BD_KEYS}
    assert by_name["BLOCK_SIZE"].hi == by_name["CALIBRATED_BLOCK_SIZES"].hi == MAX_BLOCK_SIZE


@pytest.mark.parametrize("name,value,rule", [
    ("BLOCK_SIZE", 0, "must be in 1 .. 256"),
    ("BLOCK_SIZE", 257, "must be in 1 .. 256"),
    ("BLOCK_SIZE", 2.5, "must be an integer"),
    ("THRESHOLD", 1.5, "must be in [0, 1]"),
    ("THRESHOLD", math.nan, "must be a finite number"),
    ("CORESET_TOP_P", 0.0, "must be in (0, 1]"),
    ("HISTORY_ROWS", 0, "must be >= 1"),
    ("HISTORY_READOUT_SCALE", math.inf, "must be a finite number"),
    ("CALIBRATED_THRESHOLDS", -0.1, "must be in [0, 1]"),
])
def test_the_range_check_words_the_rule(name: str, value: float, rule: str) -> None:
    key = next(k for k in BD_KEYS if k.name == name)
    assert key.check(value) == rule
    assert key.check(key.default if not math.isnan(key.default) else key.lo + (1 if key.lo_open else 0)) is None


def test_arch_keys_take_the_prefix() -> None:
    by_name = {k.name: k for k in BD_KEYS}
    assert by_name["THRESHOLD"].key("clover_moe") == "clover_moe.diffusion.threshold"
    assert by_name["MASK_TOKEN_ID"].key("clover_moe") == "tokenizer.ggml.mask_token_id"


PATCH = HEADER.parents[1] / "patches" / "0006-clover-arch.patch"
KV_NAME = re.compile(r'^[ +]\s*\{\s*(LLM_KV_\w+),\s*"([^"]+)"\s*\},')


def test_llama_arch_names_the_keys_as_the_table_does() -> None:
    """The patched llama-arch's LLM_KV_NAMES (cpp_patch/patches/0006-clover-arch.patch, its added lines and their
    context) spell each key of the table as the table does; the loader asserts the same at load, this finds it
    without a build. The mask token's key is upstream's own (tokenizer.ggml.mask_token_id), outside the patch."""
    names = {m[1]: m[2] for m in map(KV_NAME.match, PATCH.read_text().splitlines()) if m}
    rows = [ROW.match(line) for line in HEADER.read_text().splitlines()]
    checked = 0
    for m in filter(None, rows):
        kv, scope, suffix = m[2], m[3], m[4]
        if kv == "LLM_KV_TOKENIZER_MASK_ID":
            continue
        assert kv in names, f"{kv} is not in {PATCH.name}'s LLM_KV_NAMES"
        assert names[kv] == (f"%s.{suffix}" if scope == "ARCH" else suffix), (kv, names[kv])
        checked += 1
    assert checked == 8
