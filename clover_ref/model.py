"""The Clover model in plain PyTorch: causal mode (Qwen3.5-MoE) and block mode (spec sections 1 and 3).

Written for readability, not speed. Parameter names mirror the Hugging Face checkpoint, so a state dict
loads directly (with experts fused, see ``hf_io``). Everything runs in float32.

Causal passes process one position at a time. Their results therefore never depend on how many tokens
were passed together, which makes self-speculative decoding reproduce greedy ``ar`` decoding bit for bit
in the reference (spec section 4.2).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from . import precision
from clover_common.config import CloverConfig
from .coreset import check_top_p, route_in_coreset
from .history import AttentionCache, DeltaNetState, History
from .precision import Linear

L2NORM_EPS = 1e-6  # transformers hard-codes this for the GDN l2-norm


class RMSNorm(nn.Module):
    """Qwen3.5's RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), w initialised at zero."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The GDN output norm: plain weight (no +1), then multiplied by SiLU(gate)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight * F.silu(gate)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rotary(nn.Module):
    """Partial NeoX-style rotary embedding. Text positions are equal in all MRoPE sections, so the
    interleaved MRoPE of Qwen3.5 reduces to plain rotary on the first ``rotary_dim`` dimensions."""

    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        dim = config.rotary_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.dim = dim

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim]; positions: [T]."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
        rot, rest = x[..., : self.dim], x[..., self.dim:]
        return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_offset: int | None) -> torch.Tensor:
    """Softmax attention with grouped KV heads. q: [Tq, H, hd]; k, v: [n_kv, Tk, hd] -> [Tq, H, hd].

    With ``causal_offset`` = o, query i sees keys [0, o + i]; with None every query sees every key.
    """
    n_heads, n_kv = q.shape[1], k.shape[0]
    k = k.repeat_interleave(n_heads // n_kv, dim=0)
    v = v.repeat_interleave(n_heads // n_kv, dim=0)
    scores = precision.attention_scores(q, k) / math.sqrt(q.shape[-1])
    if causal_offset is not None:
        tq, tk = q.shape[0], k.shape[1]
        allowed = torch.arange(tk)[None, :] <= (causal_offset + torch.arange(tq))[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
    return precision.attention_values(scores.softmax(-1), v)


class GatedAttention(nn.Module):
    """Qwen3.5 full attention: q/k RMSNorm, partial rotary, GQA, sigmoid output gate."""

    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        c = config
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = Linear(c.hidden_size, 2 * c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def project(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary):
        t = x.shape[0]
        q, gate = self.q_proj(x).view(t, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = rotary(self.q_norm(q), positions)
        k = rotary(self.k_norm(self.k_proj(x).view(t, self.n_kv, self.head_dim)), positions)
        v = self.v_proj(x).view(t, self.n_kv, self.head_dim)
        k, v = precision.cache_value(k), precision.cache_value(v)
        return q, gate.reshape(t, -1), k.transpose(0, 1), v.transpose(0, 1)

    def output(self, attn: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.o_proj(attn.reshape(attn.shape[0], -1) * torch.sigmoid(gate))

    def causal(self, x: torch.Tensor, cache: AttentionCache, position: int, rotary: Rotary) -> torch.Tensor:
        """Causal pass over x [T, d] at positions [position, position+T); appends to the cache."""
        q, gate, k, v = self.project(x, torch.arange(position, position + x.shape[0]), rotary)
        cache.keys = torch.cat((cache.keys, k), dim=1)
        cache.values = torch.cat((cache.values, v), dim=1)
        return self.output(attend(q, cache.keys, cache.values, causal_offset=position), gate)

    def block(self, x: torch.Tensor, cache: AttentionCache, position: int, rotary: Rotary) -> torch.Tensor:
        """Block pass: the window sees the whole committed history and the whole window."""
        q, gate, k, v = self.project(x, torch.arange(position, position + x.shape[0]), rotary)
        keys = torch.cat((cache.keys, k), dim=1)
        values = torch.cat((cache.values, v), dim=1)
        return self.output(attend(q, keys, values, causal_offset=None), gate)


def delta_rule_step(s: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
                    beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One position of the gated delta rule, per head (leading dims are batch): S <- g S, then
    S <- S + k beta (v - S^T k)^T; returns (S^T q, S). s [.., H, dk, dv]; q, k [.., H, dk]; v [.., H, dv];
    decay g and beta [.., H]; q already scaled."""
    s = s * decay[..., None, None]
    delta = (v - (k[..., None, :] @ s)[..., 0, :]) * beta[..., None]  # v - S^T k
    s = s + k[..., :, None] * delta[..., None, :]
    return (q[..., None, :] @ s)[..., 0, :], s


class GatedDeltaNet(nn.Module):
    """Qwen3.5's Gated DeltaNet layer plus Clover's block-mode tensors."""

    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        c = config
        self.nk, self.nv = c.linear_num_key_heads, c.linear_num_value_heads
        self.dk, self.dv = c.linear_key_head_dim, c.linear_value_head_dim
        self.key_dim, self.value_dim, self.conv_dim = c.key_dim, c.value_dim, c.conv_dim
        self.kernel, self.right_kernel = c.linear_conv_kernel_dim, c.conv_right_kernel
        self.history_rows, self.readout_scale = c.history_rows, c.readout_scale
        self.eps = c.rms_norm_eps
        self.in_proj_qkv = Linear(c.hidden_size, c.conv_dim, bias=False)
        self.in_proj_z = Linear(c.hidden_size, c.value_dim, bias=False)
        self.in_proj_b = Linear(c.hidden_size, c.linear_num_value_heads, bias=False)
        self.in_proj_a = Linear(c.hidden_size, c.linear_num_value_heads, bias=False)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.zeros(c.conv_dim, 1, c.linear_conv_kernel_dim))
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.A_log = nn.Parameter(torch.zeros(self.nv))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.dv))
        self.out_proj = Linear(c.value_dim, c.hidden_size, bias=False)
        # block-diffusion tensors (spec 2.3), initialised as a fresh model would be
        self.conv_right_weight = nn.Parameter(torch.zeros(c.conv_dim, self.right_kernel))
        self.bd_softmax_logit_scale = nn.Parameter(torch.full((self.nv,), math.sqrt(self.dk)))
        self.bd_softmax_history_bias = nn.Parameter(torch.zeros(self.nv))
        self.bd_softmax_history_c = nn.Parameter(torch.zeros(self.nv))

    def empty_state(self) -> DeltaNetState:
        return DeltaNetState(torch.zeros(self.conv_dim, self.kernel - 1), torch.zeros(self.nv, self.dk, self.dv))

    def split_heads(self, u: torch.Tensor):
        """Post-conv activations [T, conv_dim] -> l2-normed q, k expanded to value heads, and v."""
        t = u.shape[0]
        q, k, v = u.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        repeat = self.nv // self.nk
        q = l2norm(q.reshape(t, self.nk, self.dk)).repeat_interleave(repeat, dim=1)
        k = l2norm(k.reshape(t, self.nk, self.dk)).repeat_interleave(repeat, dim=1)
        return q, k, v.reshape(t, self.nv, self.dv)

    def gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per position and value head: the write strength beta and the log of the state decay."""
        return torch.sigmoid(self.in_proj_b(x)), -self.A_log.exp() * F.softplus(self.in_proj_a(x) + self.dt_bias)

    def finish(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Gated norm and output projection: o [..., H, dv] of inputs x [..., d] -> [..., d]."""
        z = self.in_proj_z(x).view(*x.shape[:-1], self.nv, self.dv)
        o = gated_rms_norm(o, z, self.norm.weight, self.eps)
        return self.out_proj(o.reshape(*x.shape[:-1], -1))

    def block_taps(self, padded: torch.Tensor, b: int) -> torch.Tensor:
        """Spec section 3.2, GDN step 2: both convolutions over [.., K-1 history inputs, B window inputs, K_r zeros,
        C], then SiLU."""
        left = self.conv1d.weight[:, 0, :]  # tap j reads offset j - (K-1)
        right = self.conv_right_weight  # column d-1 reads offset +d
        u = sum(left[:, j] * padded[..., j: j + b, :] for j in range(self.kernel))
        start = self.kernel - 1
        u = u + sum(right[:, d - 1] * padded[..., start + d: start + d + b, :] for d in range(1, self.right_kernel + 1))
        return F.silu(u)

    def history_logit(self, width: int) -> torch.Tensor:
        """Spec 3.2 step 5: the history slot's logit per head, bias + c ln(W / history_rows), the same for every
        row of a window of ``width`` rows."""
        return self.bd_softmax_history_bias + self.bd_softmax_history_c * math.log(width / self.history_rows)

    def block_mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ssm: torch.Tensor) -> torch.Tensor:
        """Spec section 3.2, GDN steps 4-6: each row mixes the history readout S^T q with the window's values.
        q, k [..., B, H, dk], v [..., B, H, dv], ssm [..., H, dk, dv] -> o [..., B, H, dv]."""
        width = q.shape[-3]
        readout = precision.activations("...hkv,...bhk->...bhv", ssm, q * self.readout_scale)
        scale = self.bd_softmax_logit_scale[:, None, None]
        window_scores = precision.activations("...ihk,...jhk->...hij", q, k) * scale
        history_score = self.history_logit(width)[:, None, None].expand(*window_scores.shape[:-1], 1)
        weights = torch.cat((history_score, window_scores), dim=-1).softmax(-1)  # [.., h, i, 1+B]
        return weights[..., 0].transpose(-1, -2)[..., None] * readout + \
            precision.activations("...hij,...jhv->...ihv", weights[..., 1:], v)

    def causal(self, x: torch.Tensor, state: DeltaNetState) -> torch.Tensor:
        """Causal pass over x [T, d], one position at a time; updates the conv and delta-rule state."""
        weight = self.conv1d.weight[:, 0, :]
        mixed = self.in_proj_qkv(x)
        beta, log_decay = self.gates(x)
        outputs = []
        for t in range(x.shape[0]):
            window = torch.cat((state.conv, mixed[t][:, None]), dim=1)  # [conv_dim, K]
            state.conv = window[:, 1:]
            q, k, v = self.split_heads(F.silu((window * weight).sum(-1))[None])
            o, state.ssm = delta_rule_step(state.ssm, q[0] / math.sqrt(self.dk), k[0], v[0], log_decay[t].exp(),
                                           beta[t])
            outputs.append(o)
        return self.finish(torch.stack(outputs), x)

    def block_conv(self, mixed: torch.Tensor, state: DeltaNetState) -> torch.Tensor:
        """Spec section 3.2, GDN step 2: the causal conv over history and window plus the right-context branch, then
        SiLU.

        mixed: [B, conv_dim]; inputs past the window end count as zero.
        """
        padded = torch.cat((state.conv.T, mixed, torch.zeros(self.right_kernel, self.conv_dim)), dim=0)
        return self.block_taps(padded, mixed.shape[0])

    def block(self, x: torch.Tensor, state: DeltaNetState) -> torch.Tensor:
        """Block pass over a window x [B, d] (spec section 3); reads the state, never writes it."""
        q, k, v = self.split_heads(self.block_conv(self.in_proj_qkv(x), state))
        return self.finish(self.block_mix(q, k, v, state.ssm), x)


class SparseMoe(nn.Module):
    """Softmax top-k routing with renormalised weights, plus a sigmoid-gated shared expert."""

    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        c = config
        self.top_k = c.num_experts_per_tok
        self.gate = Linear(c.hidden_size, c.num_experts, bias=False)
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.zeros(c.num_experts, 2 * c.moe_intermediate_size, c.hidden_size))
        self.experts.down_proj = nn.Parameter(torch.zeros(c.num_experts, c.hidden_size, c.moe_intermediate_size))
        self.shared_expert = nn.Module()
        self.shared_expert.gate_proj = Linear(c.hidden_size, c.shared_expert_intermediate_size, bias=False)
        self.shared_expert.up_proj = Linear(c.hidden_size, c.shared_expert_intermediate_size, bias=False)
        self.shared_expert.down_proj = Linear(c.shared_expert_intermediate_size, c.hidden_size, bias=False)
        self.shared_expert_gate = Linear(c.hidden_size, 1, bias=False)

    def router_probs(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's softmax over all experts."""
        return self.gate(x).softmax(-1)

    def route(self, x: torch.Tensor, coreset_top_p: float = 1.0, window: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top-k experts and their weights, renormalised over the chosen ones; with
        ``coreset_top_p`` < 1 (block passes only) the rows of ``x`` choose inside their block coreset: one
        coreset for all rows, or one per run of ``window`` consecutive rows (a batch of windows)."""
        probs = self.router_probs(x)
        windows = probs.view(-1, window or probs.shape[0], probs.shape[-1])
        weights, experts = (t.reshape(-1, self.top_k) for t in route_in_coreset(windows, coreset_top_p, self.top_k))
        return weights / weights.sum(-1, keepdim=True), experts

    def forward(self, x: torch.Tensor, coreset_top_p: float = 1.0, window: int | None = None) -> torch.Tensor:
        weights, experts = self.route(x, coreset_top_p, window)
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():
            rows, slot = torch.where(experts == e)
            gate, up = precision.expert(x[rows], self.experts.gate_up_proj[e]).chunk(2, dim=-1)
            y = precision.expert(F.silu(gate) * up, self.experts.down_proj[e])
            out[rows] += y * weights[rows, slot, None]  # a token meets each expert at most once
        se = self.shared_expert
        shared = se.down_proj(F.silu(se.gate_proj(x)) * se.up_proj(x))
        return out + torch.sigmoid(self.shared_expert_gate(x)) * shared


class DecoderLayer(nn.Module):
    def __init__(self, config: CloverConfig, layer: int) -> None:
        super().__init__()
        self.is_linear = config.is_linear(layer)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = GatedAttention(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SparseMoe(config)

    def mix(self, h: torch.Tensor, cache, position: int, rotary: Rotary, block: bool) -> torch.Tensor:
        if self.is_linear:
            return self.linear_attn.block(h, cache) if block else self.linear_attn.causal(h, cache)
        if block:
            return self.self_attn.block(h, cache, position, rotary)
        return self.self_attn.causal(h, cache, position, rotary)

    def forward(self, x: torch.Tensor, cache, position: int, rotary: Rotary, block: bool,
                coreset_top_p: float = 1.0) -> torch.Tensor:
        x = x + self.mix(self.input_layernorm(x), cache, position, rotary, block)
        return x + self.mlp(self.post_attention_layernorm(x), coreset_top_p if block else 1.0)


class TextModel(nn.Module):
    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CloverModel(nn.Module):
    """Clover block-diffusion MoE: one set of weights, a causal mode and a block mode."""

    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.model = TextModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(config)
        self.requires_grad_(False)

    def new_history(self) -> History:
        layers: list[AttentionCache | DeltaNetState] = []
        c = self.config
        for layer in self.model.layers:
            if layer.is_linear:
                layers.append(layer.linear_attn.empty_state())
            else:
                empty = torch.zeros(c.num_key_value_heads, 0, c.head_dim)
                layers.append(AttentionCache(empty, empty.clone()))
        return History(0, layers)

    def _run(self, ids: torch.Tensor, history: History, block: bool, coreset_top_p: float = 1.0) -> torch.Tensor:
        x = self.model.embed_tokens(ids)
        for layer, cache in zip(self.model.layers, history.layers):
            x = layer(x, cache, history.length, self.rotary, block, coreset_top_p)
        return self.model.norm(x)

    @torch.no_grad()
    def forward_causal(self, ids: list[int] | torch.Tensor, history: History) -> torch.Tensor:
        """Causal pass: append ``ids`` to ``history`` (mutated in place). Returns float32 logits [T, vocab];
        row i predicts the token after ids[i]."""
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        if ids.numel() == 0:
            return torch.zeros(0, self.config.vocab_size)
        logits = []
        for index, token in enumerate(ids):
            with precision.pass_rows(precision.ubatch_rows(ids.numel(), index)):
                logits.append(self.lm_head(self._run(token[None], history, block=False)))
            history.length += 1
        return torch.cat(logits)

    @torch.no_grad()
    def forward_block(
        self, window_ids: list[int] | torch.Tensor, history: History, rows: list[int] | None = None,
        coreset_top_p: float = 1.0,
    ) -> torch.Tensor:
        """Block pass of a window at positions [history.length, history.length + B). ``history`` is only read.

        Returns logits [B, vocab] (or only the requested ``rows``); row i predicts position history.length+i+1.
        ``coreset_top_p`` < 1 routes the window's rows inside their block expert coreset (spec 3.3, coreset.py;
        every window row counts, output rows or not); 1 is per-row routing.
        """
        ids = torch.as_tensor(window_ids, dtype=torch.long).reshape(-1)
        if ids.numel() == 0:
            raise ValueError("a block pass needs a window of at least one position")
        check_top_p(coreset_top_p)
        with precision.pass_rows(ids.numel()):
            hidden = self._run(ids, history, block=True, coreset_top_p=coreset_top_p)
            if rows is not None:
                hidden = hidden[rows]
            return self.lm_head(hidden)
