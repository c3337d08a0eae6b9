"""Block mode of the reference (spec section 3): history is read-only and the window is bidirectional."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from clover_ref.history import DeltaNetState
from clover_ref.model import CloverModel


def prefilled(model: CloverModel, length: int, seed: int = 0):
    history = model.new_history()
    ids = torch.randint(0, 3000, (length,), generator=torch.Generator().manual_seed(seed))
    model.forward_causal(ids, history)
    return history


def random_window(model: CloverModel, width: int, seed: int, masked_fraction: float = 0.5) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 3000, (width,), generator=gen)
    masked = torch.rand(width, generator=gen) < masked_fraction
    masked[0] = False  # the pending token is always known
    return torch.where(masked, torch.full_like(ids, model.config.mask_token_id), ids)


def test_block_passes_leave_history_bitwise_unchanged(tiny_model):
    history = prefilled(tiny_model, 13)
    before = history.clone()
    for seed in range(6):
        tiny_model.forward_block(random_window(tiny_model, 8, seed), history)
    assert history.equals(before)
    # A commit after block passes equals the same commit without them, bit for bit.
    untouched = before.clone()
    after_blocks = tiny_model.forward_causal([5, 6, 7], history)
    assert torch.equal(after_blocks, tiny_model.forward_causal([5, 6, 7], untouched))
    assert history.equals(untouched)


def test_window_is_bidirectional(tiny_model):
    history = prefilled(tiny_model, 5)
    window = random_window(tiny_model, 8, seed=1, masked_fraction=0.0)
    changed = window.clone()
    changed[-1] = (changed[-1] + 1) % 3000
    first = tiny_model.forward_block(window, history)
    second = tiny_model.forward_block(changed, history)
    assert not torch.equal(first[0], second[0]), "the first output must see the last window token"


def test_block_logits_depend_on_history(tiny_model):
    window = random_window(tiny_model, 8, seed=2)
    short, long = prefilled(tiny_model, 4, seed=3), prefilled(tiny_model, 4, seed=4)
    assert not torch.equal(tiny_model.forward_block(window, short), tiny_model.forward_block(window, long))


def test_right_conv_branch_reads_later_window_inputs_only_when_nonzero(tiny_model):
    layer = tiny_model.model.layers[0].linear_attn
    state = prefilled(tiny_model, 6).layers[0]
    mixed = torch.randn(8, layer.conv_dim, generator=torch.Generator().manual_seed(5))
    later = mixed.clone()
    later[5:] += 1.0  # change window inputs 5..7
    with_branch = layer.block_conv(mixed, state), layer.block_conv(later, state)
    assert not torch.equal(with_branch[0][:5], with_branch[1][:5]), "the right branch must read ahead"
    zeroed = copy.deepcopy(layer)
    zeroed.conv_right_weight.zero_()
    without = zeroed.block_conv(mixed, state), zeroed.block_conv(later, state)
    assert torch.equal(without[0][:5], without[1][:5]), "with the branch at zero the conv is causal"
    assert not torch.equal(without[0][5:], without[1][5:])


def test_history_unit_at_minus_infinity_ignores_the_delta_rule_state(tiny_model):
    history = prefilled(tiny_model, 9)
    other = history.clone()
    gen = torch.Generator().manual_seed(6)
    for state in other.layers:
        if isinstance(state, DeltaNetState):
            state.ssm = torch.randn(state.ssm.shape, generator=gen)
    window = random_window(tiny_model, 8, seed=7)
    assert not torch.equal(tiny_model.forward_block(window, history), tiny_model.forward_block(window, other))
    cut = copy.deepcopy(tiny_model)
    for layer in cut.model.layers:
        if layer.is_linear:
            layer.linear_attn.bd_softmax_history_bias.fill_(float("-inf"))
    assert torch.equal(cut.forward_block(window, history), cut.forward_block(window, other))


def test_right_conv_has_kernel_minus_one_taps(tiny_model):
    """spec 2.3: K_r = linear_conv_kernel_dim - 1; the last window row reads nothing to its right."""
    layer = tiny_model.model.layers[0].linear_attn
    assert layer.conv_right_weight.shape == (layer.conv_dim, layer.kernel - 1) == (layer.conv_dim, 3)
    state = prefilled(tiny_model, 6).layers[0]
    mixed = torch.randn(8, layer.conv_dim, generator=torch.Generator().manual_seed(9))
    later = mixed.clone()
    later[7] += 1.0
    a, b = layer.block_conv(mixed, state), layer.block_conv(later, state)
    assert torch.equal(a[:4], b[:4]), "row i reads at most 3 rows ahead"
    assert not torch.equal(a[4], b[4])


@pytest.mark.parametrize("width", [1, 4, 8, 32])
def test_history_slot_logit_is_the_same_for_every_row(tiny_model, width):
    """spec 3.2 step 5: l_iH = bias + c ln(W / history_rows), independent of the row and of q."""
    layer = tiny_model.model.layers[0].linear_attn
    want = layer.bd_softmax_history_bias + layer.bd_softmax_history_c * math.log(width / 32)
    assert torch.allclose(layer.history_logit(width), want)


def test_history_c_matters_only_below_history_rows(tiny_model):
    """Changing bd_softmax_history_c changes nothing at W = history_rows and changes block logits below it."""
    history = prefilled(tiny_model, 5)
    changed = copy.deepcopy(tiny_model)
    for layer in changed.model.layers:
        if layer.is_linear:
            layer.linear_attn.bd_softmax_history_c.add_(1.5)
    rows = tiny_model.config.history_rows
    full = random_window(tiny_model, rows, seed=10)
    assert torch.equal(tiny_model.forward_block(full, history), changed.forward_block(full, history))
    short = random_window(tiny_model, 8, seed=11)
    assert not torch.allclose(tiny_model.forward_block(short, history), changed.forward_block(short, history))


def test_rows_select_outputs_without_changing_them(tiny_model):
    history = prefilled(tiny_model, 7)
    window = random_window(tiny_model, 8, seed=8)
    full = tiny_model.forward_block(window, history)
    assert torch.allclose(tiny_model.forward_block(window, history, rows=[1, 4, 7]), full[[1, 4, 7]], atol=1e-6)


def test_block_pass_on_empty_history(tiny_model):
    logits = tiny_model.forward_block(random_window(tiny_model, 8, seed=9), tiny_model.new_history())
    assert logits.shape == (8, tiny_model.config.vocab_size) and torch.isfinite(logits).all()
