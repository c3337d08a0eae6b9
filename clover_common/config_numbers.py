"""The numeric fields of a Clover config.json and generation_config.json, and the values each may hold
(docs/gguf-format.md, "Numeric config fields").

Every number the toolkit reads from config.json has a row in ``RULES`` (generation_config.json's in
``GENERATION_RULES``): its kind (the GGUF type clover-convert writes it as, or a plain number where it is not
written) and its range. ``first_violation`` applies a table before anything computes with a value
(CloverConfig.validate, block_settings), so a value that is not a number of its kind, not finite, out of range,
or an integer that does not fit its GGUF type is refused with a one-line message naming the field; relations
between fields (a head count that divides another) are CloverConfig.validate's.

Integers are refused above 2^31 - 1 even where the GGUF type is uint32: the engine reads counts and token ids
as int32. A float written as float32 must fit one (at most about 3.4e38) and still lie in its range once
rounded to one (1e-50 becomes 0).
"""

from __future__ import annotations

import dataclasses
import math
import struct
from dataclasses import dataclass
from typing import Any, Iterator

from .long_numbers import shown

I32_MIN, I32_MAX = -2**31, 2**31 - 1
F32_MAX = 3.4028234663852886e38  # the largest finite float32
# the largest block size a checkpoint may declare; the engine's GGUF readers refuse the same
# (cpp_patch/src/clover-keys.h, the block_size row)
MAX_BLOCK_SIZE = 256
MAX_LAYERS = 512  # llama.cpp's LLAMA_MAX_LAYERS (src/llama-hparams.h): its loader refuses more layers
MAX_EXPERTS = 1024  # llama.cpp's LLAMA_MAX_EXPERTS (src/llama-hparams.h): its loader refuses more experts
# The most tokens a vocabulary may have: 16 times the largest real ones (about 2^18). clover-convert builds a text
# for every id below vocab_size (ids the tokenizer lacks are padding), which a config-only --dry-run does with no
# tensor shape to bound it: 2^22 ids take about 450 MB and 3 s; 2^31 would take GBs, for a file no tool could load.
MAX_VOCAB = 2**22

# kinds: how a value is written to the GGUF, which decides what it may hold
U32 = "uint32"  # an integer, written as GGUF uint32 (read back as int32)
I32 = "int32"  # an integer, written as GGUF int32
F32 = "float32"  # a finite number, written as GGUF float32
REAL = "number"  # a finite number that is not written (used to derive what is)
INTEGER_KINDS = (U32, I32)


@dataclass(frozen=True)
class NumberRule:
    """What one numeric config.json field may hold."""

    field: str  # the config.json name; ``a.b`` for key b of the object under a
    kind: str  # U32, I32, F32 or REAL
    lo: float
    hi: float
    lo_open: bool = False  # lo itself is out of range
    shape: str = "one"  # "one" value, a "list" of them, or "one or list"
    optional: bool = False  # null (or absent) is allowed
    why: str = ""  # said after a value outside the range, when the range needs a reason

    def range_text(self) -> str:
        if self.kind in INTEGER_KINDS:
            return f"an integer in {int(self.lo)} .. {int(self.hi)}" if self.lo != self.hi else f"{int(self.lo)}"
        if self.lo == -F32_MAX and self.hi == F32_MAX:
            return "a finite number (a float32)"
        if self.hi == math.inf:
            text = f"a finite number {'>' if self.lo_open else '>='} {_bound(self.lo)}"
        else:
            text = f"a number in {'(' if self.lo_open else '['}{_bound(self.lo)}, {_bound(self.hi)}]"
        return text + (" (a float32)" if self.kind == F32 else "")

    def _in_range(self, x: float) -> bool:
        return (x > self.lo if self.lo_open else x >= self.lo) and x <= self.hi

    def check_one(self, value: Any) -> str | None:
        """Why ``value`` is not a valid single value of this field (the rest of a sentence starting "field
        'NAME': "), or None."""
        expected = f"must be {self.range_text()}"
        if value is None and self.optional:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"{expected}, got {shown(value)}"
        if self.kind in INTEGER_KINDS:
            if not isinstance(value, int):
                return f"{expected}, got {shown(value)}"
            if self._in_range(value):
                return None
            return f"{expected}, got {shown(value)}" + (f"; {self.why}" if self.why else "")
        x = _as_float(value)
        too_large = abs(x) > F32_MAX and (math.isfinite(x) or isinstance(value, int))  # 1e39; an integer of 400 digits
        if self.kind == F32 and too_large:
            return f"{expected}, got {shown(value)}, which does not fit a float32 (the GGUF type it is written as)"
        if not (math.isfinite(x) and self._in_range(x)):
            return f"{expected}, got {shown(value)}" + (f"; {self.why}" if self.why else "")
        if self.kind == F32 and not self._in_range(rounded := _float32(x)):
            return f"is {shown(value)}, which is {rounded:g} as a float32 (the GGUF type it is written as): it " \
                   f"{expected}"
        return None

    def check(self, value: Any) -> str | None:
        """Why ``value`` is not valid for this field (one value, or a list as ``shape`` says), or None."""
        if value is None and self.optional:
            return None
        if self.shape == "one" or (self.shape == "one or list" and not isinstance(value, list)):
            return self.check_one(value)
        if not isinstance(value, list):
            return f"must be a list of {_plural(self.range_text())}, got {shown(value)}"
        for i, item in enumerate(value):
            why = f"must be {self.range_text()}, got null" if item is None else self.check_one(item)
            if why is not None:
                return f"item {i}: {why}"
        return None


def _bound(x: float) -> str:
    return ("-" if x < 0 else "") + "3.4e38" if abs(x) == F32_MAX else f"{x:g}"


def _plural(text: str) -> str:
    return text.replace("an integer", "integers").replace("a finite number", "finite numbers") \
        .replace("a number", "numbers")


def _as_float(value: int | float) -> float:
    """``value`` as a float; an integer too large for one is infinite."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _float32(x: float) -> float:
    """``x`` rounded to the nearest float32 (``x`` within float32's range)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


_COUNT = dict(kind=U32, lo=1, hi=I32_MAX)
_TOKEN_ID = dict(kind=U32, lo=0, hi=I32_MAX, optional=True)
_UNIT = dict(kind=F32, lo=0.0, hi=1.0)
_POSITIVE_F32 = dict(kind=F32, lo=0.0, hi=F32_MAX, lo_open=True)
_BLOCK_SIZE_WHY = "the engine keeps B-1 rollback states of the recurrent memory"

# CloverConfig's numeric fields (the block-diffusion settings too, whichever name spec 2.2 found them under)
CONFIG_RULES: tuple[NumberRule, ...] = (
    NumberRule("vocab_size", U32, 1, MAX_VOCAB,
               why="16 times the largest real vocabularies (the token list is built whole)"),
    NumberRule("hidden_size", **_COUNT),
    NumberRule("num_hidden_layers", U32, 1, MAX_LAYERS, why=f"llama.cpp loads at most {MAX_LAYERS} layers"),
    NumberRule("num_attention_heads", **_COUNT),
    NumberRule("num_key_value_heads", **_COUNT),
    NumberRule("head_dim", **_COUNT),
    NumberRule("max_position_embeddings", **_COUNT),
    NumberRule("initializer_range", REAL, 0.0, math.inf),
    NumberRule("rms_norm_eps", **_POSITIVE_F32),
    NumberRule("rope_parameters.rope_theta", **_POSITIVE_F32),
    NumberRule("rope_parameters.partial_rotary_factor", REAL, 0.0, 1.0, lo_open=True),
    NumberRule("rope_parameters.mrope_section", I32, 0, I32_MAX, shape="list"),
    NumberRule("linear_conv_kernel_dim", **_COUNT),
    NumberRule("linear_key_head_dim", **_COUNT),
    NumberRule("linear_value_head_dim", **_COUNT),
    NumberRule("linear_num_key_heads", **_COUNT),
    NumberRule("linear_num_value_heads", **_COUNT),
    NumberRule("moe_intermediate_size", **_COUNT),
    NumberRule("shared_expert_intermediate_size", **_COUNT),
    NumberRule("num_experts_per_tok", **_COUNT),
    NumberRule("num_experts", U32, 1, MAX_EXPERTS, why=f"llama.cpp loads at most {MAX_EXPERTS} experts"),
    NumberRule("full_attention_interval", **_COUNT),
    NumberRule("bos_token_id", **_TOKEN_ID),
    NumberRule("eos_token_id", **_TOKEN_ID, shape="one or list"),
    NumberRule("pad_token_id", **_TOKEN_ID),
    NumberRule("mask_token_id", U32, 0, I32_MAX),
    NumberRule("block_size", U32, 1, MAX_BLOCK_SIZE, why=_BLOCK_SIZE_WHY),
    NumberRule("confidence_threshold", **_UNIT),
    NumberRule("calibrated_block_sizes", U32, 1, MAX_BLOCK_SIZE, shape="list", why=_BLOCK_SIZE_WHY),
    NumberRule("calibrated_thresholds", **_UNIT, shape="list"),
    NumberRule("coreset_top_p", F32, 0.0, 1.0, lo_open=True),
    NumberRule("history_rows", **_COUNT),
    NumberRule("history_readout_scale", F32, -F32_MAX, F32_MAX, optional=True),
    NumberRule("num_shared_experts", U32, 1, 1, why="only 1 shared expert is supported (spec 2.1: the layout of "
                                                    "more is not known)"),
)

# Other config.json fields clover-convert writes when present, as llama.cpp's converter does (the
# generic TextModel keys, clover_convert/model_keys.py; the special token ids, clover_convert/special_vocab.py)
WRITTEN_RULES: tuple[NumberRule, ...] = (
    *(NumberRule(name, U32, 0, I32_MAX, shape="one or list", optional=True)
      for name in ("prefix_dense_intermediate_size", "dense_intermediate_size", "intermediate_size", "n_inner",
                   "hidden_dim")),
    *(NumberRule(name, F32, 0.0, F32_MAX, optional=True)
      for name in ("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon")),
    NumberRule("n_group", U32, 0, I32_MAX, optional=True),
    NumberRule("topk_group", U32, 0, I32_MAX, optional=True),
    *(NumberRule(f"{kind}_token_id", **_TOKEN_ID) for kind in ("unk", "sep", "cls", "eot", "eom")),
)

RULES: tuple[NumberRule, ...] = CONFIG_RULES + WRITTEN_RULES
RULE = {rule.field: rule for rule in RULES}

_ANY_F32 = dict(kind=F32, lo=-F32_MAX, hi=F32_MAX, optional=True)
_ANY_I32 = dict(kind=I32, lo=-I32_MAX - 1, hi=I32_MAX, optional=True)
# generation_config.json's numbers that clover-convert writes: the penalties the engine reads (spec 4;
# clover_convert/converter.py, which refuses a repetition penalty the engine would refuse) and the general.sampling.*
# defaults gguf's Metadata.load copies from it
GENERATION_RULES: tuple[NumberRule, ...] = (
    *(NumberRule(name, F32, 0.0, F32_MAX, lo_open=True, optional=True)
      for name in ("repetition_penalty", "penalty_repeat")),
    *(NumberRule(name, **_ANY_F32) for name in ("presence_penalty", "frequency_penalty", "top_p", "min_p",
                                                 "xtc_probability", "xtc_threshold", "temperature", "mirostat_tau",
                                                 "mirostat_eta")),
    *(NumberRule(name, **_ANY_I32) for name in ("top_k", "penalty_last_n", "mirostat")),
)


# the --metadata file's general.sampling.* keys (gguf's Keys.General): the same rows under gguf's names
METADATA_RULES: tuple[NumberRule, ...] = tuple(
    dataclasses.replace(rule, field="general.sampling." + {"temperature": "temp"}.get(rule.field, rule.field))
    for rule in GENERATION_RULES if rule.field not in ("repetition_penalty", "presence_penalty", "frequency_penalty"))


def field_values(values: dict[str, Any], rules: tuple[NumberRule, ...] = RULES) -> Iterator[tuple[NumberRule, Any]]:
    """(rule, value) for every rule whose field ``values`` holds; ``a.b`` looks up key b of the object under
    a (an object that is not one is CloverConfig.from_dict's to refuse)."""
    for rule in rules:
        node: Any = values
        *parents, name = rule.field.split(".")
        for parent in parents:
            node = node.get(parent) if isinstance(node, dict) else None
        if isinstance(node, dict) and name in node:
            yield rule, node[name]


def first_violation(values: dict[str, Any], rules: tuple[NumberRule, ...] = RULES) -> tuple[str, str] | None:
    """(field, why) for the first field of ``values`` that breaks its rule, or None."""
    for rule, value in field_values(values, rules):
        if (why := rule.check(value)) is not None:
            return rule.field, why
    return None
