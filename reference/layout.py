"""The tensors of a Clover checkpoint in the Hugging Face format: names and shapes (spec section 2).

Names are those transformers' ``save_pretrained`` writes for ``Qwen3_5MoeForCausalLM`` (experts stored one
matrix per expert), plus the four clover tensors of every GDN layer. Loaders also accept the fused expert
layout (``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``) and the ``model.language_model.`` prefix.
"""

from __future__ import annotations

from .config import CloverConfig

PREFIX = "model."
NESTED_PREFIX = "model.language_model."
# Tensors that may appear in a checkpoint but are not part of the text model: skipped with a warning.
IGNORED_PREFIXES = ("mtp.", "model.visual.", "visual.", "model.mtp.")

CLOVER_TENSOR_SUFFIXES = (
    "linear_attn.conv1d_right.weight",
    "linear_attn.hist_key",
    "linear_attn.hist_bias",
    "linear_attn.block_scale",
)


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
            # clover
            "linear_attn.conv1d_right.weight": (c.conv_dim, 1, c.linear_conv_right_kernel_dim),
            "linear_attn.hist_key": (nv, c.linear_key_head_dim),
            "linear_attn.hist_bias": (nv,),
            "linear_attn.block_scale": (nv,),
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
