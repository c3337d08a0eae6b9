"""Fast training passes: a chunked causal pass, then many block windows per sequence in one batch.

``batched.py`` walks the delta rule one position at a time and runs one block window per sequence,
window by window. That is exact and simple, but at the demo model's size training time goes to
Python overhead, and the block loss sees only B positions per sequence and step. This module computes
the same functions faster:

- ``causal_with_window_states``: causal logits for a batch [N, T], with the delta rule evaluated
  chunk-wise (the WY form that transformers' ``torch_chunk_gated_delta_rule`` uses), and the committed
  history at every chunk boundary.
- ``block_logits_at``: block passes for any set of windows (sequence, start p), all in one batch, each
  over its own sequence's history [0, p).

Tests check both against ``batched.py`` and the reference model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .batched import causal_qkv
from .model import CloverModel, GatedAttention, GatedDeltaNet, delta_rule_step

CHUNK = 8  # window starts must be multiples of this


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                       beta: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule S_t = g_t S_{t-1} + k_t beta_t (v_t - g_t S_{t-1}^T k_t)^T, o_t = S_t^T q_t.

    q, k: [N, H, T, dk] (q already scaled); v: [N, H, T, dv]; log_decay, beta: [N, H, T]; T a multiple
    of chunk. Returns o [N, H, T, dv] and the states before each chunk and after the last one,
    [N, T/chunk + 1, H, dk, dv].
    """
    n, h, t, dk = k.shape
    dv = v.shape[-1]
    c = t // chunk
    q, k, v = (x.reshape(n, h, c, chunk, x.shape[-1]) for x in (q, k, v))
    beta = beta.reshape(n, h, c, chunk)
    g = log_decay.reshape(n, h, c, chunk).cumsum(-1)  # cumulative log decay within each chunk
    lower = torch.ones(chunk, chunk, dtype=torch.bool).tril()
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # [.., i, j]
    k_beta = k * beta[..., None]
    strict_lower = torch.ones(chunk, chunk, dtype=torch.bool).tril(-1)
    strict = ((k_beta @ k.transpose(-1, -2)) * decay).masked_fill(~strict_lower, 0)
    eye = torch.eye(chunk).expand_as(strict)
    wy = torch.linalg.solve_triangular(eye + strict, eye, upper=False, unitriangular=True)  # (I + L)^-1
    u = wy @ (v * beta[..., None])
    w = wy @ (k_beta * g.exp()[..., None])
    intra = (q @ k.transpose(-1, -2)) * decay  # causal within the chunk, diagonal included
    s = q.new_zeros(n, h, dk, dv)
    states = [s]
    outputs = []
    for i in range(c):
        v_new = u[:, :, i] - w[:, :, i] @ s
        outputs.append((q[:, :, i] * g[:, :, i, :, None].exp()) @ s + intra[:, :, i] @ v_new)
        g_last = g[:, :, i, -1]
        s = (s * g_last.exp()[..., None, None]
             + (k[:, :, i] * (g_last[..., None] - g[:, :, i]).exp()[..., None]).transpose(-1, -2) @ v_new)
        states.append(s)
    return torch.stack(outputs, dim=2).reshape(n, h, t, dv), torch.stack(states, dim=1)


@dataclass
class LayerHistory:
    """One layer's committed history for the whole batch, from which any window at a chunk boundary reads."""
    conv_inputs: torch.Tensor | None = None  # GDN: pre-conv activations [N, T, conv_dim]
    states: torch.Tensor | None = None  # GDN: delta-rule state at each chunk boundary [N, T/C + 1, H, dk, dv]
    keys: torch.Tensor | None = None  # attention: [N, n_kv, T, hd]
    values: torch.Tensor | None = None


def _deltanet_causal(layer: GatedDeltaNet, x: torch.Tensor) -> tuple[torch.Tensor, LayerHistory]:
    mixed, _, (q, k, v) = causal_qkv(layer, x)
    beta, log_decay = layer.gates(x)
    heads_first = [a.transpose(1, 2) for a in (q / math.sqrt(layer.dk), k, v, log_decay, beta)]
    o, states = chunked_delta_rule(*heads_first, CHUNK)
    return layer.finish(o.transpose(1, 2), x), LayerHistory(conv_inputs=mixed, states=states)


def _attention_causal(layer: GatedAttention, x: torch.Tensor, rotary) -> tuple[torch.Tensor, LayerHistory]:
    n, t, _ = x.shape
    q, gate, k, v = layer.project(x.reshape(n * t, -1), torch.arange(t).repeat(n), rotary)
    q = q.view(n, t, layer.n_heads, layer.head_dim).transpose(1, 2)
    k = k.reshape(k.shape[0], n, t, layer.head_dim).transpose(0, 1)  # [N, n_kv, T, hd]
    v = v.reshape(v.shape[0], n, t, layer.head_dim).transpose(0, 1)
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out = layer.output(attn.transpose(1, 2).reshape(n * t, layer.n_heads, layer.head_dim), gate.reshape(n * t, -1))
    return out.view(n, t, -1), LayerHistory(keys=k, values=v)


def causal_with_window_states(model: CloverModel, ids: torch.Tensor) -> tuple[torch.Tensor, list[LayerHistory]]:
    """Causal logits [N, T, V] and every layer's history, for windows at any chunk boundary."""
    n, t = ids.shape
    if t % CHUNK:
        raise ValueError(f"sequence length {t} is not a multiple of the chunk size {CHUNK}")
    x = model.model.embed_tokens(ids)
    histories = []
    for layer in model.model.layers:
        h = layer.input_layernorm(x)
        if layer.is_linear:
            mixed, history = _deltanet_causal(layer.linear_attn, h)
        else:
            mixed, history = _attention_causal(layer.self_attn, h, model.rotary)
        histories.append(history)
        x = x + mixed
        x = x + layer.mlp(layer.post_attention_layernorm(x).reshape(n * t, -1)).view(n, t, -1)
    return model.lm_head(model.model.norm(x)), histories


def _deltanet_block(layer: GatedDeltaNet, x: torch.Tensor, history: LayerHistory, rows: torch.Tensor,
                    starts: torch.Tensor) -> torch.Tensor:
    w, b, _ = x.shape
    mixed = layer.in_proj_qkv(x)  # [W, B, C]
    left_inputs = F.pad(history.conv_inputs, (0, 0, layer.kernel - 1, 0))  # position i at index i + K-1
    taps = starts[:, None] + torch.arange(layer.kernel - 1)[None, :]  # positions p-K+1 .. p-1, padded
    tail = left_inputs[rows[:, None], taps]  # [W, K-1, C]
    padded = torch.cat((tail, mixed, mixed.new_zeros(w, layer.right_kernel, layer.conv_dim)), dim=1)
    q, k, v = layer.split_heads(layer.block_taps(padded, b).reshape(w * b, -1))
    q = q.view(w, b, layer.nv, layer.dk)
    k = k.view(w, b, layer.nv, layer.dk)
    v = v.view(w, b, layer.nv, layer.dv)
    state = history.states[rows, starts // CHUNK]  # [W, H, dk, dv]
    return layer.finish(layer.block_mix(q, k, v, state), x)


def _attention_block(layer: GatedAttention, x: torch.Tensor, history: LayerHistory, rows: torch.Tensor,
                     starts: torch.Tensor, rotary) -> torch.Tensor:
    w, b, _ = x.shape
    positions = (starts[:, None] + torch.arange(b)[None, :]).reshape(-1)
    q, gate, k, v = layer.project(x.reshape(w * b, -1), positions, rotary)
    q = q.view(w, b, layer.n_heads, layer.head_dim).transpose(1, 2)
    k = k.reshape(k.shape[0], w, b, layer.head_dim).transpose(0, 1)  # [W, n_kv, B, hd]
    v = v.reshape(v.shape[0], w, b, layer.head_dim).transpose(0, 1)
    keys = torch.cat((history.keys[rows], k), dim=2)
    values = torch.cat((history.values[rows], v), dim=2)
    t = history.keys.shape[2]
    visible = torch.cat((torch.arange(t)[None, :] < starts[:, None], torch.ones(w, b, dtype=torch.bool)), dim=1)
    attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible[:, None, None, :], enable_gqa=True)
    out = layer.output(attn.transpose(1, 2).reshape(w * b, layer.n_heads, layer.head_dim), gate.reshape(w * b, -1))
    return out.view(w, b, -1)


def block_logits_at(model: CloverModel, windows: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor,
                    histories: list[LayerHistory], coreset_top_p: float = 1.0) -> torch.Tensor:
    """Block-pass logits [W, B, V] of windows [W, B]; window i starts at starts[i] (a multiple of CHUNK,
    at least CHUNK) in sequence rows[i] and reads that sequence's history [0, starts[i]). Each window routes
    inside its own block coreset at ``coreset_top_p`` (spec 3.3; 1 is per-row routing)."""
    if bool((starts % CHUNK != 0).any()) or bool((starts <= 0).any()):
        raise ValueError(f"window starts must be positive multiples of {CHUNK}")
    w, b = windows.shape
    x = model.model.embed_tokens(windows)
    for layer, history in zip(model.model.layers, histories):
        h = layer.input_layernorm(x)
        if layer.is_linear:
            mixed = _deltanet_block(layer.linear_attn, h, history, rows, starts)
        else:
            mixed = _attention_block(layer.self_attn, h, history, rows, starts, model.rotary)
        x = x + mixed
        x = x + layer.mlp(layer.post_attention_layernorm(x).reshape(w * b, -1), coreset_top_p, window=b).view(w, b, -1)
    return model.lm_head(model.model.norm(x))


def _deltanet_step(layer: GatedDeltaNet, x: torch.Tensor, conv: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One causal position for a batch: x [N, d]; conv [N, K-1, C] (the previous inputs); state [N, H, dk, dv]."""
    window = torch.cat((conv, layer.in_proj_qkv(x)[:, None]), dim=1)  # [N, K, C]
    q, k, v = layer.split_heads(F.silu((window * layer.conv1d.weight[:, 0, :].T[None]).sum(1)))
    beta, log_decay = layer.gates(x)
    o, state = delta_rule_step(state, q / math.sqrt(layer.dk), k, v, log_decay.exp(), beta)
    return layer.finish(o, x), window[:, 1:], state


@torch.no_grad()
def greedy_continue(model: CloverModel, ids: torch.Tensor, new_tokens: int, banned: list[int]) -> torch.Tensor:
    """Greedy causal continuation of a batch of prompts [N, L] (L a multiple of CHUNK) by new_tokens:
    the tokens ``ar`` decoding would produce, for training the block mode on the model's own output."""
    n, length = ids.shape
    logits, histories = causal_with_window_states(model, ids)
    conv = [h.conv_inputs[:, length - model.model.layers[i].linear_attn.kernel + 1:]
            if h.conv_inputs is not None else None
            for i, h in enumerate(histories)]
    states = [h.states[:, -1] if h.states is not None else None for h in histories]
    keys = [h.keys for h in histories]
    values = [h.values for h in histories]
    last = logits[:, -1]
    out = []
    for step in range(new_tokens):
        last = last.clone()
        last[:, banned] = float("-inf")
        token = last.argmax(-1)
        out.append(token)
        if step == new_tokens - 1:
            break
        position = length + step
        x = model.model.embed_tokens(token)
        for i, layer in enumerate(model.model.layers):
            h = layer.input_layernorm(x)
            if layer.is_linear:
                mixed, conv[i], states[i] = _deltanet_step(layer.linear_attn, h, conv[i], states[i])
            else:
                attn = layer.self_attn
                q, gate, k, v = attn.project(h, torch.full((n,), position), model.rotary)
                keys[i] = torch.cat((keys[i], k.transpose(0, 1)[:, :, None]), dim=2)
                values[i] = torch.cat((values[i], v.transpose(0, 1)[:, :, None]), dim=2)
                o = F.scaled_dot_product_attention(q[:, :, None], keys[i], values[i], enable_gqa=True)
                mixed = attn.output(o[:, :, 0], gate)
            x = x + mixed
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        last = model.lm_head(model.model.norm(x))
    return torch.stack(out, dim=1)
