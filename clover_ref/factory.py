"""The checkpoint factory: random Clover checkpoints in the spec's Hugging Face format, for tests and benchmarks."""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from clover_common.errors import BadInput
from .checkpoint import round_to_dtype, save_model
from clover_common.config import CloverConfig
from clover_common.layout import is_clover_tensor, tensor_shapes
from .model import CloverModel
from clover_common.tokenizer import MASK_TOKEN, copy_tokenizer, special_token_ids

VOCAB_SIZE = 3072  # the shipped 3008-token tokenizer, padded as Qwen pads its vocabulary

PRESETS: dict[str, dict] = {
    # 3 GDN layers + 1 attention layer; 2 key heads < 4 value heads exercises head expansion and reordering.
    "tiny": dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        vocab_size=VOCAB_SIZE, max_position_embeddings=4096, block_size=8, confidence_threshold=0.9,
        calibrated_block_sizes=[4, 8, 16], calibrated_thresholds=[0.9, 0.9, 0.95],
        rope_parameters={"rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1]},
    ),
    # The real per-layer dims of Qwen3.5-35B-A3B, with 4 layers, 16 experts and the small vocabulary.
    "mid": dict(
        hidden_size=2048, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        num_experts=16, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        vocab_size=VOCAB_SIZE, max_position_embeddings=131072, block_size=32, confidence_threshold=0.95,
        rope_parameters={"rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10]},
    ),
    # The exact Qwen3.5-35B-A3B text dims plus the clover fields (for plans and benchmarks).
    "35b-shape": dict(
        hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        vocab_size=248320, max_position_embeddings=131072, block_size=32, confidence_threshold=0.95,
        rope_parameters={"rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10]},
    ),
}


def preset_config(name: str, layers: int | None = None, nested: bool = False) -> CloverConfig:
    """The config of a preset; ``layers`` keeps the first N layers (the layer pattern is unchanged), except that
    fewer layers than the preset's full-attention interval end with one full-attention layer: a clover_moe model
    needs both layer kinds (llama.cpp refuses it otherwise, docs/gguf-format.md "Checks at load")."""
    if name not in PRESETS:
        raise BadInput(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    fields = dict(PRESETS[name])
    if layers is not None:
        if layers < 2:
            raise BadInput("--layers must be at least 2 (a clover_moe model needs a GDN and a full-attention layer)")
        fields["num_hidden_layers"] = layers
        fields["full_attention_interval"] = min(layers, fields.get("full_attention_interval", 4))
    ids = special_token_ids()
    fields.update(
        mask_token_id=ids[MASK_TOKEN],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    return CloverConfig(**fields, nested_text_config=nested)


def init_scale(name: str, shape: tuple[int, ...], config: CloverConfig) -> tuple[float, float]:
    """(mean, std) of a random tensor's values (A_log is drawn apart): linear weights N(0, 1/fan_in), norms
    near identity, and non-zero clover tensors so every code path is exercised."""
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("embed_tokens.weight"):
        return 0.0, 1.0
    if name.endswith("linear_attn.norm.weight"):
        return 1.0, 0.05
    if name.endswith("norm.weight"):
        return 0.0, 0.05
    if leaf == "dt_bias":
        return 1.0, 0.1
    if leaf == "conv_right_weight":
        return 0.0, 0.5 / math.sqrt(shape[-1])
    if leaf in ("bd_softmax_history_bias", "bd_softmax_history_c"):
        return 0.0, 0.5
    if leaf == "bd_softmax_logit_scale":
        scale = math.sqrt(config.linear_key_head_dim)
        return scale, 0.1 * scale
    return 0.0, 1.0 / math.sqrt(shape[-1])


def random_model(config: CloverConfig, seed: int) -> CloverModel:
    """A model with random weights at a realistic scale: linear weights with std 1/sqrt(fan_in) (0.022 at
    hidden 2048), norms near identity, and non-zero clover tensors so every code path is exercised."""
    torch.manual_seed(seed)
    model = CloverModel(config)
    gen = torch.Generator().manual_seed(seed)

    def normal(shape, std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):  # as transformers initialises it
                param.copy_(torch.empty(param.shape).uniform_(0.01, 16, generator=gen).log())
            else:
                mean, std = init_scale(name, tuple(param.shape), config)
                param.copy_(mean + normal(param.shape, std))
    return model


def init_checkpoint(
    out_dir: str | Path,
    preset: str,
    seed: int = 0,
    layers: int | None = None,
    config_only: bool = False,
    dtype: str = "bfloat16",
    max_shard_bytes: int | None = None,
    nested: bool = False,
) -> CloverConfig:
    """Write a random checkpoint (or, with ``config_only``, only config and tokenizer) to ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = preset_config(preset, layers, nested)
    copy_tokenizer(out_dir)
    if config_only:
        config.save(out_dir)
        return config
    model = random_model(config, seed)
    round_to_dtype(model, dtype)
    save_model(model, out_dir, dtype=dtype, max_shard_bytes=max_shard_bytes)
    return config


# ----- streaming writer for big random checkpoints (benchmarks) -----

STREAM_CHUNK_ELEMENTS = 1 << 24  # values generated at a time: bounds memory whatever the model size
_STREAM_DTYPES = {"bfloat16": ("BF16", 2), "float16": ("F16", 2), "float32": ("F32", 4)}


def _random_chunks(name: str, shape: tuple[int, ...], config: CloverConfig,
                   rng: np.random.Generator) -> Iterator[np.ndarray]:
    """The tensor's random float32 values, row-major, at most STREAM_CHUNK_ELEMENTS at a time."""
    total = math.prod(shape)
    for start in range(0, total, STREAM_CHUNK_ELEMENTS):
        count = min(STREAM_CHUNK_ELEMENTS, total - start)
        if name.endswith("A_log"):
            yield np.log(rng.uniform(0.01, 16, count)).astype(np.float32)
            continue
        mean, std = init_scale(name, shape, config)
        values = rng.standard_normal(count, dtype=np.float32)
        values *= np.float32(std)
        values += np.float32(mean)
        yield values


def _encode(values: np.ndarray, dtype: str) -> bytes:
    if dtype == "bfloat16":  # round to nearest even
        bits = values.view(np.uint32)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2").tobytes()
    return values.astype("<f2" if dtype == "float16" else "<f4").tobytes()


def write_random_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], config: CloverConfig, seed: int,
                             dtype: str = "bfloat16") -> int:
    """Write one safetensors file of random tensors, generating and writing each in bounded chunks.

    ``shapes`` maps stored names to shapes (written in that order). Returns the data bytes written. The
    file appears under its final name only when complete.
    """
    st_dtype, itemsize = _STREAM_DTYPES[dtype]
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        size = math.prod(shape) * itemsize
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for index, (name, shape) in enumerate(shapes.items()):
            rng = np.random.default_rng([seed, index])
            for values in _random_chunks(name, shape, config, rng):
                f.write(_encode(values, dtype))
    os.replace(tmp, path)
    return offset


def init_checkpoint_streaming(
    out_dir: str | Path,
    preset: str,
    seed: int = 0,
    layers: int | None = None,
    dtype: str = "bfloat16",
    max_shard_bytes: int | None = None,
    nested: bool = False,
    separate_clover_shard: bool = False,
) -> CloverConfig:
    """Like ``init_checkpoint`` for checkpoints too big to build in memory: random tensors are streamed to
    safetensors shards (per-expert layout) in bounded memory. The values follow ``random_model``'s scales
    but not its random stream.

    With ``separate_clover_shard`` the four Clover tensors of every GDN layer go to a shard of their own
    (the last), so a plain Qwen3.5-MoE twin can reuse the other shards unchanged.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = preset_config(preset, layers, nested)
    prefix = "model.language_model." if nested else "model."
    itemsize = _STREAM_DTYPES[dtype][1]
    shards: list[dict[str, tuple[int, ...]]] = [{}]
    clover: dict[str, tuple[int, ...]] = {}
    size = 0
    for name, shape in tensor_shapes(config).items():
        stored = prefix + name[len("model."):] if name.startswith("model.") else name
        if separate_clover_shard and is_clover_tensor(name):
            clover[stored] = shape
            continue
        nbytes = math.prod(shape) * itemsize
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][stored] = shape
        size += nbytes
    if clover:
        shards.append(clover)
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    total = 0
    for shard_index, (file_name, shard) in enumerate(zip(names, shards)):
        total += write_random_safetensors(out_dir / file_name, shard, config, seed * 1000 + shard_index, dtype)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: f for f, shard in zip(names, shards) for n in shard}}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    copy_tokenizer(out_dir)
    config.save(out_dir)
    return config
