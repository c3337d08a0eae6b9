"""The table of numeric config fields (clover_common.config_numbers, docs/gguf-format.md "Numeric config fields"):
it covers every numeric field of CloverConfig, refuses the edge values in each, agrees with the block-diffusion keys'
table the engine reads (model_keys.BD_KEYS), and every row has mutants in the fuzz set (tests/support/
fuzz_checkpoint.py, run through clover-convert by tests/convert/test_fuzz.py and clover-ref by
tests/reference/test_reference_fuzz.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest

from clover_common.config import CloverConfig
from clover_common.config_numbers import F32, GENERATION_RULES, INTEGER_KINDS, METADATA_RULES, RULE, RULES, U32
from clover_common.long_numbers import long_integer_reason, shown
from clover_convert.model_keys import BD_KEY
from tests.support import fuzz_checkpoint


def _is_numeric_annotation(annotation: str) -> bool:
    return bool(re.search(r"\b(int|float)\b", annotation))


def test_every_numeric_field_of_the_config_has_a_rule() -> None:
    """Enumerated from CloverConfig itself: a numeric field added later without a row fails here."""
    fields = {f.name for f in dataclasses.fields(CloverConfig) if _is_numeric_annotation(str(f.type))}
    rope = {f"rope_parameters.{key}" for key, value in CloverConfig().rope_parameters.items()
            if not isinstance(value, (bool, str))}
    assert len(fields) > 30 and rope == {"rope_parameters.rope_theta", "rope_parameters.partial_rotary_factor",
                                         "rope_parameters.mrope_section"}
    assert fields | rope <= set(RULE)


EDGES = {label: value for label, value, _ in fuzz_checkpoint.EDGES}


@pytest.mark.parametrize("rule", RULES + GENERATION_RULES + METADATA_RULES, ids=lambda r: r.field)
def test_every_rule_refuses_the_edge_values(rule) -> None:
    one = (lambda v: [v]) if rule.shape == "list" else (lambda v: v)
    for label in ("NaN", "Infinity", "-Infinity", "10^5000"):
        assert rule.check(one(EDGES[label])) is not None, label
    if rule.kind in INTEGER_KINDS:
        for bad in (2**31, 2**33, 2**63, 2.5, True, "1"):
            assert rule.check(one(bad)) is not None, bad
    if rule.kind == F32:
        assert "does not fit a float32" in rule.check(one(1e39))
    if rule.optional:
        assert rule.check(None) is None
    for reason in filter(None, (rule.check(one(v)) for v in EDGES.values())):
        assert "\n" not in reason and len(reason) < 240, reason


def test_a_float32_field_refuses_what_float32_rounds_out_of_its_range() -> None:
    assert RULE["rms_norm_eps"].check(1e-6) is None
    assert "which is 0 as a float32" in RULE["rms_norm_eps"].check(1e-50)
    assert RULE["rope_parameters.rope_theta"].check(3.4e38) is None
    assert RULE["rope_parameters.rope_theta"].check(10**400) is not None  # an integer too large for a float


@pytest.mark.parametrize(("field", "key"), [
    ("block_size", "BLOCK_SIZE"), ("confidence_threshold", "THRESHOLD"), ("coreset_top_p", "CORESET_TOP_P"),
    ("history_rows", "HISTORY_ROWS"), ("history_readout_scale", "HISTORY_READOUT_SCALE"),
    ("calibrated_block_sizes", "CALIBRATED_BLOCK_SIZES"), ("calibrated_thresholds", "CALIBRATED_THRESHOLDS"),
    ("mask_token_id", "MASK_TOKEN_ID"),
])
def test_block_diffusion_fields_agree_with_the_keys_the_engine_reads(field: str, key: str) -> None:
    """config.json's value is refused exactly where the engine would refuse the key it becomes (the writer's
    own check then never fires)."""
    rule, bd = RULE[field], BD_KEY[key]
    assert (rule.kind == U32) == (bd.gguf_type in ("U32", "ARR_U32"))
    probes = [bd.lo, bd.hi, bd.lo - 1, bd.hi + 1, bd.lo + 0.5, 0, 1, -1, 0.5, 2**31, math.nan, math.inf, 1e30, -1e30]
    one = (lambda v: [v]) if rule.shape == "list" else (lambda v: v)
    for v in probes:
        as_json = int(v) if rule.kind in INTEGER_KINDS and math.isfinite(v) and v == int(v) else v  # 8, not 8.0
        assert (rule.check(one(as_json)) is None) == (bd.check(v) is None), (v, rule.check(one(as_json)), bd.check(v))


def test_the_fuzz_set_covers_every_rule(tiny_checkpoint: Path) -> None:
    mutants = fuzz_checkpoint.numeric_mutants(tiny_checkpoint)
    names = {m.name for m in mutants}
    for rule in RULES:
        assert any(n.startswith(f"num-{rule.field}-") for n in names), rule.field
        assert any(n.startswith(f"num-nested-{rule.field}-") for n in names), rule.field
    for rule in GENERATION_RULES:
        assert any(n.startswith(f"num-generation-{rule.field}-") for n in names), rule.field
    assert len(names) == len(mutants) > 600


def test_metadata_sampling_numbers_are_checked(tiny_checkpoint: Path, tmp_path: Path, capsys) -> None:
    """--metadata's general.sampling.* numbers, with every edge value each refuses: one line naming the file and
    the key (gguf's writer would raise on a value that does not fit, or write a NaN the engine refuses)."""
    from tests.support.convert import run_convert

    metadata = tmp_path / "metadata.json"
    tried = 0
    for rule in METADATA_RULES:
        for label, value, text in fuzz_checkpoint.EDGES:
            if rule.check(value) is None:
                continue
            metadata.write_text(json.dumps({rule.field: "@"}).replace('"@"', text))
            code, _, err = run_convert(capsys, tiny_checkpoint, "--dry-run", "--metadata", metadata)
            lines = err.splitlines()
            assert code == 2 and len(lines) == 1, err
            assert lines[0].startswith(f"clover-convert: error: --metadata {metadata}: field '{rule.field}': "), err
            tried += 1
    assert tried > 50


def test_long_numbers_stay_one_short_line() -> None:
    assert shown(10**5000) == "an integer of 5001 digits"
    assert shown(-(10**19)) == "-10000000000000000000" and shown(-(10**20)) == "a negative integer of 21 digits"
    assert shown(math.nan) == "NaN" and shown(-math.inf) == "-Infinity" and shown(True) == "true"
    assert shown("x" * 1000) == repr("x" * 40) + "..."
    text = json.dumps({"a": {"b": [1, "@"]}}).replace('"@"', "9" * 5000)
    assert long_integer_reason(text).startswith("field 'a.b': holds an integer of 5000 digits")
    assert long_integer_reason("[" + "9" * 5000 + "]").startswith("holds an integer of 5000 digits")
