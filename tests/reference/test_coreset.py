"""The block expert coreset of spec v2 section 3.3 in the reference (clover_ref.coreset): the rule on hand-made
router probabilities, its two identities (top_p = 1 and one-row windows are per-row routing), and that a
cut restricts every row of a window to one expert set. The native graph does not implement it yet."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from clover_ref.coreset import block_coreset, check_top_p, cut_is_near_tie, route_in_coreset

MASK = 3007


def test_the_rule_on_hand_made_probabilities() -> None:
    probs = torch.tensor([[0.40, 0.10, 0.20, 0.20, 0.05, 0.05],
                          [0.20, 0.10, 0.30, 0.30, 0.05, 0.05]])
    c = block_coreset(probs, top_p=0.5, top_k=2)
    # block mass 0.30, 0.10, 0.25, 0.25, 0.05, 0.05: experts 2 and 3 tie, the lower id first
    assert c.order.tolist()[:4] == [0, 2, 3, 1]
    assert c.cut == 2 and c.experts.tolist() == [0, 2]        # 0.30 + 0.25 >= 0.5
    assert block_coreset(probs, top_p=0.2, top_k=3).experts.tolist() == [0, 2, 3]  # extended to top_k
    assert block_coreset(probs, top_p=1.0, top_k=2).size == 6
    weights, experts = route_in_coreset(probs, 0.5, 2)
    assert experts.tolist() == [[0, 2], [2, 0]]                 # row 1's expert 3 (0.30) is outside C
    assert torch.allclose(weights, torch.tensor([[0.40, 0.20], [0.30, 0.20]]))


def test_one_row_and_top_p_one_are_per_row_routing() -> None:
    probs = torch.softmax(torch.randn(5, 16, generator=torch.Generator().manual_seed(0)), -1)
    per_row = probs.topk(8, dim=-1)
    for top_p in (1.0, 0.9, 0.5, 0.01):
        w, e = route_in_coreset(probs[:1], top_p, 8)
        assert torch.equal(e, per_row.indices[:1]) and torch.equal(w, per_row.values[:1])
    w, e = route_in_coreset(probs, 1.0, 8)
    assert torch.equal(e, per_row.indices) and torch.equal(w, per_row.values)


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.0001, math.nan, math.inf])
def test_top_p_outside_zero_one_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match=r"coreset_top_p must be in \(0, 1\]"):
        check_top_p(bad)


def test_near_ties_of_the_cut() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.2]])
    assert cut_is_near_tie(block_coreset(probs, 0.8, 1), 0.8, 1)            # 0.5 + 0.3 = 0.8 at the cut
    assert not cut_is_near_tie(block_coreset(probs, 0.7, 1), 0.7, 1)
    assert not cut_is_near_tie(block_coreset(probs, 0.5, 2), 0.5, 2)        # top_k decides, not the cut
    tied = torch.tensor([[0.4, 0.3, 0.3]])
    assert cut_is_near_tie(block_coreset(tied, 0.6, 1), 0.6, 1)             # experts 1 and 2 tie at the cut
    assert not cut_is_near_tie(block_coreset(tied, 1.0, 1), 1.0, 1)


def _window(model: Any, p: int = 9, b: int = 8) -> tuple[list[int], Any]:
    ids = np.random.default_rng(5).integers(0, 3000, size=p + b).tolist()
    history = model.new_history()
    model.forward_causal(ids[:p], history)
    return [ids[p]] + [MASK] * (b - 1), history


def test_top_p_one_equals_the_block_pass_without_a_coreset(tiny_model: Any) -> None:
    window, history = _window(tiny_model)
    plain = tiny_model.forward_block(window, history.clone())
    assert torch.equal(tiny_model.forward_block(window, history.clone(), coreset_top_p=1.0), plain)
    one = tiny_model.forward_block(window[:1], history.clone())
    assert torch.equal(tiny_model.forward_block(window[:1], history.clone(), coreset_top_p=0.3), one)


def test_a_cut_routes_every_row_inside_one_set(tiny_model: Any) -> None:
    """top_p = 0.5 on tiny (8 experts, top-2): each layer's rows use only the coreset's experts, the coreset
    is smaller than all 8 in some layer, and the block logits change; history is untouched."""
    window, history = _window(tiny_model)
    chosen: list[tuple[set[int], set[int]]] = []

    def record(module: Any, inputs: tuple[Any, ...], _output: Any) -> None:
        x, top_p = inputs
        coreset = set(block_coreset(module.router_probs(x), top_p, module.top_k).experts.tolist())
        chosen.append((coreset, set(module.route(x, top_p)[1].flatten().tolist())))

    handles = [layer.mlp.register_forward_hook(record) for layer in tiny_model.model.layers]
    try:
        cut = tiny_model.forward_block(window, history.clone(), coreset_top_p=0.5)
    finally:
        for h in handles:
            h.remove()
    assert len(chosen) == len(tiny_model.model.layers)
    assert all(used <= coreset for coreset, used in chosen)
    assert min(len(coreset) for coreset, _ in chosen) < 8
    assert not torch.equal(cut, tiny_model.forward_block(window, history.clone()))
    with pytest.raises(ValueError, match="coreset_top_p"):
        tiny_model.forward_block(window, history.clone(), coreset_top_p=0.0)


def test_the_reference_decoder_takes_a_top_p(tiny_model: Any) -> None:
    """Session.generate(coreset_top_p=): 1 is the default's output, a cut may change it, (0, 1] is enforced."""
    from clover_ref.decode import Session
    from clover_common.errors import BadInput

    prompt = np.random.default_rng(1).integers(0, 3000, size=12).tolist()

    def run(**kw: Any) -> list[int]:
        return Session(tiny_model, n_ctx=256).generate(prompt, mode="diffusion", max_new_tokens=16, **kw).tokens

    assert run(coreset_top_p=1.0) == run()
    assert len(run(coreset_top_p=0.5)) == 16
    session = Session(tiny_model, n_ctx=256)
    with pytest.raises(BadInput, match="coreset_top_p"):
        session.generate(prompt, mode="diffusion", coreset_top_p=1.5)
    assert session.position == 0  # refused before the prompt was prefilled
