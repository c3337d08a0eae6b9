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
from .model import CloverModel, GatedAttention, GatedDeltaNet, attend, delta_rule_step

BatchHistory = list[History]  # one History per sequence, all at the same length


def causal_qkv(layer: GatedDeltaNet, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """The causal conv of a batch x [N, T, d]: in_proj_qkv's output [N, T, C], the same transposed and left-
    padded with K-1 zeros [N, C, K-1+T], and q, k [N, T, H, dk] (l2-normed, unscaled) and v [N, T, H, dv]."""
    n, t, _ = x.shape
    mixed = layer.in_proj_qkv(x)
    padded = F.pad(mixed.transpose(1, 2), (layer.kernel - 1, 0))
    u = F.silu(F.conv1d(padded, layer.conv1d.weight, groups=layer.conv_dim)).transpose(1, 2)
    q, k, v = layer.split_heads(u.reshape(n * t, -1))
    return mixed, padded, (q.view(n, t, layer.nv, layer.dk), k.view(n, t, layer.nv, layer.dk),
                           v.view(n, t, layer.nv, layer.dv))


def deltanet_causal(layer: GatedDeltaNet, x: torch.Tensor, split: int) -> tuple[torch.Tensor, list[DeltaNetState]]:
    """x: [N, T, d] -> output [N, T, d] and each sequence's state after position split-1."""
    n, t, _ = x.shape
    _, padded, (q, k, v) = causal_qkv(layer, x)
    q = q / math.sqrt(layer.dk)
    beta, log_decay = layer.gates(x)
    decay = log_decay.exp()
    s = x.new_zeros(n, layer.nv, layer.dk, layer.dv)
    saved = s
    outputs = []
    for i in range(t):
        if i == split:
            saved = s
        o, s = delta_rule_step(s, q[:, i], k[:, i], v[:, i], decay[:, i], beta[:, i])
        outputs.append(o)
    if split == t:
        saved = s
    out = layer.finish(torch.stack(outputs, dim=1), x)  # outputs [N, T, H, dv]
    conv_tail = padded[:, :, split: split + layer.kernel - 1]  # the K-1 inputs before position `split`
    states = [DeltaNetState(conv_tail[b], saved[b]) for b in range(n)]
    return out, states


def attention_causal(layer: GatedAttention, x: torch.Tensor, split: int,
                     rotary) -> tuple[torch.Tensor, list[AttentionCache]]:
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
