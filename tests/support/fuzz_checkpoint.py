"""Seeded checkpoint mutants for the fuzz tests (tests/convert/test_fuzz.py): broken config.json values, JSON that nests
too deeply, symlink loops, and safetensors headers and data that lie (overlapping, out-of-order or out-of-file
data_offsets, wrong dtypes and shapes, NaN weights). Each mutant is a copy of a tiny checkpoint with one
defect, and names what clover-convert's one-line error mentions (any of ``expect``).

Generated, not listed: the numeric edge values (``EDGES``: NaN, +-Infinity, 2^31, 2^33, 2^63, an integer of 5,001
digits, -1 and 0) in every numeric field of config.json and generation_config.json that the toolkit reads
(clover_common.config_numbers), top level and under ``text_config``, and in every other name of a block-diffusion
setting (clover_common.block_settings.NAMES), wherever a value is one its field refuses (``numeric_mutants``);
token texts that two ids share; shard names in model.safetensors.index.json that leave the checkpoint folder."""

from __future__ import annotations

import json
import math
import random
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from clover_common.block_settings import NAMES
from clover_common.config import CLOVER_FIELDS, CloverConfig
from clover_common.config_numbers import GENERATION_RULES, RULE, RULES, NumberRule
from clover_common.safetensors_header import INDEX_FILE


@dataclass
class CheckpointMutant:
    name: str
    expect: tuple[str, ...]
    apply: Callable[[Path], None]  # damages the copy in this folder
    linked: tuple[str, ...] = ()  # files the mutant leaves alone: linked to the base's, not copied


# The numeric edge values: (label, the value, its JSON text). An integer of 5,001 digits is more than CPython's
# json reads (4,300), so its text is written verbatim.
EDGES: tuple[tuple[str, Any, str], ...] = (
    ("NaN", math.nan, "NaN"), ("Infinity", math.inf, "Infinity"), ("-Infinity", -math.inf, "-Infinity"),
    ("2^31", 2**31, str(2**31)), ("2^33", 2**33, str(2**33)), ("2^63", 2**63, str(2**63)),
    ("10^5000", 10**5000, "1" + "0" * 5000), ("-1", -1, "-1"), ("0", 0, "0"),
)
NESTED_EDGES = tuple(e for e in EDGES if e[0] in ("NaN", "2^33", "10^5000"))  # under text_config, other names
RAW = "@@edge@@"  # stands for an edge value until the file is written, then replaced by its JSON text


def _edit_json(name: str, edit: Callable[[dict], None], literal: str | None = None) -> Callable[[Path], None]:
    """Edit the JSON object in the file ``name`` (absent: {}); a RAW value becomes ``literal`` verbatim."""
    def apply(d: Path) -> None:
        path = d / name
        data = json.loads(path.read_text()) if path.exists() else {}
        edit(data)
        text = json.dumps(data)
        path.write_text(text.replace(json.dumps(RAW), literal) if literal is not None else text)
    return apply


def _config(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    return _edit_json("config.json", edit)


def _set(key: str, value: Any) -> Callable[[dict], None]:
    def edit(cfg: dict) -> None:
        node = cfg
        *path, last = key.split(".")
        for k in path:
            node = node[k]
        node[last] = value
    return edit


def _delete(key: str) -> Callable[[dict], None]:
    return lambda cfg: cfg.pop(key)


def _header(edit: Callable[[dict], None], data: Callable[[bytearray, dict, int], None] | None = None
            ) -> Callable[[Path], None]:
    """Rewrite model.safetensors with an edited header (same data section), or edit the data in place."""
    def apply(d: Path) -> None:
        p = d / "model.safetensors"
        b = p.read_bytes()
        (n,) = struct.unpack("<Q", b[:8])
        header = json.loads(b[8:8 + n])
        body = bytearray(b[8 + n:])
        edit(header)
        if data is not None:
            data(body, header, 0)
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        p.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(body))
    return apply


def _nan_into(name: str, count: int, value: float) -> Callable[[bytearray, dict, int], None]:
    def data(body: bytearray, header: dict, _: int) -> None:
        begin = header[name]["data_offsets"][0]
        bits = (np.array([value], np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        for i in range(count):
            body[begin + 2 * i:begin + 2 * i + 2] = bits
    return data


def mutants(base: Path, seed: int = 0) -> list[CheckpointMutant]:
    """The checkpoint mutants of ``base`` (a tiny checkpoint with one model.safetensors), in a seeded order."""
    rng = random.Random(seed)
    b = (base / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", b[:8])
    header = json.loads(b[8:8 + n])
    names = [k for k in header if k != "__metadata__"]
    out: list[CheckpointMutant] = []

    def add(name: str, expect: tuple[str, ...] | str, apply: Callable[[Path], None]) -> None:
        out.append(CheckpointMutant(name, (expect,) if isinstance(expect, str) else expect, apply))

    # config.json values
    for key, values in {
        "hidden_size": (0, -1, "64", 63, None), "num_hidden_layers": (0, 5, 10**9), "num_experts": (0, 1, 1000),
        "num_experts_per_tok": (0, 9), "block_size": (0, -8, 100000, 8.5, True), "mask_token_id": (3072, -1, "x"),
        "confidence_threshold": (math.nan, math.inf, -1, 2, "0.9"), "rms_norm_eps": (0, -1, "tiny"),
        "linear_num_key_heads": (0, 3), "linear_conv_kernel_dim": (1,), "coreset_top_p": (0, 1.5),
        "history_rows": (0,), "head_dim": (0, 31),
        "vocab_size": (0, 3071), "layer_types": ("linear_attention", ["linear_attention"] * 3, ["bogus"] * 4),
        "calibrated_block_sizes": ([0, 8, 16], [4, 8, 5000], "4,8,16", [4, 8]),
        "calibrated_thresholds": ([math.nan, 0.9, 0.95], [0.9, 0.9, 2.0], [0.9]),
        "rope_parameters.mrope_section": ([2, 1, 2], [-1, 2, 3], "2,1,1"),
        "rope_parameters.partial_rotary_factor": (0, 0.3, 2.0), "eos_token_id": (5000, "eos"),
        "hidden_act": ("gelu",),
    }.items():
        for v in values:
            field = key.split(".")[-1]
            add(f"config-{key}-{v!r}", (field, key), _config(_set(key, v)))
    # block_size defaults
    for key in ("hidden_size", "num_hidden_layers", "num_experts", "vocab_size"):
        add(f"config-missing-{key}", (key, "config.json"), _config(_delete(key)))

    def no_mask(d: Path) -> None:  # no id, and no added token to find it by name (spec 2.2)
        _config(_delete("mask_token_id"))(d)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (d / name).write_text((d / name).read_text().replace("<|mask|>", "<|blank|>"))
    add("config-missing-mask_token_id", ("mask_token_id", "config.json"), no_mask)

    def deep(d: Path) -> None:
        text = (d / "config.json").read_text().rstrip()[:-1]
        (d / "config.json").write_text(text + ', "deep": ' + "[" * 200000 + "]" * 200000 + "}")
    add("config-deep", "config.json", deep)

    def loop(d: Path) -> None:
        (d / "config.json").unlink()
        (d / "config.json").symlink_to("config.json")
    add("config-symlink-loop", "config.json", loop)

    def not_json(d: Path) -> None:
        (d / "config.json").write_bytes(b"\xff\xfe{")
    add("config-not-utf8", "config.json", not_json)
    add("config-not-object", "config.json", lambda d: (d / "config.json").write_text("[1, 2]"))

    # safetensors headers
    a, c = rng.sample(names[2:], 2)
    add("st-overlap", (a, c, "overlap"), _header(lambda h: h[c].__setitem__(
        "data_offsets", [h[a]["data_offsets"][0], h[a]["data_offsets"][0] + h[c]["data_offsets"][1]
                         - h[c]["data_offsets"][0]])))
    add("st-out-of-order", (a, "order"), _header(lambda h: h[a].__setitem__(
        "data_offsets", h[a]["data_offsets"][::-1])))
    add("st-beyond-file", (a, "truncated"), _header(lambda h: h[a].__setitem__(
        "data_offsets", [10**9, 10**9 + h[a]["data_offsets"][1] - h[a]["data_offsets"][0]])))
    add("st-negative", (a,), _header(lambda h: h[a].__setitem__("data_offsets", [-2, h[a]["data_offsets"][1]])))
    add("st-dtype", (a, "dtype"), _header(lambda h: h[a].__setitem__("dtype", "I64")))
    add("st-dtype-f32", (a, "bytes"), _header(lambda h: h[a].__setitem__("dtype", "F32")))
    add("st-shape", (a,), _header(lambda h: h[a].__setitem__("shape", [*h[a]["shape"][:-1], h[a]["shape"][-1] + 1])))
    add("st-shape-string", (a,), _header(lambda h: h[a].__setitem__("shape", "64")))
    add("st-missing-tensor", (a, "missing"), _header(lambda h: h.pop(a)))
    add("st-extra-tensor", ("model.layers.9", "unexpected", "unknown", "layers"),
        _header(lambda h: h.__setitem__("model.layers.9.mlp.gate.weight", dict(h[a]))))
    add("st-entry-not-object", (a,), _header(lambda h: h.__setitem__(a, [1, 2])))

    def header_len_huge(d: Path) -> None:
        p = d / "model.safetensors"
        raw = bytearray(p.read_bytes())
        raw[:8] = struct.pack("<Q", 2**62)
        p.write_bytes(bytes(raw))
    add("st-header-len", ("truncated", "model.safetensors"), header_len_huge)
    add("st-header-garbage", ("model.safetensors", "header"), lambda d: (d / "model.safetensors").write_bytes(
        struct.pack("<Q", 16) + b"{not json at all"))
    add("st-truncated", ("truncated", "model.safetensors"), lambda d: (d / "model.safetensors").write_bytes(
        (d / "model.safetensors").read_bytes()[:-1000]))
    add("st-empty", ("model.safetensors", "truncated"), lambda d: (d / "model.safetensors").write_bytes(b""))

    def deep_header(d: Path) -> None:
        raw = b'{"x": ' + b"[" * 100000 + b"]" * 100000 + b"}"
        (d / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    add("st-header-deep", ("model.safetensors", "header"), deep_header)

    # non-finite weights (refused without --allow-nonfinite)
    for k, (name, count, value) in enumerate(((rng.choice(names), 3, math.nan), (rng.choice(names), 1, math.inf),
                                              (rng.choice(names), 5, -math.inf))):
        add(f"st-nonfinite-{k}", (name, "non-finite"), _header(lambda h: None, _nan_into(name, count, value)))

    # tokenizer
    add("tok-missing", ("tokenizer.json",), lambda d: (d / "tokenizer.json").unlink())
    add("tok-garbage", ("tokenizer.json",), lambda d: (d / "tokenizer.json").write_text("{"))
    add("tok-deep", ("tokenizer.json",), lambda d: (d / "tokenizer.json").write_text("[" * 100000 + "]" * 100000))
    out += _token_text_mutants(base, rng) + _index_mutants(names, rng)
    out += numeric_mutants(base)
    rng.shuffle(out)
    return out


def _nested(cfg: dict) -> dict:
    """``cfg`` with its text fields under ``text_config``, as multimodal checkpoints ship them."""
    config = CloverConfig.from_dict(cfg)
    config.nested_text_config = True
    return config.to_dict()


def _place(node: dict, key: str, shape: str = "one") -> None:
    """Put RAW at ``key`` (``a.b``: key b of the object under a) of ``node``: as the value (``shape`` "one"), or as
    the middle item of the list there ("list")."""
    *parents, last = key.split(".")
    for parent in parents:
        node = node.setdefault(parent, {})
    if shape == "list":
        items = list(node[last]) if isinstance(node.get(last), list) and node[last] else [0]
        items[len(items) // 2] = RAW
        node[last] = items
    else:
        node[last] = RAW


def numeric_mutants(base: Path, edges: tuple[tuple[str, Any, str], ...] = NESTED_EDGES) -> list[CheckpointMutant]:
    """Every numeric field the toolkit reads, with every edge value the field refuses: config.json's
    (config_numbers.RULES) at the top level and the text fields under ``text_config`` too (``edges`` only: the full
    set runs at the top level), generation_config.json's (GENERATION_RULES), and the block-diffusion settings under
    their other names (block_settings.NAMES) in config.json, its text_config and generation_config.json. The line
    must name the field (``a.b`` for a nested one)."""
    cfg = json.loads((base / "config.json").read_text())
    nested = _nested(cfg)
    untouched = tuple(sorted(p.name for p in base.iterdir() if p.name not in ("config.json", "generation_config.json")))
    nested_labels = {label for label, _, _ in edges}
    out: list[CheckpointMutant] = []

    def add(name: str, field: str, file: str, start: dict | None, edit: Callable[[dict], None], label: str,
            text: str) -> None:
        def apply(d: Path, start: dict | None = start) -> None:
            if start is not None:
                (d / "config.json").write_text(json.dumps(start))
            _edit_json(file, edit, text)(d)
        out.append(CheckpointMutant(f"num-{name}-{label}", (f"{field}'",), apply, linked=untouched))

    def shapes(rule: NumberRule) -> list[tuple[str, str]]:  # (how the value is placed, name suffix)
        return {"one": [("one", "")], "list": [("list", "-item")],
                "one or list": [("one", ""), ("list", "-item")]}[rule.shape]

    for rule in RULES + GENERATION_RULES:
        generation = rule in GENERATION_RULES
        for label, value, text in EDGES:
            for shape, suffix in shapes(rule):
                held = value if shape == "one" else [value]
                if rule.check(held) is None:
                    continue  # a value the field allows
                if generation:
                    add(f"generation-{rule.field}{suffix}", rule.field, "generation_config.json", None,
                        lambda g, f=rule.field, sh=shape: _place(g, f, sh), label, text)
                    continue
                add(f"{rule.field}{suffix}", rule.field, "config.json", None,
                    lambda c, f=rule.field, sh=shape: _place(c, f, sh), label, text)
                if label not in nested_labels:
                    continue
                under = rule.field if rule.field in CLOVER_FIELDS else f"text_config.{rule.field}"
                add(f"nested-{rule.field}{suffix}", rule.field, "config.json", nested,
                    lambda c, f=under, sh=shape: _place(c, f, sh), label, text)
    for field_name, names in NAMES.items():
        for alt in names[1:]:
            for where in ("config.json", "text_config", "generation_config.json"):
                for label, value, text in edges:
                    if RULE[field_name].check(value) is None:
                        continue
                    # the field's own name is gone from config.json, so that the other name is the one found
                    without = {k: v for k, v in cfg.items() if k != field_name}
                    if where == "generation_config.json":
                        add(f"{field_name}-as-{alt}-in-generation", alt, where, without,
                            lambda g, a=alt: _place(g, a), label, text)
                    else:
                        key = f"text_config.{alt}" if where == "text_config" else alt
                        add(f"{field_name}-as-{key}", key, "config.json", without,
                            lambda c, k=key: _place(c, k), label, text)
    return out


def _token_text_mutants(base: Path, rng: random.Random) -> list[CheckpointMutant]:
    """Two ids with one token text: an added token with a vocabulary entry's text, two added tokens with one
    text, and two added tokens that llama.cpp's normalization makes equal ("\u2581" is a space)."""
    tokenizer = json.loads((base / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    added = tokenizer["added_tokens"]
    free = max([*vocab.values(), *(t["id"] for t in added)]) + 1  # the next id the tokenizers library keeps
    text = rng.choice(sorted(vocab))
    twin = rng.choice(added)["content"]

    def tok(token_id: int, content: str, special: bool) -> dict:
        return {"id": token_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
                "normalized": True, "special": special}

    def adding(*tokens: dict) -> Callable[[Path], None]:
        return _edit_json("tokenizer.json", lambda t: t["added_tokens"].extend(tokens))

    out = [
        CheckpointMutant("tok-dup-vocab-text", (f"gives token {free} the text",),
                         adding(tok(free, text, False)), linked=("model.safetensors",)),
        CheckpointMutant("tok-dup-added-text", (f"gives token {free} the text",),
                         adding(tok(free, twin, True)), linked=("model.safetensors",)),
        CheckpointMutant("tok-dup-normalized", (f"gives tokens {free} and {free + 1} the same text",),
                         adding(tok(free, " xq", False), tok(free + 1, "\u2581xq", False)),
                         linked=("model.safetensors",)),
    ]
    return out


def _index_mutants(names: list[str], rng: random.Random) -> list[CheckpointMutant]:
    """model.safetensors.index.json placing one tensor in a file outside the checkpoint folder (absolute, through
    "..", to a file that exists and one that does not), in no file name at all, or holding an integer too long to
    read; the others sit in model.safetensors."""
    victim = rng.choice(names)

    def index(place: Callable[[Path], Any], literal: str | None = None) -> Callable[[Path], None]:
        def apply(d: Path) -> None:
            weight_map: dict[str, Any] = {n: "model.safetensors" for n in names}
            weight_map[victim] = place(d)
            text = json.dumps({"metadata": {"total_size": RAW if literal else 0}, "weight_map": weight_map})
            (d / INDEX_FILE).write_text(text.replace(json.dumps(RAW), literal) if literal else text)
        return apply

    escape = (f"{INDEX_FILE}: field 'weight_map'",)
    return [
        CheckpointMutant(f"index-{label}", escape, index(place)) for label, place in (
            ("parent", lambda d: "../../x.safetensors"),
            ("parent-existing", lambda d: f"../{d.name}/model.safetensors"),
            ("inner-parent", lambda d: "sub/../../model.safetensors"),
            ("absolute", lambda d: str(d / "model.safetensors")),
            ("etc-passwd", lambda d: "/etc/passwd"),
            ("not-a-name", lambda d: 5),
            ("empty-name", lambda d: ""),
        )
    ] + [CheckpointMutant("index-long-integer", (f"{INDEX_FILE}: field 'metadata.total_size'",),
                          index(lambda d: "model.safetensors", "1" + "0" * 5000))]


def materialize(base: Path, mutant: CheckpointMutant, root: Path) -> Path:
    """A copy of ``base`` under ``root`` with ``mutant`` applied (its ``linked`` files are links to the base's)."""
    d = root / mutant.name.replace("/", "_")
    shutil.copytree(base, d, symlinks=True, ignore=lambda _, names: [n for n in names if n in mutant.linked])
    for name in mutant.linked:
        (d / name).symlink_to((base / name).resolve())
    mutant.apply(d)
    return d
