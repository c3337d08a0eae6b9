"""llama.cpp's value-head reorder for Gated DeltaNet layers ("grouped" Hugging Face order to "tiled" ggml order).

Hugging Face groups value heads by key head: with r = n_v / n_k, HF value head h = k * r + j belongs to key
head k. ggml broadcasts key heads tiled instead, so llama.cpp's converter stores value head j * n_k + k at
the position of HF head k * r + j (``_LinearAttentionVReorderBase._reorder_v_heads`` in the vendored
``conversion/qwen.py``). In GGUF order, value head h' therefore uses key head h' mod n_k.
"""

from __future__ import annotations

import numpy as np


def tiled_value_heads(num_key_heads: int, num_value_heads: int) -> list[int]:
    """For every GGUF value-head position, the Hugging Face value head stored there."""
    per_key = num_value_heads // num_key_heads
    return [(p % num_key_heads) * per_key + p // num_key_heads for p in range(num_value_heads)]


def value_column_order(num_key_heads: int, num_value_heads: int, head_dim: int) -> np.ndarray:
    """Column gather indices for a matrix whose input dimension is indexed by (value head, head_dim)."""
    heads = np.asarray(tiled_value_heads(num_key_heads, num_value_heads), dtype=np.int64)
    return (heads[:, None] * head_dim + np.arange(head_dim, dtype=np.int64)[None, :]).reshape(-1)
