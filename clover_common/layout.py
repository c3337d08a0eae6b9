"""The tensors of a Clover checkpoint in the Hugging Face format: names and shapes (spec section 2).

Names are those transformers' ``save_pretrained`` writes for ``Qwen3_5MoeForCausalLM`` (experts stored one
matrix per expert), plus the four block-diffusion tensors of every GDN layer (spec v2 section 2.3). Loaders also
accept the fused expert layout (``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``) and the
``model.language_model.`` prefix.
"""

from __future__ import annotations

from typing import Any

from .config import CloverConfig
from .errors import CloverInputError

# The GGUF architecture string (spec 5): upstream's LLM_ARCH_CLOVER_MOE, whose string is not public; kept here
# only. clover-convert --arch-name writes another; the patched loader registers every spelling in ARCH_SPELLINGS.
GGUF_ARCH = "clover_moe"
ARCH_SPELLINGS = ("clover_moe", "clover-moe", "clovermoe")
V1_GGUF_ARCH = "clover"

PREFIX = "model."
NESTED_PREFIX = "model.language_model."
# Tensors that may appear in a checkpoint but are not part of the text model: skipped with a warning.
IGNORED_PREFIXES = ("mtp.", "model.visual.", "visual.", "model.mtp.")

CONV_RIGHT = "linear_attn.conv_right_weight"
LOGIT_SCALE = "linear_attn.bd_softmax_logit_scale"
HISTORY_BIAS = "linear_attn.bd_softmax_history_bias"
HISTORY_C = "linear_attn.bd_softmax_history_c"
CLOVER_TENSOR_SUFFIXES = (CONV_RIGHT, LOGIT_SCALE, HISTORY_BIAS, HISTORY_C)
# spec v1's block tensors: retired, refused with a message that names v2
V1_TENSOR_SUFFIXES = (
    "linear_attn.conv1d_right.weight",
    "linear_attn.hist_key",
    "linear_attn.hist_bias",
    "linear_attn.block_scale",
)
# --conv-right-order: how a flat conv_right_weight [conv_dim*K_r] is laid out (spec 2.3)
CONV_RIGHT_ORDERS = ("cd", "dc")


def layer_tensor_shapes(config: CloverConfig, layer: int, fused_experts: bool = False) -> dict[str, tuple[int, ...]]:
    """Shapes of one decoder layer's tensors, keyed by the name relative to ``model.layers.N.``."""
    c = config
    d = c.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
        "mlp.gate.weight": (c.num_experts, d),
        "mlp.shared_expert.gate_proj.weight": (c.shared_expert_intermediate_size, d),
        "mlp.shared_expert.up_proj.weight": (c.shared_expert_intermediate_size, d),
        "mlp.shared_expert.down_proj.weight": (d, c.shared_expert_intermediate_size),
        "mlp.shared_expert_gate.weight": (1, d),
    }
    if fused_experts:
        shapes["mlp.experts.gate_up_proj"] = (c.num_experts, 2 * c.moe_intermediate_size, d)
        shapes["mlp.experts.down_proj"] = (c.num_experts, d, c.moe_intermediate_size)
    else:
        for e in range(c.num_experts):
            shapes[f"mlp.experts.{e}.gate_proj.weight"] = (c.moe_intermediate_size, d)
            shapes[f"mlp.experts.{e}.up_proj.weight"] = (c.moe_intermediate_size, d)
            shapes[f"mlp.experts.{e}.down_proj.weight"] = (d, c.moe_intermediate_size)
    if c.is_linear(layer):
        nv = c.linear_num_value_heads
        shapes.update({
            "linear_attn.in_proj_qkv.weight": (c.conv_dim, d),
            "linear_attn.in_proj_z.weight": (c.value_dim, d),
            "linear_attn.in_proj_b.weight": (nv, d),
            "linear_attn.in_proj_a.weight": (nv, d),
            "linear_attn.conv1d.weight": (c.conv_dim, 1, c.linear_conv_kernel_dim),
            "linear_attn.dt_bias": (nv,),
            "linear_attn.A_log": (nv,),
            "linear_attn.norm.weight": (c.linear_value_head_dim,),
            "linear_attn.out_proj.weight": (d, c.value_dim),
            # block diffusion (spec 2.3); conv_right_weight's accepted ranks: conv_right_shapes
            CONV_RIGHT: (c.conv_dim, c.conv_right_kernel),
            LOGIT_SCALE: (nv,),
            HISTORY_BIAS: (nv,),
            HISTORY_C: (nv,),
        })
    else:
        hd = c.head_dim
        shapes.update({
            "self_attn.q_proj.weight": (2 * c.num_attention_heads * hd, d),
            "self_attn.k_proj.weight": (c.num_key_value_heads * hd, d),
            "self_attn.v_proj.weight": (c.num_key_value_heads * hd, d),
            "self_attn.o_proj.weight": (d, c.num_attention_heads * hd),
            "self_attn.q_norm.weight": (hd,),
            "self_attn.k_norm.weight": (hd,),
        })
    return shapes


def tensor_shapes(config: CloverConfig, fused_experts: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint (``model.`` prefix), in a stable order."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, config.hidden_size)}
    for layer in range(config.num_hidden_layers):
        for name, shape in layer_tensor_shapes(config, layer, fused_experts).items():
            shapes[f"{PREFIX}layers.{layer}.{name}"] = shape
    shapes["model.norm.weight"] = (config.hidden_size,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    return shapes


def canonical_name(name: str) -> str | None:
    """Map a stored tensor name to the ``model.``-prefixed form; None for tensors to ignore (vision, MTP)."""
    if name.startswith(NESTED_PREFIX):
        name = PREFIX + name[len(NESTED_PREFIX):]
    if name.startswith(IGNORED_PREFIXES):
        return None
    return name


def is_clover_tensor(name: str) -> bool:
    return name.endswith(CLOVER_TENSOR_SUFFIXES)


def is_v1_tensor(name: str) -> bool:
    return name.endswith(V1_TENSOR_SUFFIXES)


def conv_right_shapes(config: CloverConfig) -> tuple[tuple[int, ...], ...]:
    """The accepted HF shapes of conv_right_weight: [conv_dim, K_r], [conv_dim, 1, K_r], flat [conv_dim*K_r]."""
    c, k = config.conv_dim, config.conv_right_kernel
    return (c, k), (c, 1, k), (c * k,)


def conv_right_kernel_of(shape: tuple[int, ...], config: CloverConfig) -> int | None:
    """K_r read from a conv_right_weight shape of an accepted rank (None for any other shape)."""
    c = config.conv_dim
    if len(shape) == 2 and shape[0] == c:
        return shape[1]
    if len(shape) == 3 and shape[0] == c and shape[1] == 1:
        return shape[2]
    if len(shape) == 1 and shape[0] % c == 0:
        return shape[0] // c
    return None


def check_conv_right_shape(shape: tuple[int, ...], config: CloverConfig, stored: str, path) -> None:
    """Refuse a conv_right_weight whose rank is not accepted, or whose K_r is not linear_conv_kernel_dim - 1."""
    k_r = conv_right_kernel_of(tuple(shape), config)
    if k_r is None:
        accepted = " or ".join(str(list(s)) for s in conv_right_shapes(config))
        raise CloverInputError(path, f"tensor '{stored}' has shape {list(shape)}; conv_right_weight must be "
                                     f"{accepted} (conv_dim = {config.conv_dim}, K_r right taps)")
    if k_r != config.conv_right_kernel:
        raise CloverInputError(path, f"tensor '{stored}' has K_r = {k_r} right taps, but linear_conv_kernel_dim = "
                                     f"{config.linear_conv_kernel_dim} in config.json implies K_r = "
                                     f"{config.conv_right_kernel} (spec 2.3)")


def normalize_conv_right(tensor: Any, config: CloverConfig, order: str = "cd") -> Any:
    """conv_right_weight of any accepted rank as [conv_dim, K_r] (column d-1 reads offset +d). A flat tensor is
    read in [c][d-1] order, or [d-1][c] with ``order`` = "dc" (--conv-right-order). Works on torch tensors and
    numpy arrays alike (this module stays torch-free)."""
    c, k = config.conv_dim, config.conv_right_kernel
    if len(tensor.shape) == 1:
        return tensor.reshape(k, c).T.reshape(c, k) if order == "dc" else tensor.reshape(c, k)
    return tensor.reshape(c, k)
