"""The conversion plan: every GGUF tensor, its shape, type and size, and the Hugging Face bytes it is made of.

The plan follows the vendored llama.cpp converter for ``qwen35moe`` (``conversion/qwen.py``):
norms get +1 (except the gated ``linear_attn.norm``), ``A_log`` becomes ``-exp(A_log)``, conv weights are
squeezed, value heads are reordered to ggml's tiled order, experts are stacked, and the router, the shared
expert gate, conv, ``ssm_a``, ``ssm_dt`` and every norm stay F32. The four Clover tensors of each GDN layer
get the same value-head reorder and are always F32 (spec section 5).

A tensor's data is a list of element spans of Hugging Face tensors, concatenated in order. Row reorders are
expressed by the order of the spans, so data can be streamed in chunks of whole rows; a column reorder
(``ssm_out``) and the element-wise transform are applied to each chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from clover_common.config import CloverConfig
from clover_common.errors import CloverInputError
from clover_common.layout import check_conv_right_shape, is_clover_tensor, is_v1_tensor, layer_tensor_shapes

from clover_quantize.file_types import tensor_nbytes

from .head_order import tiled_value_heads, value_column_order
from .safetensors_index import CheckpointIndex, SourceTensor


class OutType(Enum):
    """The ``--outtype`` choices (``auto`` is resolved before planning)."""

    F32 = ("f32", GGMLQuantizationType.F32, LlamaFileType.ALL_F32)
    F16 = ("f16", GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16)
    BF16 = ("bf16", GGMLQuantizationType.BF16, LlamaFileType.MOSTLY_BF16)
    Q8_0 = ("q8_0", GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0)

    def __init__(self, label: str, ggml_type: GGMLQuantizationType, file_type: LlamaFileType) -> None:
        self.label = label
        self.ggml_type = ggml_type
        self.file_type = file_type

    @classmethod
    def from_label(cls, label: str) -> "OutType":
        for member in cls:
            if member.label == label:
                return member
        raise ValueError(f"unknown output type {label!r}")


class Transform(Enum):
    """The element-wise transform applied in float32 before encoding."""

    NONE = "none"
    ADD_ONE = "+1"
    NEG_EXP = "-exp"


@dataclass(frozen=True)
class SourceSpan:
    """``count`` consecutive elements of a Hugging Face tensor, from element ``start`` (row-major)."""

    hf_name: str
    start: int
    count: int


@dataclass
class TensorPlan:
    """One GGUF tensor. ``shape`` is in numpy order (the reverse of ggml's ne)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    spans: list[SourceSpan]
    transform: Transform = Transform.NONE
    column_order: np.ndarray | None = None  # gather indices within each row

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def row_length(self) -> int:
        return self.shape[-1]

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.ggml_type, tuple(reversed(self.shape)))  # ggml order: ne0 first


@dataclass
class ConversionPlan:
    """All GGUF tensors in file order, plus the Hugging Face tensors they read (bound when weights exist)."""

    tensors: list[TensorPlan]
    expected_inputs: dict[str, tuple[int, ...]]  # HF canonical name -> shape the config implies
    sources: dict[str, SourceTensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def subset(self, keep: Callable[[str], bool]) -> "ConversionPlan":
        """The GGUF tensors whose names ``keep`` accepts, with the Hugging Face tensors they read."""
        tensors = [t for t in self.tensors if keep(t.name)]
        read = {span.hf_name for t in tensors for span in t.spans}
        return ConversionPlan(tensors, {n: s for n, s in self.expected_inputs.items() if n in read},
                              {n: s for n, s in self.sources.items() if n in read})


def choose_type(name: str, shape: tuple[int, ...], out: OutType, always_f32: bool) -> GGMLQuantizationType:
    """The vendored converter's type policy (``ModelBase.prepare_tensors``), plus Clover's forced F32."""
    if always_f32 or len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return GGMLQuantizationType.F32
    block, _ = GGML_QUANT_SIZES[out.ggml_type]
    if shape[-1] % block:
        # gguf.quants raises QuantError here and llama.cpp's converter falls back to F16.
        return GGMLQuantizationType.F16
    return out.ggml_type


class _PlanBuilder:
    def __init__(self, config: CloverConfig, out: OutType, index: CheckpointIndex | None,
                 conv_right_order: str = "cd") -> None:
        self.config = config
        self.conv_right_order = conv_right_order
        self.out = out
        self.index = index
        self.tensors: list[TensorPlan] = []
        self.expected: dict[str, tuple[int, ...]] = {}
        self.value_heads = tiled_value_heads(config.linear_num_key_heads, config.linear_num_value_heads)

    # ----- helpers -----
    def expect(self, hf_name: str, shape: tuple[int, ...]) -> str:
        self.expected[hf_name] = shape
        return hf_name

    def add(self, name: str, shape: tuple[int, ...], spans: list[SourceSpan], transform: Transform = Transform.NONE,
            column_order: np.ndarray | None = None, always_f32: bool = False) -> None:
        assert sum(s.count for s in spans) == math.prod(shape), name
        ggml_type = choose_type(name, shape, self.out, always_f32)
        self.tensors.append(TensorPlan(name, shape, ggml_type, _merge_adjacent(spans), transform, column_order))

    def whole(self, hf_name: str, shape: tuple[int, ...]) -> list[SourceSpan]:
        self.expect(hf_name, shape)
        return [SourceSpan(hf_name, 0, math.prod(shape))]

    def by_value_head(self, hf_name: str, shape: tuple[int, ...], first: int, head_elements: int) -> list[SourceSpan]:
        """Spans that keep elements [0, first) and then take value-head blocks in tiled order."""
        self.expect(hf_name, shape)
        spans = [SourceSpan(hf_name, 0, first)] if first else []
        spans += [SourceSpan(hf_name, first + h * head_elements, head_elements) for h in self.value_heads]
        return spans

    # ----- the model -----
    def build(self) -> ConversionPlan:
        c = self.config
        d = c.hidden_size
        self.add("token_embd.weight", (c.vocab_size, d), self.whole("model.embed_tokens.weight", (c.vocab_size, d)))
        for layer in range(c.num_hidden_layers):
            self.layer(layer)
        self.add("output_norm.weight", (d,), self.whole("model.norm.weight", (d,)), Transform.ADD_ONE)
        if not c.tie_word_embeddings:
            self.add("output.weight", (c.vocab_size, d), self.whole("lm_head.weight", (c.vocab_size, d)))
        return ConversionPlan(self.tensors, self.expected)

    def layer(self, layer: int) -> None:
        hf = f"model.layers.{layer}."
        blk = f"blk.{layer}."
        fused = self.index is not None and f"{hf}mlp.experts.gate_up_proj" in self.index.tensors
        shapes = layer_tensor_shapes(self.config, layer, fused_experts=fused)

        def whole(leaf: str) -> list[SourceSpan]:
            return self.whole(hf + leaf, shapes[leaf])

        self.add(blk + "attn_norm.weight", shapes["input_layernorm.weight"], whole("input_layernorm.weight"),
                 Transform.ADD_ONE)
        if self.config.is_linear(layer):
            self.linear_attention(hf, blk, shapes)
        else:
            self.full_attention(hf, blk, shapes)
        self.add(blk + "post_attention_norm.weight", shapes["post_attention_layernorm.weight"],
                 whole("post_attention_layernorm.weight"), Transform.ADD_ONE)
        self.add(blk + "ffn_gate_inp.weight", shapes["mlp.gate.weight"], whole("mlp.gate.weight"), always_f32=True)
        self.experts(hf, blk, shapes, fused)
        self.add(blk + "ffn_gate_inp_shexp.weight", shapes["mlp.shared_expert_gate.weight"],
                 whole("mlp.shared_expert_gate.weight"), always_f32=True)
        for part in ("gate", "up", "down"):
            leaf = f"mlp.shared_expert.{part}_proj.weight"
            self.add(f"{blk}ffn_{part}_shexp.weight", shapes[leaf], whole(leaf))

    def linear_attention(self, hf: str, blk: str, shapes: dict[str, tuple[int, ...]]) -> None:
        c = self.config
        d, nv, hv = c.hidden_size, c.linear_num_value_heads, c.linear_value_head_dim
        a = hf + "linear_attn."

        def heads(leaf: str, first: int, head_elements: int) -> list[SourceSpan]:
            return self.by_value_head(a + leaf, shapes["linear_attn." + leaf], first, head_elements)

        self.add(blk + "attn_qkv.weight", (c.conv_dim, d), heads("in_proj_qkv.weight", 2 * c.key_dim * d, hv * d))
        self.add(blk + "attn_gate.weight", (c.value_dim, d), heads("in_proj_z.weight", 0, hv * d))
        self.add(blk + "ssm_alpha.weight", (nv, d), heads("in_proj_a.weight", 0, d))
        self.add(blk + "ssm_beta.weight", (nv, d), heads("in_proj_b.weight", 0, d))
        k = c.linear_conv_kernel_dim
        self.add(blk + "ssm_conv1d.weight", (c.conv_dim, k), heads("conv1d.weight", 2 * c.key_dim * k, hv * k),
                 always_f32=True)
        self.add(blk + "ssm_a", (nv,), heads("A_log", 0, 1), Transform.NEG_EXP)
        self.add(blk + "ssm_dt.bias", (nv,), heads("dt_bias", 0, 1))
        self.add(blk + "ssm_norm.weight", (hv,), self.whole(a + "norm.weight", shapes["linear_attn.norm.weight"]))
        self.add(blk + "ssm_out.weight", (d, c.value_dim),
                 self.whole(a + "out_proj.weight", shapes["linear_attn.out_proj.weight"]),
                 column_order=value_column_order(c.linear_num_key_heads, nv, hv))
        # block-diffusion tensors (spec 5): the same value-head order, always F32
        self.block_diffusion(a, blk, shapes)

    def block_diffusion(self, a: str, blk: str, shapes: dict[str, tuple[int, ...]]) -> None:
        c = self.config
        nv, hv, kr = c.linear_num_value_heads, c.linear_value_head_dim, c.conv_right_kernel
        conv_right = a + "conv_right_weight"
        shape = self._source_shape(conv_right, shapes["linear_attn.conv_right_weight"])
        if self.conv_right_order == "dc" and len(shape) == 1:  # flat [d-1][c]: channel c's taps are strided
            self.expect(conv_right, shape)
            channels = list(range(2 * c.key_dim)) + [2 * c.key_dim + h * hv + i for h in self.value_heads
                                                     for i in range(hv)]
            spans = [SourceSpan(conv_right, d * c.conv_dim + ch, 1) for ch in channels for d in range(kr)]
        else:
            spans = self.by_value_head(conv_right, shape, 2 * c.key_dim * kr, hv * kr)
        self.add(blk + "bd_conv_right.weight", (c.conv_dim, kr), spans, always_f32=True)
        for leaf, gguf_name in (("bd_softmax_logit_scale", "bd_logit_scale"),
                                ("bd_softmax_history_bias", "bd_history_bias"),
                                ("bd_softmax_history_c", "bd_history_c")):
            self.add(blk + gguf_name, (nv,), self.by_value_head(a + leaf, shapes["linear_attn." + leaf], 0, 1),
                     always_f32=True)

    def _source_shape(self, hf_name: str, canonical: tuple[int, ...]) -> tuple[int, ...]:
        """conv_right_weight's stored shape (any accepted rank, K_r checked against the kernel), or the
        canonical one when planning without weights."""
        source = self.index.tensors.get(hf_name) if self.index is not None else None
        if source is None:
            return canonical
        check_conv_right_shape(tuple(source.shape), self.config, source.name, source.path)
        return tuple(source.shape)

    def full_attention(self, hf: str, blk: str, shapes: dict[str, tuple[int, ...]]) -> None:
        for hf_leaf, gguf_leaf in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"),
                                   ("o_proj", "attn_output")):
            leaf = f"self_attn.{hf_leaf}.weight"
            self.add(f"{blk}{gguf_leaf}.weight", shapes[leaf], self.whole(hf + leaf, shapes[leaf]))
        for hf_leaf, gguf_leaf in (("q_norm", "attn_q_norm"), ("k_norm", "attn_k_norm")):
            leaf = f"self_attn.{hf_leaf}.weight"
            self.add(f"{blk}{gguf_leaf}.weight", shapes[leaf], self.whole(hf + leaf, shapes[leaf]),
                     Transform.ADD_ONE)

    def experts(self, hf: str, blk: str, shapes: dict[str, tuple[int, ...]], fused: bool) -> None:
        c = self.config
        e_count, inter, d = c.num_experts, c.moe_intermediate_size, c.hidden_size
        matrix = inter * d
        gate_up: dict[str, list[SourceSpan]] = {"gate": [], "up": []}
        down: list[SourceSpan] = []
        if fused:
            gu_name = self.expect(hf + "mlp.experts.gate_up_proj", shapes["mlp.experts.gate_up_proj"])
            down_name = self.expect(hf + "mlp.experts.down_proj", shapes["mlp.experts.down_proj"])
            for e in range(e_count):
                gate_up["gate"].append(SourceSpan(gu_name, e * 2 * matrix, matrix))
                gate_up["up"].append(SourceSpan(gu_name, e * 2 * matrix + matrix, matrix))
                down.append(SourceSpan(down_name, e * matrix, matrix))
        else:
            for e in range(e_count):
                for part in ("gate", "up"):
                    leaf = f"mlp.experts.{e}.{part}_proj.weight"
                    gate_up[part] += self.whole(hf + leaf, shapes[leaf])
                leaf = f"mlp.experts.{e}.down_proj.weight"
                down += self.whole(hf + leaf, shapes[leaf])
        self.add(blk + "ffn_gate_exps.weight", (e_count, inter, d), gate_up["gate"])
        self.add(blk + "ffn_up_exps.weight", (e_count, inter, d), gate_up["up"])
        self.add(blk + "ffn_down_exps.weight", (e_count, d, inter), down)


def _merge_adjacent(spans: list[SourceSpan]) -> list[SourceSpan]:
    merged: list[SourceSpan] = []
    for span in spans:
        if span.count == 0:
            continue
        last = merged[-1] if merged else None
        if last is not None and last.hf_name == span.hf_name and last.start + last.count == span.start:
            merged[-1] = SourceSpan(last.hf_name, last.start, last.count + span.count)
        else:
            merged.append(span)
    return merged


def build_plan(config: CloverConfig, out: OutType, index: CheckpointIndex | None,
               conv_right_order: str = "cd", only: Callable[[str], bool] | None = None) -> ConversionPlan:
    """Plan the conversion; with an index, also check every tensor against the config and bind the sources.
    ``conv_right_order`` is how a flat conv_right_weight is laid out (--conv-right-order, spec 2.3). ``only``
    keeps the GGUF tensors it accepts, and only their sources are checked and bound (the rest of the checkpoint
    is never looked at, beyond its safetensors headers)."""
    plan = _PlanBuilder(config, out, index, conv_right_order).build()
    if only is not None:
        plan = plan.subset(only)
    if index is not None:
        bind_sources(plan, index, complete=only is None)
    return plan


def bind_sources(plan: ConversionPlan, index: CheckpointIndex, complete: bool = True) -> None:
    """Attach the stored tensors, failing on a missing, misshapen or (when the plan is ``complete``) unknown
    tensor, naming it."""
    for hf_name, source in index.tensors.items():
        if is_v1_tensor(hf_name):
            raise CloverInputError(source.path, f"holds tensor '{source.name}', a spec v1 block tensor, which is "
                                                "retired; this toolkit reads spec v2 (conv_right_weight, bd_softmax_*: "
                                                "the released format)")
    for hf_name, shape in plan.expected_inputs.items():
        source = index.tensors.get(hf_name)
        if source is None:
            why = " (every Clover GDN layer has it, spec section 2)" if is_clover_tensor(hf_name) else ""
            raise CloverInputError(_checkpoint_dir(index), f"tensor '{hf_name}' is missing from the checkpoint{why}")
        if source.shape != shape:
            raise CloverInputError(source.path, f"tensor '{source.name}' has shape {list(source.shape)}, but "
                                                f"config.json implies {list(shape)}")
        plan.sources[hf_name] = source
    for hf_name, source in index.tensors.items() if complete else ():
        if hf_name not in plan.expected_inputs:
            raise CloverInputError(source.path, f"holds tensor '{source.name}', which a Clover model does not have")


def _checkpoint_dir(index: CheckpointIndex) -> str:
    return str(index.files[0].parent) if index.files else "<checkpoint>"
