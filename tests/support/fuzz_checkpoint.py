"""Seeded checkpoint mutants for the fuzz tests (tests/convert/test_fuzz.py): broken config.json values, JSON that nests
too deeply, symlink loops, and safetensors headers and data that lie (overlapping, out-of-order or out-of-file
data_offsets, wrong dtypes and shapes, NaN weights). Each mutant is a copy of a tiny checkpoint with one
defect, and names what clover-convert's one-line error mentions (any of ``expect``)."""

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


@dataclass
class CheckpointMutant:
    name: str
    expect: tuple[str, ...]
    apply: Callable[[Path], None]  # damages the copy in this folder


def _config(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def apply(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        edit(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    return apply


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
    rng.shuffle(out)
    return out


def materialize(base: Path, mutant: CheckpointMutant, root: Path) -> Path:
    """A copy of ``base`` under ``root`` with ``mutant`` applied."""
    d = root / mutant.name.replace("/", "_")
    shutil.copytree(base, d, symlinks=True)
    mutant.apply(d)
    return d
