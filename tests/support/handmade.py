"""A checkpoint that transformers itself wrote: the project's factory (clover_ref.factory) was written with the
converter and could share a mistake with it. This one is transformers' Qwen3_5MoeForCausalLM, saved by
save_pretrained (its own tensor names and layout, per-expert weights included), renamed to the release's
architecture, with the four block-diffusion tensors of spec 2.3 added by hand and the mask as the tokenizer's added
token only."""

from __future__ import annotations

import json
from pathlib import Path

from clover_dev import REPO_ROOT


def write_handmade(out: Path) -> object:
    """Write the checkpoint to ``out``; the transformers model (float32, eval) whose weights it holds."""
    import math
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(0)
    config = Qwen3_5MoeTextConfig(
        vocab_size=3072, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2, max_position_embeddings=4096,
        tie_word_embeddings=False, eos_token_id=[3002, 3000], pad_token_id=3000,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [1, 1, 0], "mrope_interleaved": True},
        layer_types=["linear_attention"] * 3 + ["full_attention"])
    model = Qwen3_5MoeForCausalLM(config).float().eval()
    with torch.no_grad():  # a fresh init leaves norms and biases at exact constants: move every weight a little
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(out, safe_serialization=True)
    fields = json.loads((out / "config.json").read_text())
    fields.update(architectures=["CloverMoeModelLM"], model_type="clover_moe")
    (out / "config.json").write_text(json.dumps(fields, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"block_size": 8, "threshold": 0.9}))
    demo = REPO_ROOT / "models" / "clover-demo"
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(demo / name, out / name)
    (weights,) = out.glob("*.safetensors")
    tensors = load_file(weights)
    conv_dim, g = 2 * 2 * 16 + 4 * 16, torch.Generator().manual_seed(1)
    for i, kind in enumerate(config.layer_types):
        if kind == "linear_attention":
            prefix = f"model.layers.{i}.linear_attn."
            tensors[prefix + "conv_right_weight"] = torch.randn(conv_dim, 3, generator=g) * 0.1
            tensors[prefix + "bd_softmax_logit_scale"] = math.sqrt(16) + torch.randn(4, generator=g) * 0.1
            tensors[prefix + "bd_softmax_history_bias"] = torch.randn(4, generator=g) * 0.1
            tensors[prefix + "bd_softmax_history_c"] = torch.randn(4, generator=g) * 0.1
    save_file(tensors, weights, metadata={"format": "pt"})
    return model
