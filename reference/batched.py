"""Batched, differentiable forward passes for training, on a CloverModel's own parameters.

The reference's causal mode walks one position at a time, which is exact but far too slow to train
with. This module computes the same function over a batch of sequences at once: causal logits for every
position, plus the committed history at a split point, from which block passes run. Tests check it
against ``CloverModel.forward_causal`` / ``forward_block``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .history import AttentionCache, DeltaNetState, History
from .model import CloverModel, GatedAttention, GatedDeltaNet, attend, gated_rms_norm

BatchHistory = list[History]  # one History per sequence, all at the same length


def deltanet_causal(layer: GatedDeltaNet, x: torch.Tensor, split: int) -> tuple[torch.Tensor, list[DeltaNetState]]:
    """x: [N, T, d] -> output [N, T, d] and each sequence's state after position split-1."""
    n, t, _ = x.shape
    mixed = layer.in_proj_qkv(x)  # [N, T, C]
    k_conv = layer.kernel
    padded = F.pad(mixed.transpose(1, 2), (k_conv - 1, 0))  # [N, C, K-1+T]
    u = F.silu(F.conv1d(padded, layer.conv1d.weight, groups=layer.conv_dim)).transpose(1, 2)
    q, k, v = layer.split_heads(u.reshape(n * t, -1))
    q = q.view(n, t, layer.nv, layer.dk) / math.sqrt(layer.dk)
    k = k.view(n, t, layer.nv, layer.dk)
    v = v.view(n, t, layer.nv, layer.dv)
    beta = torch.sigmoid(layer.in_proj_b(x))
    decay = (-layer.A_log.exp() * F.softplus(layer.in_proj_a(x) + layer.dt_bias)).exp()
    s = x.new_zeros(n, layer.nv, layer.dk, layer.dv)
    saved = s
    outputs = []
    for i in range(t):
        if i == split:
            saved = s
        s = s * decay[:, i, :, None, None]
        kv = (k[:, i, :, None, :] @ s)[:, :, 0]  # S^T k: [N, H, dv]
        delta = (v[:, i] - kv) * beta[:, i, :, None]
        s = s + k[:, i, :, :, None] * delta[:, :, None, :]
        outputs.append((q[:, i, :, None, :] @ s)[:, :, 0])
    if split == t:
        saved = s
    o = torch.stack(outputs, dim=1)  # [N, T, H, dv]
    z = layer.in_proj_z(x).view(n, t, layer.nv, layer.dv)
    out = layer.out_proj(gated_rms_norm(o, z, layer.norm.weight, layer.eps).reshape(n, t, -1))
    conv_tail = padded[:, :, split: split + k_conv - 1]  # the K-1 inputs before position `split`
    states = [DeltaNetState(conv_tail[b], saved[b]) for b in range(n)]
    return out, states


def attention_causal(layer: GatedAttention, x: torch.Tensor, split: int, rotary) -> tuple[torch.Tensor, list[AttentionCache]]:
    n, t, _ = x.shape
    positions = torch.arange(t)
    outs, caches = [], []
    for b in range(n):
        q, gate, k, v = layer.project(x[b], positions, rotary)
        outs.append(layer.output(attend(q, k, v, causal_offset=0), gate))
        caches.append(AttentionCache(k[:, :split], v[:, :split]))
    return torch.stack(outs), caches


def causal_with_history(model: CloverModel, ids: torch.Tensor, split: int) -> tuple[torch.Tensor, BatchHistory]:
    """Causal logits [N, T, V] for a batch, and each sequence's committed history through split-1."""
    n, t = ids.shape
    x = model.model.embed_tokens(ids)
    per_layer: list[list] = []
    for layer in model.model.layers:
        h = layer.input_layernorm(x)
        if layer.is_linear:
            mixed, states = deltanet_causal(layer.linear_attn, h, split)
        else:
            mixed, states = attention_causal(layer.self_attn, h, split, model.rotary)
        per_layer.append(states)
        x = x + mixed
        x = x + layer.mlp(layer.post_attention_layernorm(x).reshape(n * t, -1)).view(n, t, -1)
    logits = model.lm_head(model.model.norm(x))
    histories = [History(split, [states[b] for states in per_layer]) for b in range(n)]
    return logits, histories


def block_logits(model: CloverModel, windows: torch.Tensor, histories: BatchHistory) -> torch.Tensor:
    """Block-pass logits [N, B, V] of windows [N, B] over each sequence's history (differentiable)."""
    rows = []
    for window, history in zip(windows, histories):
        x = model.model.embed_tokens(window)
        for layer, cache in zip(model.model.layers, history.layers):
            x = layer(x, cache, history.length, model.rotary, block=True)
        rows.append(model.lm_head(model.model.norm(x)))
    return torch.stack(rows)
