"""The reference's emulated GPU arithmetic (clover_ref.precision; docs/native.md, "CUDA parity")."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from clover_ref import precision


def test_tf32_casts_keep_ten_mantissa_bits() -> None:
    ulp = 2.0 ** -10  # TF32's spacing just above 1
    x = torch.tensor([1.0 + ulp / 2 - 2.0 ** -20, 1.0 + ulp / 2, 1.0 + ulp * 0.99, -(1.0 + ulp * 0.75), 3.0])
    assert precision.tf32_truncate(x).tolist() == [1.0, 1.0, 1.0, -1.0, 3.0]
    assert precision.tf32_round(x).tolist() == [1.0, 1.0 + ulp, 1.0 + ulp, -(1.0 + ulp), 3.0]


def test_ubatch_rows_split_a_pass_like_the_native_context() -> None:
    with precision.emulate(precision.HOPPER.but(ubatch=64)):
        assert [precision.ubatch_rows(300, i) for i in (0, 63, 64, 255, 256, 299)] == [64, 64, 64, 64, 44, 44]
        assert precision.ubatch_rows(7, 3) == 7


def _causal(model: Any, ids: list[int]) -> np.ndarray:
    return model.forward_causal(ids, model.new_history()).numpy()


def test_exact_preset_changes_nothing(tiny_model: Any) -> None:
    ids = list(range(5, 25))
    plain = _causal(tiny_model, ids)
    with precision.emulate(precision.EXACT):
        np.testing.assert_array_equal(_causal(tiny_model, ids), plain)


def test_experts_take_tf32_even_for_one_token(tiny_model: Any) -> None:
    """mmf serves F32 mul_mat_id at every batch size, so a single-token pass already moves."""
    exact = _causal(tiny_model, [2938])
    with precision.emulate(precision.PRESETS["experts-tf32"]):
        assert np.abs(_causal(tiny_model, [2938]) - exact).max() > 1e-4
    with precision.emulate(precision.EXACT.but(dense_tf32=True)):  # dense: mmvf, exact f32 up to 3 rows
        np.testing.assert_array_equal(_causal(tiny_model, [2938]), exact)


def test_hopper_arithmetic_moves_tiny_logits_beyond_the_parity_tolerance(tiny_model: Any) -> None:
    """At 7 tokens, TF32 in the expert mat-muls alone moves the tiny model's logits by more than the native
    tests' tolerance; f16 keys and values do not."""
    ids = np.random.default_rng(1234).integers(0, 3000, size=7).tolist()
    exact = _causal(tiny_model, ids)
    tol = 1e-3 * max(1.0, float(np.abs(exact).max()))
    with precision.emulate(precision.PRESETS["kv-f16"]):
        assert np.abs(_causal(tiny_model, ids) - exact).max() < tol
    with precision.emulate(precision.PRESETS["experts-tf32"]):
        assert np.abs(_causal(tiny_model, ids) - exact).max() > tol
    with precision.emulate(precision.HOPPER):
        hopper = np.abs(_causal(tiny_model, ids) - exact).max()
    assert hopper > tol
    assert precision.active() is precision.EXACT  # the context manager restores the default
