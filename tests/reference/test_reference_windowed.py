"""The fast training passes (chunked delta rule, many windows per batch) equal batched.py's exact ones."""

from __future__ import annotations

import pytest
import torch

from clover_ref.batched import block_logits, causal_with_history
from clover_ref.windowed import CHUNK, block_logits_at, causal_with_window_states, chunked_delta_rule

BOUND = 1e-4  # relative to max(1, max |logit|)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a - b).abs().max().item() <= BOUND * max(1.0, b.abs().max().item())


def test_chunked_delta_rule_equals_the_recurrence():
    gen = torch.Generator().manual_seed(0)
    n, h, t, dk, dv = 2, 3, 32, 8, 5
    q = torch.randn(n, h, t, dk, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(n, h, t, dk, generator=gen), dim=-1)
    v = torch.randn(n, h, t, dv, generator=gen)
    log_decay = -torch.rand(n, h, t, generator=gen) * 2
    beta = torch.rand(n, h, t, generator=gen)
    out, states = chunked_delta_rule(q, k, v, log_decay, beta, chunk=8)
    s = torch.zeros(n, h, dk, dv)
    for i in range(t):
        if i % 8 == 0:
            assert torch.allclose(states[:, i // 8], s, atol=1e-5)
        s = s * log_decay[:, :, i, None, None].exp()
        delta = (v[:, :, i] - (k[:, :, i, None, :] @ s)[:, :, 0]) * beta[:, :, i, None]
        s = s + k[:, :, i, :, None] * delta[:, :, None, :]
        assert torch.allclose(out[:, :, i], (q[:, :, i, None, :] @ s)[:, :, 0], atol=1e-5)
    assert torch.allclose(states[:, -1], s, atol=1e-5)


def test_windowed_passes_match_batched(tiny_model):
    ids = torch.randint(0, 3000, (3, 4 * CHUNK), generator=torch.Generator().manual_seed(1))
    mask = tiny_model.config.mask_token_id
    with torch.no_grad():
        logits, histories = causal_with_window_states(tiny_model, ids)
        reference_logits, _ = causal_with_history(tiny_model, ids, split=0)
        assert close(logits, reference_logits)
        rows = torch.tensor([0, 1, 2, 0, 2])
        starts = torch.tensor([CHUNK, CHUNK, 2 * CHUNK, 3 * CHUNK, 3 * CHUNK])
        windows = ids[rows[:, None], starts[:, None] + torch.arange(6)].clone()
        windows[:, 2::2] = mask
        blocks = block_logits_at(tiny_model, windows, rows, starts, histories)
        for i, (row, start) in enumerate(zip(rows.tolist(), starts.tolist())):
            _, history = causal_with_history(tiny_model, ids[row: row + 1], split=start)
            expected = block_logits(tiny_model, windows[i: i + 1], history)[0]
            assert close(blocks[i], expected), (row, start)


def test_windowed_passes_are_differentiable(tiny_model):
    ids = torch.randint(0, 3000, (2, 2 * CHUNK), generator=torch.Generator().manual_seed(2))
    tiny_model.requires_grad_(True)
    try:
        logits, histories = causal_with_window_states(tiny_model, ids)
        blocks = block_logits_at(tiny_model, ids[:, CHUNK:], torch.tensor([0, 1]), torch.tensor([CHUNK, CHUNK]),
                                 histories)
        (logits.logsumexp(-1).mean() + blocks.logsumexp(-1).mean()).backward()
        grads = [p.grad for p in tiny_model.parameters()]
        assert all(g is not None and torch.isfinite(g).all() for g in grads)
    finally:
        tiny_model.requires_grad_(False)
        tiny_model.zero_grad(set_to_none=True)


def test_window_starts_off_the_chunk_grid_are_refused(tiny_model):
    ids = torch.randint(0, 3000, (1, 2 * CHUNK))
    with torch.no_grad():
        _, histories = causal_with_window_states(tiny_model, ids)
        with pytest.raises(ValueError, match="multiples"):
            block_logits_at(tiny_model, ids[:, :4], torch.tensor([0]), torch.tensor([3]), histories)


def test_greedy_continue_equals_reference_ar_decoding(tiny_model):
    from clover_ref.decode import generate
    from clover_ref.windowed import greedy_continue

    prompts = torch.randint(0, 3000, (3, 2 * CHUNK), generator=torch.Generator().manual_seed(3))
    mask = tiny_model.config.mask_token_id
    batched = greedy_continue(tiny_model, prompts, 12, banned=[mask])
    for row in range(3):
        expected = generate(tiny_model, prompts[row].tolist(), mode="ar", max_new_tokens=12, stop_ids=[]).tokens
        assert batched[row].tolist() == expected
