"""transformers' Qwen3_5MoeForCausalLM on a Clover checkpoint: the oracle of the reference's causal mode (torch and
transformers, from the [test] extra)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
from transformers.utils import logging as hf_logging

from clover_common.config import CloverConfig


def load_transformers(checkpoint: Path) -> Qwen3_5MoeForCausalLM:
    """transformers' model on the checkpoint; it ignores the four clover tensors of each GDN layer."""
    config = CloverConfig.load(checkpoint)
    fields = {k: v for k, v in config.text_fields().items() if k != "full_attention_interval"}
    hf_logging.set_verbosity_error()
    model = Qwen3_5MoeForCausalLM.from_pretrained(checkpoint, config=Qwen3_5MoeTextConfig(**fields),
                                                  dtype=torch.float32)
    return model.eval()


def prompt(length: int, seed: int) -> torch.Tensor:
    """``length`` random token ids below 3000, the same for the same seed."""
    return torch.randint(0, 3000, (length,), generator=torch.Generator().manual_seed(seed))
