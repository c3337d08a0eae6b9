"""The decoders of spec section 4 in the reference: LowConfidence rules, end rules, spec == ar.

Rule tests drive the decoders with a scripted model whose logits are chosen by the test, so each rule is
checked in isolation; behaviour tests run the real `tiny` model.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Callable

import numpy as np
import pytest
import torch

from clover_ref.decode import Session, generate
from clover_ref.factory import preset_config, random_model
from clover_ref.history import History
from clover_ref.sampling import Sampler, SamplingParams

VOCAB = 3072
EOS = 3002
MASK = 3007


class ScriptedModel:
    """Stands in for CloverModel in rule tests: logits come from test-supplied functions.

    block(position, window, target) -> logits of the target p+1+target; causal(position, token) -> logits
    of the position after ``token``. Every block window is recorded.
    """

    def __init__(self, block: Callable[[int, list[int], int], torch.Tensor],
                 causal: Callable[[int, int], torch.Tensor] | None = None) -> None:
        self.config = preset_config("tiny")
        self.block, self.causal = block, causal or (lambda position, token: peaked(7))
        self.windows: list[list[int]] = []

    def new_history(self) -> History:
        return History(0, [])

    def forward_causal(self, ids, history: History) -> torch.Tensor:
        rows = []
        for token in torch.as_tensor(ids).reshape(-1).tolist():
            rows.append(self.causal(history.length, token))
            history.length += 1
        return torch.stack(rows)

    def forward_block(self, window, history: History, rows=None, coreset_top_p: float = 1.0) -> torch.Tensor:
        assert coreset_top_p == 1.0, "the scripted model has no experts"
        window = torch.as_tensor(window).tolist()
        self.windows.append(window)
        targets = range(len(window)) if rows is None else rows
        return torch.stack([self.block(history.length, window, j) for j in targets])


def peaked(token: int, logit: float = 10.0) -> torch.Tensor:
    row = torch.zeros(VOCAB)
    row[token] = logit
    return row


def confidence_of(row: torch.Tensor) -> float:
    return float(Sampler(VOCAB, [MASK], SamplingParams()).probabilities(row).max())


def test_threshold_is_strict():
    row = peaked(7, 5.0)
    c = np.float32(confidence_of(row))
    at = Session(ScriptedModel(lambda p, w, j: row)).generate([1, 2], threshold=float(c), block_size=8,
                                                               max_new_tokens=8)
    assert at.stats.steps_per_block == [8], "confidence equal to the threshold must not fill"
    below = float(np.nextafter(c, np.float32(0)))
    under = Session(ScriptedModel(lambda p, w, j: row)).generate([1, 2], threshold=below, block_size=8,
                                                                 max_new_tokens=8)
    assert under.stats.steps_per_block == [1] and under.tokens == [7] * 8


def test_single_fill_fallback_prefers_lowest_position_on_ties():
    model = ScriptedModel(lambda p, w, j: peaked(7, 1.0))
    Session(model).generate([1, 2], threshold=0.99, block_size=4, max_new_tokens=4)
    assert model.windows[1] == [2, 7, MASK, MASK], "first fill goes to the lowest tied position"


def test_single_fill_fallback_takes_the_most_confident_target():
    model = ScriptedModel(lambda p, w, j: peaked(7, 3.0 if j == 2 else 1.0))
    Session(model).generate([1, 2], threshold=0.99, block_size=4, max_new_tokens=4)
    assert model.windows[1] == [2, MASK, MASK, 7]


def test_block_pass_asks_only_for_masked_targets():
    model = ScriptedModel(lambda p, w, j: peaked(7, 1.0))
    asked: list[list[int]] = []
    inner = model.forward_block
    model.forward_block = lambda window, history, rows=None, **kw: (asked.append(list(rows)),
                                                                    inner(window, history, rows, **kw))[1]
    Session(model).generate([1, 2], threshold=0.99, block_size=4, max_new_tokens=4)
    assert asked == [[0, 1, 2, 3], [1, 2, 3], [2, 3], [3]]


@pytest.mark.parametrize("mode", ["ar", "diffusion", "spec"])
def test_mask_token_is_never_proposed(mode):
    def row(*_):
        r = peaked(MASK, 20.0)
        r[11] = 5.0
        return r

    result = Session(ScriptedModel(lambda p, w, j: row(), lambda p, t: row())).generate(
        [1, 2], mode=mode, block_size=4, max_new_tokens=8, threshold=0.5)
    assert result.tokens == [11] * 8


def test_eos_cuts_the_block_and_becomes_the_seed():
    # Target 3 of the first block (absolute position p + 3) is end-of-generation.
    def block(p, window, j):
        return peaked(EOS if j == 2 else 7)

    session = Session(ScriptedModel(block))
    result = session.generate([1, 2, 3], block_size=8, threshold=0.5, max_new_tokens=64)
    p = 2  # the pending token's position
    assert result.tokens == [7, 7]
    assert result.stats.stop_reason == "eos"
    assert session.pending == EOS and session.history.length == p + 3  # committed through p+2
    assert result.stats.steps_per_block == [1]


def test_eos_waits_for_every_earlier_target():
    # Step 1 fills only the EOS at target 3; the targets before it are filled one per step afterwards.
    def block(p, window, j):
        return peaked(EOS, 12.0) if j == 2 else peaked(7, 1.0)

    result = Session(ScriptedModel(block)).generate([1, 2], block_size=8, threshold=0.5, max_new_tokens=64)
    assert result.tokens == [7, 7] and result.stats.steps_per_block == [3]


def test_max_tokens_cuts_mid_block_without_further_passes():
    model = ScriptedModel(lambda p, w, j: peaked(7, 1.0))
    result = Session(model).generate([1, 2], block_size=8, threshold=0.99, max_new_tokens=3)
    assert result.tokens == [7, 7, 7] and result.stats.steps_per_block == [3]


def test_context_end_shrinks_the_last_block():
    session = Session(ScriptedModel(lambda p, w, j: peaked(7)), n_ctx=12)
    result = session.generate([1, 2, 3], block_size=8, threshold=0.5, max_new_tokens=64)
    assert len(model_windows := session.model.windows) == 2 and len(model_windows[1]) == 12 - 10
    assert result.tokens == [7] * 10 and result.stats.stop_reason == "context"


def test_empty_prompt_is_an_error(tiny_model):
    with pytest.raises(ValueError, match="empty"):
        generate(tiny_model, [], mode="diffusion")


# ----- the real tiny model -----

@pytest.mark.parametrize("mode", ["ar", "diffusion", "spec"])
def test_output_with_max_tokens_n_is_a_prefix_of_the_longer_output(tiny_model, mode):
    prompt = [17, 400, 1200, 9]
    longer = generate(tiny_model, prompt, mode=mode, block_size=4, threshold=0.005, max_new_tokens=24).tokens
    for n in (1, 3, 5, 6):
        assert generate(tiny_model, prompt, mode=mode, block_size=4, threshold=0.005,
                        max_new_tokens=n).tokens == longer[:n]


def test_threshold_one_fills_exactly_one_position_per_step(tiny_model):
    result = generate(tiny_model, [5, 6, 7], mode="diffusion", block_size=8, threshold=1.0, max_new_tokens=16)
    assert result.stats.steps_per_block == [8, 8] and len(result.tokens) == 16


def test_threshold_zero_fills_the_block_in_one_step(tiny_model):
    result = generate(tiny_model, [5, 6, 7], mode="diffusion", block_size=8, threshold=0.0, max_new_tokens=16)
    assert result.stats.steps_per_block == [1, 1]


def test_steps_per_block_never_exceed_the_block_size(tiny_model):
    rng = random.Random(0)
    for _ in range(6):
        b = rng.choice([2, 4, 8])
        result = generate(tiny_model, [rng.randrange(3000) for _ in range(rng.randint(1, 12))], mode="diffusion",
                          block_size=b, threshold=rng.choice([0.0, 0.002, 0.01, 0.5]), max_new_tokens=12)
        assert all(1 <= s <= b for s in result.stats.steps_per_block)


def test_spec_equals_greedy_ar_in_50_random_cases(tiny_model):
    second = random_model(tiny_model.config, seed=1)
    rng = random.Random(1234)
    for case in range(50):
        model = tiny_model if case % 2 == 0 else second
        prompt = [rng.randrange(3000) for _ in range(rng.randint(1, 20))]
        b, steps = rng.choice([1, 2, 3, 4, 8, 16]), rng.choice([0, 0, 1, 2])
        ar = generate(model, prompt, mode="ar", max_new_tokens=16).tokens
        spec = generate(model, prompt, mode="spec", block_size=b, draft_steps=steps, threshold=0.005,
                        max_new_tokens=16).tokens
        assert spec == ar, f"case {case}: B={b}, draft_steps={steps}, prompt={prompt}"


@pytest.mark.parametrize("mode", ["ar", "diffusion", "spec"])
def test_second_turn_on_retained_history_equals_a_fresh_prefill(tiny_model, mode):
    options = dict(mode=mode, block_size=4, threshold=0.005, max_new_tokens=7)
    first_prompt, second_prompt = [11, 12, 13, 14], [15, 16, 17]
    session = Session(tiny_model)
    first = session.generate(first_prompt, **options).tokens
    second = session.generate(second_prompt, **options).tokens
    fresh = generate(tiny_model, first_prompt + first + second_prompt, **options).tokens
    assert second == fresh


def test_spec_sampling_keeps_the_ar_distribution():
    """Speculative-sampling acceptance is lossless: the first two tokens follow ar's distribution."""
    table = torch.full((VOCAB, VOCAB), -30.0)
    probs = {1: [0.5, 0.3, 0.2], 2: [0.2, 0.2, 0.6], 3: [0.1, 0.6, 0.3], 9: [0.4, 0.4, 0.2]}
    for prev, p in probs.items():
        table[prev, 1:4] = torch.log(torch.tensor(p))

    def causal(position, token):
        return table[token]

    def block(position, window, j):
        return peaked(1)  # drafts are always token 1: accepted with probability Q(1)

    def first_two(mode: str, seed: int) -> tuple[int, ...]:
        model = ScriptedModel(block, causal)
        return tuple(Session(model).generate([9], mode=mode, block_size=4, temperature=1.0, seed=seed,
                                             max_new_tokens=2).tokens)

    n = 2000
    ar = Counter(first_two("ar", s) for s in range(n))
    spec = Counter(first_two("spec", s) for s in range(n))
    for outcome in set(ar) | set(spec):
        expected = probs[9][outcome[0] - 1] * probs[outcome[0]][outcome[1] - 1]
        for counts in (ar, spec):
            sigma = (expected * (1 - expected) / n) ** 0.5
            assert abs(counts[outcome] / n - expected) < 5 * sigma, (outcome, counts[outcome] / n, expected)
