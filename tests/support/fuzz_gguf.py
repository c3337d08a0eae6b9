"""Seeded GGUF mutants for the fuzz tests (tests/convert/test_fuzz.py), and the runner that loads them.

A GGUF file is parsed into a small editable model (header, key/values with their GGUF types, tensor infos with
their data) and written back with the offsets recomputed, so a mutant can change a value, a type or a shape
and still be a well-formed file where only the mutated field is wrong; raw overrides (counts, offsets,
truncation, magic, version) damage the container itself.

Every mutant is invalid on purpose and names what a good error message mentions (``expect``: any of these
substrings, case-insensitive). Random byte flips (``may_load``) can land in harmless places (a token's text,
the chat template) and may load.

Runner: ``python -m tests.support.fuzz_gguf generate|quantize|convert OUT_DIR PATH...`` (from the repository root)
loads each mutant in this one process
and prints, per mutant, ``start PATH`` before and one JSON line after: a native abort or a hang is then
pinned on the mutant whose ``start`` came last (the parent restarts the runner on the rest). With the tool ``cli``
each PATH is instead a whole command line, a JSON list of a console script's name and its arguments
(tests/support/fuzz_files.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import random
import struct
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

# GGUF value types (gguf.h)
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?", U64: "<Q",
        I64: "<q", F64: "<d"}
GGML_F32, GGML_F16, GGML_Q8_0, GGML_I32, GGML_BF16 = 0, 1, 8, 26, 30


@dataclass
class KV:
    key: str | bytes
    type: int
    value: Any                  # scalar, str/bytes, or (elem_type, list) for arrays


@dataclass
class Tensor:
    name: str | bytes
    dims: list[int]
    type: int
    data: bytes
    offset: int | None = None   # raw override of the offset written in the tensor info


@dataclass
class GGUF:
    kvs: list[KV]
    tensors: list[Tensor]
    version: int = 3
    magic: bytes = b"GGUF"
    alignment: int = 32
    n_tensors: int | None = None  # raw overrides of the header counts
    n_kv: int | None = None
    truncate: int | None = None   # cut the written file to this many bytes
    tail: bytes = b""             # bytes appended after the data section

    def kv(self, key: str) -> KV:
        return next(kv for kv in self.kvs if kv.key == key)

    def tensor(self, name: str) -> Tensor:
        return next(t for t in self.tensors if t.name == name)


def _read_str(buf: bytes, pos: int) -> tuple[bytes, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    return buf[pos + 8:pos + 8 + n], pos + 8 + n


def _read_value(buf: bytes, pos: int, vtype: int) -> tuple[Any, int]:
    if vtype == STR:
        s, pos = _read_str(buf, pos)
        return s.decode(), pos
    if vtype == ARR:
        etype, n = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        items = []
        for _ in range(n):
            v, pos = _read_value(buf, pos, etype)
            items.append(v)
        return (etype, items), pos
    (v,) = struct.unpack_from(_FMT[vtype], buf, pos)
    return v, pos + struct.calcsize(_FMT[vtype])


def parse(data: bytes) -> GGUF:
    """A GGUF v3 file written by clover-convert (well-formed; no validation here)."""
    assert data[:4] == b"GGUF"
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
    pos = 24
    kvs = []
    for _ in range(n_kv):
        key, pos = _read_str(data, pos)
        (vtype,) = struct.unpack_from("<I", data, pos)
        value, pos = _read_value(data, pos + 4, vtype)
        kvs.append(KV(key.decode(), vtype, value))
    infos = []
    for _ in range(n_tensors):
        name, pos = _read_str(data, pos)
        (n_dims,) = struct.unpack_from("<I", data, pos)
        dims = list(struct.unpack_from(f"<{n_dims}Q", data, pos + 4))
        ttype, offset = struct.unpack_from("<IQ", data, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        infos.append((name.decode(), dims, ttype, offset))
    alignment = next((kv.value for kv in kvs if kv.key == "general.alignment"), 32)
    start = -(-pos // alignment) * alignment
    ends = [o for _, _, _, o in infos[1:]] + [len(data) - start]
    tensors = [Tensor(n, d, t, data[start + o:start + e]) for (n, d, t, o), e in zip(infos, ends)]
    return GGUF(kvs, tensors, version=version, alignment=alignment)


def _str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _value(vtype: int, value: Any) -> bytes:
    if vtype == STR:
        return _str(value)
    if vtype == ARR:
        etype, items = value
        return struct.pack("<IQ", etype, len(items)) + b"".join(_value(etype, v) for v in items)
    return struct.pack(_FMT[vtype], value)


def serialize(g: GGUF) -> bytes:
    out = bytearray(g.magic)
    out += struct.pack("<IQQ", g.version, len(g.tensors) if g.n_tensors is None else g.n_tensors,
                       len(g.kvs) if g.n_kv is None else g.n_kv)
    for kv in g.kvs:
        out += _str(kv.key) + struct.pack("<I", kv.type) + _value(kv.type, kv.value)
    offset = 0
    for t in g.tensors:
        out += _str(t.name) + struct.pack("<I", len(t.dims)) + struct.pack(f"<{len(t.dims)}Q", *t.dims)
        out += struct.pack("<IQ", t.type, offset if t.offset is None else t.offset)
        offset += -(-len(t.data) // g.alignment) * g.alignment
    out += b"\0" * (-len(out) % g.alignment)
    for t in g.tensors:
        out += t.data + b"\0" * (-len(t.data) % g.alignment)
    out += g.tail
    return bytes(out if g.truncate is None else out[:g.truncate])


@dataclass
class Mutant:
    name: str                   # short id, also the file name
    expect: tuple[str, ...]     # the error line names one of these
    data: bytes = b""
    may_load: bool = False      # a random flip: loading is no error
    note: str = ""
    extra: dict = field(default_factory=dict)


def _f16(t: Tensor) -> Tensor:
    return replace(t, type=GGML_F16, data=np.frombuffer(t.data, np.float32).astype(np.float16).tobytes())


def _bf16(t: Tensor) -> Tensor:
    return replace(t, type=GGML_BF16, data=(np.frombuffer(t.data, np.uint32) >> 16).astype(np.uint16).tobytes())


def _q8_0_garbage(t: Tensor) -> Tensor:  # Q8_0 bytes for a shape whose ne0 is no multiple of 32 (or is)
    n = int(np.prod(t.dims))
    return replace(t, type=GGML_Q8_0, data=b"\1" * (max(1, n // 32) * 34))


def _field_spans(g: GGUF) -> list[tuple[int, int, str]]:
    """(begin, end, "header" | "kv KEY" | "ti NAME") of every field of a file written by ``serialize``."""
    spans = [(4, 24, "header")]
    pos = 24
    for kv in g.kvs:
        n = len(_str(kv.key)) + 4 + len(_value(kv.type, kv.value))
        spans.append((pos, pos + n, f"kv {kv.key}"))
        pos += n
    for t in g.tensors:
        n = len(_str(t.name)) + 4 + 8 * len(t.dims) + 12
        spans.append((pos, pos + n, f"ti {t.name}"))
        pos += n
    return spans


def mutants(base: bytes, seed: int = 0, n_random: int = 40) -> list[Mutant]:
    """Every designed mutant of ``base`` (a tiny clover GGUF), then ``n_random`` seeded random ones."""
    rng = random.Random(seed)
    g0 = parse(base)
    out: list[Mutant] = []

    def add(name: str, expect: tuple[str, ...] | str, g: GGUF, **kw: Any) -> None:
        out.append(Mutant(name, (expect,) if isinstance(expect, str) else expect, serialize(g), **kw))

    def copy() -> GGUF:
        return GGUF([replace(kv) for kv in g0.kvs], [replace(t) for t in g0.tensors], g0.version, g0.magic,
                    g0.alignment)

    def with_kv(key: str, vtype: int, value: Any) -> GGUF:
        g = copy()
        g.kv(key).type, g.kv(key).value = vtype, value
        return g

    def without(key: str) -> GGUF:
        g = copy()
        g.kvs = [kv for kv in g.kvs if kv.key != key]
        return g

    # --- header and container
    hdr = "gguf"
    for magic in (b"GGUX", b"\0\0\0\0"):
        g = copy(); g.magic = magic; add(f"magic-{magic.hex()}", ("magic", hdr), g)
    for v in (0, 1, 4, 0xFFFFFFFF):
        g = copy(); g.version = v; add(f"version-{v}", ("version", hdr), g)
    n_t, n_kv = len(g0.tensors), len(g0.kvs)
    for d in (-1, 1, 2**63, 2**64 - 1):
        g = copy(); g.n_tensors = (n_t + d) % 2**64 if d in (-1, 1) else d; add(f"n_tensors{d:+d}", ("tensor", hdr), g)
        g = copy(); g.n_kv = (n_kv + d) % 2**64 if d in (-1, 1) else d
        add(f"n_kv{d:+d}", ("key", "kv", "tensor", hdr), g)
    full = serialize(copy())
    data_start = len(full) - sum(-(-len(t.data) // 32) * 32 for t in g0.tensors)
    for cut in (3, 12, 30, 200, data_start // 2, data_start - 5, data_start + 100, len(full) - 1000, len(full) - 1):
        g = copy(); g.truncate = cut; add(f"truncate-{cut}", ("tensor", "bounds", "file", "read", hdr), g)
    g = copy(); g.tensors = g.tensors[:-1]; g.tail = g0.tensors[-1].data
    add("tensor-count-short", ("output.weight", "tensor"), g, note="last tensor info dropped, its data kept")
    g = copy(); g.tail = b"\0" * 64
    add("trailing-bytes", ("file size", "tensor data", "bytes"), g, note="64 bytes after the data section")
    for a in (0, 3, 2**31):
        g = copy(); g.kvs.append(KV("general.alignment", U32, a)); add(f"alignment-{a}", "alignment", g)

    # --- metadata values
    A = "clover_moe."
    bad_uint = {
        "block_count": (0, 5, 1000, 2**32 - 1),
        "embedding_length": (0, 63, 1000),
        "context_length": (0,),
        "attention.head_count": (0, 3, 1000),
        "attention.head_count_kv": (0, 3, 1000),
        "attention.key_length": (0, 31, 1000),
        "attention.value_length": (0, 1000),
        "expert_count": (0, 1, 1000, 2**32 - 1),
        "expert_used_count": (0, 9, 1000),
        "expert_feed_forward_length": (0, 1000),
        "expert_shared_feed_forward_length": (0, 1000),
        "ssm.conv_kernel": (0, 1, 1000),
        "ssm.state_size": (0, 1000),
        "ssm.group_count": (0, 3, 1000),
        "ssm.time_step_rank": (0, 3, 1000),
        "ssm.inner_size": (0, 65, 1000),
        "full_attention_interval": (0,),
        "rope.dimension_count": (0, 7, 64, 1000),
        "block_size": (0, 4096, 100000, 2**31),
        "diffusion.history_rows": (0,),
    }
    for key, values in bad_uint.items():
        for v in values:  # the message may name a key that the value contradicts (inner_size for state_size)
            add(f"kv-{key}-{v}", (key, "recurrent_layers", "tensor '"), with_kv(A + key, U32, v))
    g = with_kv(A + "full_attention_interval", U32, 0)
    g.kvs = [kv for kv in g.kvs if not kv.key.endswith("recurrent_layers")]
    add("kv-full_attention_interval-0-no-recurrent_layers", "full_attention_interval", g)
    # valid files, or values llama.cpp ignores: they must load (not a wrong success, see the notes)
    add("kv-full_attention_interval-1000", (), with_kv(A + "full_attention_interval", U32, 1000), may_load=True,
        note="harmless: attention.recurrent_layers, which clover-convert always writes, decides the layer kinds")
    for v in (3072, 2**32 - 1):
        add(f"kv-eos_token_id-{v}", (), with_kv("tokenizer.ggml.eos_token_id", U32, v), may_load=True,
            note="harmless: llama.cpp's vocabulary loader ignores an out-of-range special token id (a warning)")
    add("kv-name-invalid-utf8", (), with_kv("general.name", STR, b"\xff\xfe"), may_load=True,
        note="harmless: general.name is only printed")
    for key in ("tokenizer.ggml.mask_token_id",):
        for v in (3072, 2**31, 2**32 - 1):
            add(f"kv-{key}-{v}", (key, "token"), with_kv(key, U32, v))
    floats = {"attention.layer_norm_rms_epsilon": (0.0, -1.0, math.nan, math.inf, 1e30),
              "diffusion.threshold": (math.nan, math.inf, -math.inf, -1.0, 2.0),
              "diffusion.coreset_top_p": (0.0, -1.0, 1.5, math.nan),
              "bd.history_readout_scale": (math.nan, math.inf),
              "rope.freq_base": (0.0, -1.0, math.nan, math.inf)}
    for key, values in floats.items():
        for v in values:
            add(f"kv-{key}-{v}", key, with_kv(A + key, F32, v))
    arrays = {
        "diffusion.calibrated_block_sizes": ((U32, [0, 8, 16]), (U32, [4, 8, 5000]), (STR, ["4", "8", "16"]),
                                             (U32, [4, 8]), (F32, [4.5, 8.0, 16.0]), (ARR, [(U32, [4])] * 3)),
        "diffusion.calibrated_thresholds": ((F32, [math.nan, 0.9, 0.9]), (F32, [-1.0, 0.9, 0.9]),
                                            (F32, [0.9, 2.0, 0.9]), (F32, [0.9, math.inf, 0.9]),
                                            (STR, ["a", "b", "c"]), (F32, [0.9]), (ARR, [(F32, [0.9])] * 3)),
        "rope.dimension_sections": ((I32, [100, 100, 100, 100]), (I32, [-1, 1, 1, 0]), (STR, ["2", "1", "1", "0"]),
                                    (I32, [2, 1]), (I32, [2, 1, 1, 0, 0, 0, 0, 0, 0])),
        "attention.recurrent_layers": ((BOOL, [True] * 4), (BOOL, [False] * 4), (BOOL, [True] * 3),
                                       (STR, ["1", "1", "1", "0"])),
    }
    for key, values in arrays.items():
        for i, v in enumerate(values):
            add(f"kv-{key}-{i}", (key, "tensor '"), with_kv(A + key, ARR, v))
    tok_types = g0.kv("tokenizer.ggml.token_type").value
    add("kv-token_type-short", ("token_type", "tokenizer"),
        with_kv("tokenizer.ggml.token_type", ARR, (I32, tok_types[1][:-1])))
    add("kv-tokens-ints", ("tokenizer.ggml.tokens", "tokenizer"),
        with_kv("tokenizer.ggml.tokens", ARR, (I32, list(range(3072)))))
    # two ids with one text (llama-vocab's load error, not its assert): seeded pairs of token kinds, and an empty
    # token next to the "[EMPTY_<id>]" text llama.cpp gives it
    texts = g0.kv("tokenizer.ggml.tokens").value[1]
    by_type: dict[int, list[int]] = {}
    for i, t in enumerate(tok_types[1]):
        by_type.setdefault(t, []).append(i)
    for a_type, b_type in ((1, 1), (1, 3), (3, 3), (3, 1)):
        if len(by_type.get(a_type, [])) < 2 or len(by_type.get(b_type, [])) < 2:
            continue
        a = rng.choice(by_type[a_type])
        b = rng.choice([i for i in by_type[b_type] if i != a])
        dup = list(texts)
        dup[b] = dup[a]
        add(f"kv-tokens-duplicate-{a_type}{b_type}", ("tokenizer.ggml.tokens", "same text", f"{min(a, b)} and"),
            with_kv("tokenizer.ggml.tokens", ARR, (STR, dup)))
    dup = list(texts)
    j = rng.randrange(10, len(dup))
    dup[j], dup[j - 1] = "", f"[EMPTY_{j}]"
    add("kv-tokens-duplicate-empty", ("tokenizer.ggml.tokens", "same text", "EMPTY_"),
        with_kv("tokenizer.ggml.tokens", ARR, (STR, dup)))
    add("kv-arch-unknown", ("general.architecture", "architecture"), with_kv("general.architecture", STR, "nonesuch"))
    add("kv-arch-qwen35moe", ("general.architecture", "architecture", "clover"),
        with_kv("general.architecture", STR, "qwen35moe"))
    add("kv-arch-clover-v1", ("spec v1", "clover_moe"), with_kv("general.architecture", STR, "clover"))

    # wrong types for scalar keys, and missing keys
    typed = ["block_count", "embedding_length", "expert_count", "expert_used_count", "ssm.inner_size",
             "block_size", "diffusion.threshold", "attention.layer_norm_rms_epsilon",
             "rope.dimension_count", "ssm.state_size", "attention.head_count"]
    for key in typed:
        for vtype, value, tag in ((STR, "8", "str"), (ARR, (STR, ["8"]), "arrstr"), (F64, 8.0, "f64"),
                                  (BOOL, True, "bool"), (I64, -8, "i64")):
            if key.startswith(("diffusion.threshold", "attention.layer_norm")) and vtype == F64:
                continue  # a double is a float: accepted
            add(f"type-{key}-{tag}", key, with_kv(A + key, vtype, value))
    for vtype, value, tag in ((STR, "3", "str"), (F32, 3.0, "f32"), (ARR, (U32, [3]), "arr")):
        add(f"type-mask_token_id-{tag}", "tokenizer.ggml.mask_token_id",
            with_kv("tokenizer.ggml.mask_token_id", vtype, value))
    required = ["block_count", "embedding_length", "expert_count", "expert_used_count", "ssm.inner_size",
                "ssm.state_size", "ssm.group_count", "ssm.time_step_rank",
                "ssm.conv_kernel", "attention.layer_norm_rms_epsilon", "attention.head_count",
                "expert_feed_forward_length", "rope.dimension_sections"]
    for key in required:
        add(f"missing-{key}", (key, "expert_count" if "expert" in key else key), without(A + key))
    for key in ("general.architecture", "tokenizer.ggml.tokens", "tokenizer.ggml.model", "tokenizer.ggml.merges",
                "tokenizer.ggml.pre"):
        add(f"missing-{key}", (key, "tokenizer", "architecture", "merges"), without(key))
    # spec 5: the block-diffusion keys are optional (llama.cpp's converter writes none): defaults, and the mask
    # token found by name in the vocabulary
    for key in ("block_size", "diffusion.threshold", "diffusion.coreset_top_p", "diffusion.history_rows",
                "bd.history_readout_scale"):
        add(f"missing-{key}", (), without(A + key), may_load=True, note="optional: spec 2.2's default is used")
    add("missing-tokenizer.ggml.mask_token_id", (), without("tokenizer.ggml.mask_token_id"), may_load=True,
        note="optional: the one vocabulary token whose text contains 'mask' is the mask token")
    g = copy(); g.kvs.append(replace(g.kv(A + "block_size"), value=16))
    add("dup-key", (A + "block_size", "duplicate"), g)

    # --- tensor infos
    names = [t.name for t in g0.tensors]
    f16_bad = [n for n in names if n.endswith(("norm.weight", "ssm_a", "ssm_conv1d.weight", "ssm_dt.bias",
                                                 "bd_conv_right.weight", "bd_logit_scale", "bd_history_bias",
                                                 "bd_history_c"))]
    for n in dict.fromkeys(rng.sample(f16_bad, min(24, len(f16_bad)))
                           + ["blk.0.ssm_a", "blk.0.ssm_conv1d.weight", "blk.0.attn_norm.weight",
                              "output_norm.weight"]):
        g = copy(); i = names.index(n); g.tensors[i] = _f16(g.tensors[i]); add(f"f16-{n}", n, g)
    for n in ("blk.1.ssm_a", "blk.3.attn_q_norm.weight", "blk.2.ssm_conv1d.weight"):
        g = copy(); i = names.index(n); g.tensors[i] = _bf16(g.tensors[i]); add(f"bf16-{n}", n, g)
    for n in ("blk.0.ssm_a", "blk.2.ssm_norm.weight", "output_norm.weight", "blk.0.ssm_conv1d.weight"):
        g = copy(); i = names.index(n); g.tensors[i] = _q8_0_garbage(g.tensors[i]); add(f"q8_0-{n}", n, g)
    for n in ("blk.0.attn_qkv.weight", "token_embd.weight", "blk.3.ffn_down_exps.weight", "output.weight"):
        g = copy(); i = names.index(n); g.tensors[i] = replace(g.tensors[i], type=GGML_I32)
        add(f"i32-{n}", n, g)
    for n in rng.sample(names, 6):
        g = copy(); i = names.index(n); g.tensors[i] = replace(g.tensors[i], type=100)
        add(f"type100-{n}", (n, "type"), g)
    for n in rng.sample(names, 8):
        t = g0.tensors[names.index(n)]
        for tag, dims in (("ne0+1", [t.dims[0] + 1, *t.dims[1:]]), ("swap", t.dims[::-1]),
                          ("extra-dim", [*t.dims, 2]), ("zero", [0, *t.dims[1:]])):
            if dims == t.dims:
                continue
            g = copy(); i = names.index(n)
            size = int(np.prod(dims)) * 4
            g.tensors[i] = replace(t, dims=dims, data=(t.data * 2)[:size] if size else b"")
            add(f"shape-{tag}-{n}", n, g)
    for n in rng.sample(names, 3):
        g = copy(); i = names.index(n); g.tensors[i] = replace(g.tensors[i], dims=[1, 1, 1, 1, 1])
        add(f"ndims5-{n}", (n, "dimensions", "dims"), g)
        g = copy(); i = names.index(n); g.tensors[i] = replace(g.tensors[i], dims=[2**62, 4])
        add(f"ne-huge-{n}", (n, "overflow", "size"), g)
    for n in rng.sample(names, 6):
        i = names.index(n)
        for tag, off in (("+32", 32), ("+1", 1), ("huge", 2**62)):
            g = copy(); offs = 0
            for t in g.tensors[:i]:
                offs += -(-len(t.data) // 32) * 32
            g.tensors[i] = replace(g.tensors[i], offset=offs + off if tag != "huge" else off)
            add(f"offset{tag}-{n}", (n, "offset"), g)
    for n in rng.sample(names, 4):
        other = n.replace("weight", "wieght") if "weight" in n else n + "_x"
        g = copy(); i = names.index(n); g.tensors[i] = replace(g.tensors[i], name=other)
        add(f"rename-{n}", (n, other, "tensor"), g)
        g = copy(); del g.tensors[names.index(n)]; add(f"drop-{n}", (n, "tensor"), g)
    g = copy(); g.tensors[5] = replace(g.tensors[5], name=names[4])
    add("dup-tensor", (names[4], names[5], "duplicate"), g)
    g = copy(); g.tensors.append(Tensor("blk.9.extra.weight", [4], GGML_F32, b"\0" * 16))
    add("extra-tensor", ("blk.9.extra.weight", "tensor"), g)
    g = copy(); g.tensors[0] = replace(g.tensors[0], name="x" * 100); add("long-name", ("name", "x" * 20), g)

    # --- random damage (seeded): 1-4 random bytes, half of the mutants inside the structural fields (header,
    # non-tokenizer keys, tensor infos), the others anywhere before the data (mostly token texts and merges)
    spans = _field_spans(g0)
    structural = [sp for sp in spans if not sp[2].startswith(("kv tokenizer.ggml.tokens", "kv tokenizer.ggml.merges",
                                                              "kv tokenizer.ggml.token_type"))]
    for k in range(n_random):
        b = bytearray(full)
        hit = []
        for _ in range(rng.randint(1, 4)):
            if k % 2 == 0:
                begin, end, _name = rng.choice(structural)
                i = rng.randrange(begin, end)
            else:
                i = rng.randrange(4, data_start)
            b[i] = rng.randrange(256)
            hit.append(next(sp[2] for sp in spans if sp[0] <= i < sp[1]))
        out.append(Mutant(f"flip-{k}", (), bytes(b), may_load=True, note="bytes of " + ", ".join(dict.fromkeys(hit))))
    return out


# ------------------------------------------------------------------------------------------ the runner
def _run_one(tool: str, path: str, out_dir: Path) -> dict:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        if tool == "generate":
            from clover_cpp.cli import main
            rc = main(["generate", "-m", path, "-p", "def f(x):", "-n", "4", "--mode", "auto", "-c", "64", "-t", "1"])
        elif tool == "quantize":
            from clover_quantize.cli import main
            rc = main([path, str(out_dir / (Path(path).stem + "-q8.gguf")), "Q8_0"])
        elif tool == "cli":
            prog, *args = json.loads(path)
            rc = _console_script(prog)(args)
        else:
            from clover_convert.cli import main
            rc = main([path, str(out_dir / f"{Path(path).parent.name}-{Path(path).name}.gguf"), "--outtype", "f32",
                       "--threads", "1"])
    return {"path": path, "rc": rc, "stderr": err.getvalue()}


def _console_script(prog: str) -> Any:
    """The ``main`` of a console script (pyproject.toml's [project.scripts])."""
    if prog == "clover-convert":
        from clover_convert.cli import main
    elif prog == "clover-quantize":
        from clover_quantize.cli import main
    elif prog == "clover-cpp":
        from clover_cpp.cli import main
    elif prog == "clover-ref":
        from clover_ref.cli import main
    else:
        raise ValueError(f"no console script {prog!r}")
    return main


def runner(argv: list[str]) -> int:
    tool, out_dir, paths = argv[0], Path(argv[1]), argv[2:]
    for p in paths:
        print(f"start {p}", flush=True)
        try:
            res = _run_one(tool, p, out_dir)
        except BaseException as exc:
            res = {"path": p, "rc": "exception", "stderr": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(res), flush=True)
    return 0


def run_mutants(tool: str, paths: list[str], out_dir: Path, timeout: float,
                env: dict[str, str] | None = None, max_data_bytes: int | None = None) -> dict[str, dict]:
    """Each path's outcome: {"rc": int | "exception", "stderr": str} or {"signal": N} / {"hang": True}, running the
    runner on the paths in one process and restarting it after a crash or a hang (per-mutant ``timeout``).
    ``max_data_bytes``: the runner's RLIMIT_DATA, so that an unbounded read fails fast instead of filling memory."""
    import os
    import queue
    import resource
    import signal
    import subprocess
    import threading

    def limit() -> None:
        if max_data_bytes is not None:
            resource.setrlimit(resource.RLIMIT_DATA, (max_data_bytes, max_data_bytes))

    results: dict[str, dict] = {}
    todo = list(paths)
    while todo:
        proc = subprocess.Popen([sys.executable, "-m", "tests.support.fuzz_gguf", tool, str(out_dir), *todo],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env, start_new_session=True, cwd=Path(__file__).resolve().parents[2],
                                preexec_fn=limit if max_data_bytes is not None else None)
        lines: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:
            for line in proc.stdout:  # type: ignore[union-attr]
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # type: ignore[union-attr]
        current = None
        while True:
            try:
                line = lines.get(timeout=timeout)
            except queue.Empty:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                results[current or todo[0]] = {"hang": True}
                break
            if line is None:
                rc = proc.wait()
                if current is not None:
                    results[current] = {"signal": -rc} if rc < 0 else {"rc": "died", "exit": rc}
                break
            if line.startswith("start "):
                current = line[6:].strip()
            elif line.startswith("{"):
                res = json.loads(line)
                results[res.pop("path")] = res
                current = None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # nothing of the batch may outlive it
        todo = [p for p in todo if p not in results]
    return results


if __name__ == "__main__":
    sys.exit(runner(sys.argv[1:]))
