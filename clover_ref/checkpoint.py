"""Loading and saving a whole Clover checkpoint: config.json, safetensors weights and tokenizer files."""

from __future__ import annotations

from pathlib import Path

import torch

from clover_common.config import CloverConfig
from clover_common.errors import CloverInputError
from clover_common.input_files import check_input_dir
from .hf_io import load_state_dict, save_state_dict, split_experts
from .model import CloverModel


def load_model(model_dir: str | Path) -> CloverModel:
    """Read a checkpoint directory into a float32 CloverModel, with errors that name the file and field."""
    model_dir = Path(model_dir)
    check_input_dir(model_dir, "a Clover checkpoint")
    config = CloverConfig.load(model_dir)
    state = load_state_dict(model_dir, config)
    model = CloverModel(config)
    own = model.state_dict()
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing = sorted(set(own) - set(state))
    if missing:
        raise CloverInputError(model_dir, f"tensor '{missing[0]}' is missing from the checkpoint")
    model.load_state_dict(state, strict=True)
    return model


def save_model(
    model: CloverModel,
    model_dir: str | Path,
    dtype: str = "bfloat16",
    max_shard_bytes: int | None = None,
    fused_experts: bool = False,
) -> None:
    """Write config.json and the weights (per-expert layout by default, as transformers writes it).

    A config read with a nested ``text_config`` is written nested, with ``model.language_model.`` names.
    Tokenizer files are not written here (see ``clover_common.tokenizer.copy_tokenizer``).
    """
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if not fused_experts:
        state = split_experts(state, model.config)
    prefix = "model.language_model." if model.config.nested_text_config else "model."
    save_state_dict(state, model_dir, dtype=dtype, max_shard_bytes=max_shard_bytes, name_prefix=prefix)
    model.config.save(model_dir)


def round_to_dtype(model: CloverModel, dtype: str) -> None:
    """Round the weights to what a checkpoint of ``dtype`` stores, so in-memory and reloaded models agree."""
    target = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(target).to(torch.float32))
