"""Causal mode of the reference against transformers' Qwen3_5MoeForCausalLM on the same weights.

The reference never calls transformers; here transformers is the oracle. Bound: max |diff| at most
1e-4 * max(1, max |logit|) in float32, with identical top-1.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3_5MoeForCausalLM

from clover_dev.reference import load_transformers, prompt
from clover_ref.history import DeltaNetState
from clover_ref.model import CloverModel

RELATIVE_BOUND = 1e-4
PROMPT_LENGTHS = (1, 9, 200)


def assert_close(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> float:
    scale = max(1.0, theirs.abs().max().item())
    diff = (ours - theirs).abs().max().item()
    assert diff <= RELATIVE_BOUND * scale, f"{what}: max |diff| {diff:.3g} exceeds {RELATIVE_BOUND} * {scale:.3g}"
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1)), f"{what}: top-1 differs"
    return diff


@pytest.fixture(scope="module", params=["tiny", "mid"])
def pair(request) -> tuple[CloverModel, Qwen3_5MoeForCausalLM]:
    checkpoint = request.getfixturevalue(f"{request.param}_checkpoint")
    model = request.getfixturevalue(f"{request.param}_model")
    return model, load_transformers(checkpoint)


@torch.no_grad()
def test_full_pass_and_incremental_decoding_match_transformers(pair):
    ours_model, hf = pair
    ids = prompt(max(PROMPT_LENGTHS), seed=1)
    # Ours: prefill half, then one token at a time. Causal mode is position-by-position, so this is also
    # its full-pass result (checked bitwise below on the short prompts).
    split = len(ids) // 2
    history = ours_model.new_history()
    ours = torch.cat([ours_model.forward_causal(ids[:split], history)]
                     + [ours_model.forward_causal(ids[i:i + 1], history) for i in range(split, len(ids))])
    for length in PROMPT_LENGTHS:
        theirs = hf(ids[None, :length]).logits[0]
        assert_close(ours[:length], theirs, f"full pass, {length} tokens")
        assert torch.equal(ours_model.forward_causal(ids[:length], ours_model.new_history()), ours[:length])
    # transformers' own cached decoding: prefill, then one token at a time.
    out = hf(ids[None, :split], use_cache=True)
    cache, rows = out.past_key_values, [out.logits[0]]
    for i in range(split, len(ids)):
        out = hf(ids[None, i:i + 1], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        rows.append(out.logits[0])
    assert_close(ours, torch.cat(rows), "prefill + token-by-token decoding")


@torch.no_grad()
def test_deltanet_state_matches_transformers_cache(pair):
    ours_model, hf = pair
    for length in (9, 200):
        ids = prompt(length, seed=length)
        history = ours_model.new_history()
        ours_model.forward_causal(ids, history)
        cache = hf(ids[None], use_cache=True).past_key_values
        for layer, state in enumerate(history.layers):
            if not isinstance(state, DeltaNetState):
                continue
            theirs_ssm = cache.get_recurrent_state(layer)[0]
            theirs_conv = cache.get_conv_state(layer)[0][:, 1:]  # transformers keeps K inputs, we keep K-1
            for name, mine, theirs in (("ssm", state.ssm, theirs_ssm), ("conv", state.conv, theirs_conv)):
                scale = max(1.0, theirs.abs().max().item())
                diff = (mine - theirs).abs().max().item()
                assert diff <= RELATIVE_BOUND * scale, f"layer {layer} {name} state, {length} tokens: {diff:.3g}"


@torch.no_grad()
def test_greedy_ar_equals_transformers_generate(pair):
    from clover_ref.decode import generate

    ours_model, hf = pair
    config = ours_model.config
    for seed in (3, 4):
        ids = prompt(9, seed)
        ours = generate(ours_model, ids.tolist(), mode="ar", max_new_tokens=16).tokens
        theirs = hf.generate(ids[None], do_sample=False, max_new_tokens=16, eos_token_id=config.eos_token_ids,
                             pad_token_id=config.pad_token_id, bad_words_ids=[[config.mask_token_id]])
        theirs_new = theirs[0, len(ids):].tolist()
        if theirs_new and theirs_new[-1] in config.eos_token_ids:
            theirs_new = theirs_new[:-1]
        assert ours == theirs_new
