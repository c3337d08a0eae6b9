"""The batched training forward computes the same function as the reference's causal and block modes."""

from __future__ import annotations

import pytest
import torch

from clover_ref.batched import block_logits, causal_with_history

BOUND = 1e-4  # relative to max(1, max |logit|): batched matmuls round differently from one row at a time


@pytest.mark.parametrize("split", [0, 7, 20])
def test_batched_causal_and_block_match_the_reference(tiny_model, split):
    ids = torch.randint(0, 3000, (3, 20), generator=torch.Generator().manual_seed(split))
    window = torch.tensor([5, tiny_model.config.mask_token_id, 9, tiny_model.config.mask_token_id, 11, 12, 13, 14])
    with torch.no_grad():
        logits, histories = causal_with_history(tiny_model, ids, split)
        blocks = block_logits(tiny_model, window.expand(3, -1), histories)
    for b in range(3):
        reference = tiny_model.forward_causal(ids[b], tiny_model.new_history())
        assert (logits[b] - reference).abs().max() <= BOUND * max(1.0, reference.abs().max().item())
        history = tiny_model.new_history()
        tiny_model.forward_causal(ids[b, :split], history)
        assert history.length == histories[b].length
        reference_block = tiny_model.forward_block(window, history)
        assert (blocks[b] - reference_block).abs().max() <= BOUND * max(1.0, reference_block.abs().max().item())
