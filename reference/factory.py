"""The checkpoint factory: random Clover checkpoints in the spec's Hugging Face format, for tests and benchmarks."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from .checkpoint import round_to_dtype, save_model
from .config import CloverConfig
from .model import CloverModel
from .tokenizer import MASK_TOKEN, copy_tokenizer, special_token_ids

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
    """The config of a preset; ``layers`` keeps the first N layers (the layer pattern is unchanged)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    fields = dict(PRESETS[name])
    if layers is not None:
        if layers < 1:
            raise ValueError("--layers must be at least 1")
        fields["num_hidden_layers"] = layers
    ids = special_token_ids()
    fields.update(
        mask_token_id=ids[MASK_TOKEN],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    return CloverConfig(**fields, nested_text_config=nested)


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
            shape, leaf = param.shape, name.rsplit(".", 1)[-1]
            if name.endswith("embed_tokens.weight"):
                value = normal(shape, 1.0)
            elif name.endswith("linear_attn.norm.weight"):
                value = 1.0 + normal(shape, 0.05)
            elif name.endswith("norm.weight"):  # (1 + w) norms: w near zero
                value = normal(shape, 0.05)
            elif leaf == "A_log":
                value = torch.empty(shape).uniform_(0.01, 16, generator=gen).log()
            elif leaf == "dt_bias":
                value = 1.0 + normal(shape, 0.1)
            elif name.endswith("conv1d.weight"):
                value = normal(shape, 1.0 / math.sqrt(shape[-1]))
            elif name.endswith("conv1d_right.weight"):
                value = normal(shape, 0.5 / math.sqrt(shape[-1]))
            elif leaf == "hist_key":
                value = normal(shape, 1.0 / math.sqrt(shape[-1]))
            elif leaf == "hist_bias":
                value = normal(shape, 0.5)
            elif leaf == "block_scale":
                value = math.sqrt(config.linear_key_head_dim) * (1.0 + normal(shape, 0.1))
            else:  # linear weights and stacked experts: [..., out, in]
                value = normal(shape, 1.0 / math.sqrt(shape[-1]))
            param.copy_(value)
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
