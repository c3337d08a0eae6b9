"""Hyper-parameter keys: everything llama.cpp's converter writes for ``qwen35moe`` (no MTP) plus
``expert_shared_count`` (as upstream's Clover converter), under the architecture's prefix (``clover_moe.``), then
the block-diffusion keys of spec section 5.

The order and conditions follow the vendored converter: ``TextModel.set_gguf_parameters``
(``conversion/base.py``), then ``Qwen2MoeModel``, ``Qwen3NextModel`` and ``_Qwen35MRopeMixin``
(``conversion/qwen.py``). Optional generic keys are written only when config.json has the field, as there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import ExpertGatingFuncType, GGUFValueType, GGUFWriter, LlamaFileType

from clover_common.config import CloverConfig
from clover_common.errors import CloverInputError
from clover_common.layout import GGUF_ARCH
from clover_common.long_numbers import shown

ARCH = GGUF_ARCH  # the default; --arch-name writes another (the writer's arch is the key prefix)

# Optional fields and the keys llama.cpp's TextModel looks them up under, first match wins.
_FEED_FORWARD_FIELDS = ("prefix_dense_intermediate_size", "dense_intermediate_size", "intermediate_size", "n_inner",
                        "hidden_dim")
_LAYER_NORM_EPS_FIELDS = ("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon")
_SCORE_FUNC_FIELDS = ("score_function", "scoring_func", "score_func", "moe_router_activation",
                      "moe_router_activation_func", "expert_selection_fn")
_GATING_FUNCS = {"sigmoid": ExpertGatingFuncType.SIGMOID, "softmax": ExpertGatingFuncType.SOFTMAX}


def merged_hparams(raw_config: dict[str, Any]) -> dict[str, Any]:
    """config.json with ``text_config`` lifted to the top level, as llama.cpp's TextModel does."""
    text = raw_config.get("text_config")
    return {**raw_config, **text} if isinstance(text, dict) else dict(raw_config)


def _first(hparams: dict[str, Any], names: tuple[str, ...]) -> Any:
    return next((hparams[n] for n in names if n in hparams), None)


def check_upstream_layout(config: CloverConfig, config_path: Path) -> None:
    """Refuse, naming config.json's field, a config whose GGUF upstream llama.cpp's ``clover_moe`` loader (b12060+)
    refuses, and with it this toolkit's loader (docs/gguf-format.md, "Checks at load"): both layer kinds present,
    and GDN value heads as wide as key heads (``ssm.inner_size`` = ``ssm.state_size`` * ``ssm.time_step_rank``).
    A positive ``full_attention_interval``, equal key and value head sizes (both ``head_dim``) and value heads that
    key heads divide are CloverConfig.validate's."""
    kinds = set(config.layer_types or [])
    if kinds != {"linear_attention", "full_attention"}:
        only = next(iter(kinds)) if len(kinds) == 1 else "none"
        raise CloverInputError(config_path, f"holds only {only!r} layers; a clover_moe model needs both "
                               "'linear_attention' (GDN) and 'full_attention' layers (llama.cpp refuses it too)",
                               field="layer_types")
    if config.linear_value_head_dim != config.linear_key_head_dim:
        raise CloverInputError(config_path, f"is {config.linear_value_head_dim}, but GDN value heads must be as wide "
                               f"as key heads (linear_key_head_dim = {config.linear_key_head_dim})",
                               field="linear_value_head_dim")


def add_model_keys(writer: GGUFWriter, config: CloverConfig, raw_config: dict[str, Any], config_path: Path,
                   file_type: LlamaFileType, block_diffusion: bool = True) -> None:
    """All ``ARCH.*`` hyper-parameter keys and ``general.file_type``, in llama.cpp's order, then (unless
    ``block_diffusion`` is false: a trunk-only file, whose keys are those of llama.cpp's converter) the
    block-diffusion keys."""
    c = config
    hparams = merged_hparams(raw_config)
    rope = c.rope_parameters
    # TextModel.set_gguf_parameters
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    if (n_ff := _first(hparams, _FEED_FORWARD_FIELDS)) is not None:
        writer.add_feed_forward_length(n_ff)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    if hparams.get("is_causal") is False:
        writer.add_causal_attention(False)
    # rope_type is "default" (CloverConfig.validate refuses scaled rope), so no rope.scaling.* keys.
    sections = list(rope["mrope_section"])
    writer.add_rope_dimension_sections((sections + [0] * 4)[:4])
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    if (eps := _first(hparams, _LAYER_NORM_EPS_FIELDS)) is not None:
        writer.add_layer_norm_eps(eps)
    writer.add_expert_count(c.num_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    if (n_group := hparams.get("n_group")) is not None:
        writer.add_expert_group_count(n_group)
    if (topk_group := hparams.get("topk_group")) is not None:
        writer.add_expert_group_used_count(topk_group)
    if (score_func := _first(hparams, _SCORE_FUNC_FIELDS)) is not None:
        if not isinstance(score_func, str) or score_func not in _GATING_FUNCS:
            raise CloverInputError(config_path, f"expert score function {shown(score_func)} is not supported "
                                                f"(expected one of {sorted(_GATING_FUNCS)})")
        writer.add_expert_gating_func(_GATING_FUNCS[score_func])
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_file_type(file_type)
    # Qwen2MoeModel
    writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    # CloverMoeModel (upstream's conversion/clover.py): num_shared_experts, always 1 here (CloverConfig refuses more)
    writer.add_expert_shared_count(c.num_shared_experts)
    # Qwen3NextModel (the wheel's writer lacks add_recurrent_layers: write the bool array directly)
    writer.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    writer.add_ssm_state_size(c.linear_key_head_dim)
    writer.add_ssm_group_count(c.linear_num_key_heads)
    writer.add_ssm_time_step_rank(c.linear_num_value_heads)
    writer.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
    writer.add_key_value(f"{writer.arch}.attention.recurrent_layers",
                         [c.is_linear(i) for i in range(c.num_hidden_layers)],
                         GGUFValueType.ARRAY, sub_type=GGUFValueType.BOOL)
    writer.add_full_attention_interval(c.full_attention_interval)
    writer.add_rope_dimension_count(c.rotary_dim)
    if block_diffusion:
        add_clover_keys(writer, c)


@dataclass(frozen=True)
class BdKey:
    """One block-diffusion key (spec section 5): the mirror of a row of ``cpp_patch/src/clover-keys.h``, the table
    both C++ readers use (tests/convert/test_bd_keys_table.py checks that the two are equal)."""

    name: str          # the C++ row id, e.g. BLOCK_SIZE
    scope: str         # "ARCH": ``{arch}.{suffix}``; "GLOBAL": ``suffix`` itself
    suffix: str
    gguf_type: str     # U32, F32, BOOL, ARR_U32, ARR_F32
    default: float     # nan: derived (readout scale 1/sqrt(d_k), the mask token by name, no calibrated lists)
    lo: float
    hi: float
    lo_open: bool = False

    def key(self, arch: str) -> str:
        return f"{arch}.{self.suffix}" if self.scope == "ARCH" else self.suffix

    def check(self, value: float) -> str | None:
        """The rule ``value`` breaks (None when valid), as the C++ readers word it."""
        is_int = self.gguf_type in ("U32", "ARR_U32", "BOOL")
        finite_only = self.lo <= -3.4e38 and self.hi >= 3.4e38
        if not math.isfinite(value):
            return "must be a finite number" if finite_only or not is_int else "must be an integer"
        if is_int and value != math.floor(value):
            return "must be an integer"
        if (value > self.lo if self.lo_open else value >= self.lo) and value <= self.hi:
            return None
        if finite_only:
            return "must be a finite number"
        if is_int:
            return f"must be >= {self.lo:g}" if self.hi >= 2147483647 else f"must be in {self.lo:g} .. {self.hi:g}"
        return f"must be in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}]"


_NAN = float("nan")
_I32_MAX = 2147483647.0
BD_KEYS: tuple[BdKey, ...] = (
    BdKey("BLOCK_SIZE", "ARCH", "block_size", "U32", 32, 1, 256),
    BdKey("THRESHOLD", "ARCH", "diffusion.threshold", "F32", 0.95, 0, 1),
    BdKey("CORESET_TOP_P", "ARCH", "diffusion.coreset_top_p", "F32", 1, 0, 1, lo_open=True),
    BdKey("HISTORY_ROWS", "ARCH", "diffusion.history_rows", "U32", 32, 1, _I32_MAX),
    BdKey("HISTORY_READOUT_SCALE", "ARCH", "bd.history_readout_scale", "F32", _NAN, -3.4e38, 3.4e38),
    BdKey("CALIBRATED_BLOCK_SIZES", "ARCH", "diffusion.calibrated_block_sizes", "ARR_U32", _NAN, 1, 256),
    BdKey("CALIBRATED_THRESHOLDS", "ARCH", "diffusion.calibrated_thresholds", "ARR_F32", _NAN, 0, 1),
    BdKey("MASK_TOKEN_ID", "GLOBAL", "tokenizer.ggml.mask_token_id", "U32", _NAN, 0, _I32_MAX),
    BdKey("SHIFT_LOGITS", "GLOBAL", "diffusion.shift_logits", "BOOL", 1, 1, 1),
)
BD_KEY = {k.name: k for k in BD_KEYS}
_SUB_TYPES = {"U32": GGUFValueType.UINT32, "F32": GGUFValueType.FLOAT32, "BOOL": GGUFValueType.BOOL,
              "ARR_U32": GGUFValueType.UINT32, "ARR_F32": GGUFValueType.FLOAT32}


def _add_bd_key(writer: GGUFWriter, name: str, value: Any) -> None:
    """Write one block-diffusion key with the table's type, after the table's range check (CloverConfig.validate
    refuses such values first, naming config.json's field; this keeps the writer from ever making a file that
    the loaders refuse)."""
    spec = BD_KEY[name]
    key = spec.key(writer.arch)
    values = list(value) if spec.gguf_type.startswith("ARR_") else [value]
    for v in values:
        if (why := spec.check(float(v))) is not None:
            raise ValueError(f"{key} = {v!r} {why}")
    if spec.gguf_type.startswith("ARR_"):
        cast = int if spec.gguf_type == "ARR_U32" else float
        writer.add_key_value(key, [cast(v) for v in values], GGUFValueType.ARRAY, sub_type=_SUB_TYPES[spec.gguf_type])
    else:
        cast = {"U32": int, "F32": float, "BOOL": bool}[spec.gguf_type]
        writer.add_key_value(key, cast(value), _SUB_TYPES[spec.gguf_type])


# the penalties count the response only (spec 4, 4.5): the patched llama.cpp's penalties sampler does when this key
# says so. A Clover decoding rule, so it goes with the block-diffusion keys: a --bd-sidecar trunk stays llama.cpp's
# converter's file (spec 6)
RESPONSE_ONLY_KEY = "general.sampling.penalty_response_only"


def add_clover_keys(writer: GGUFWriter, config: CloverConfig) -> None:
    """The block-diffusion keys of spec section 5 (the mask token id is written with the tokenizer), typed and
    checked by ``BD_KEYS``, and ``RESPONSE_ONLY_KEY``. The calibrated block sizes and thresholds are this toolkit's
    extension (absent from other converters' files)."""
    assert config.calibrated_block_sizes is not None and config.calibrated_thresholds is not None
    _add_bd_key(writer, "BLOCK_SIZE", config.block_size)
    _add_bd_key(writer, "THRESHOLD", config.confidence_threshold)
    _add_bd_key(writer, "CORESET_TOP_P", config.coreset_top_p)
    _add_bd_key(writer, "HISTORY_ROWS", config.history_rows)
    _add_bd_key(writer, "HISTORY_READOUT_SCALE", config.readout_scale)
    _add_bd_key(writer, "CALIBRATED_BLOCK_SIZES", config.calibrated_block_sizes)
    _add_bd_key(writer, "CALIBRATED_THRESHOLDS", config.calibrated_thresholds)
    _add_bd_key(writer, "SHIFT_LOGITS", True)
    writer.add_bool(RESPONSE_ONLY_KEY, True)
