"""The demo-model training objective: its windows, its learning signal, its determinism, and the self-
generated pool. (The 30-minute run itself is not a test; models/clover-demo/README.md records it.)"""

from __future__ import annotations

import numpy as np
import torch

import clover_ref.train as train
from clover_ref.factory import random_model
from clover_ref.windowed import CHUNK


def small_model():
    config = train.demo_config()
    model = random_model(config, seed=0)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(0.05)
        model.lm_head.weight.mul_(0.5)
    return model.requires_grad_(True)


def test_window_starts_cover_the_sequence_on_the_chunk_grid():
    for block in train.TRAIN_BLOCK_SIZES:
        starts = train.window_starts(128, block)
        assert starts[0] == CHUNK and all(p % CHUNK == 0 for p in starts)
        assert all(b - a >= block for a, b in zip(starts, starts[1:]))
        assert starts[-1] + block <= 127  # the last target p+B is inside the sequence
    assert train.window_starts(128, 8, first=64) == [64, 72, 80, 88, 96, 104, 112]


def test_window_masks_scatter_or_mask_a_suffix():
    rng = np.random.default_rng(0)
    suffix = train.window_masks(2000, 16, 1.0, rng).numpy()
    scattered = train.window_masks(2000, 16, 0.0, rng).numpy()
    mixed = train.window_masks(2000, 16, 0.5, rng).numpy()
    assert suffix.shape == scattered.shape == (2000, 15)
    is_suffix = lambda masks: np.all(np.diff(masks.astype(int), axis=1) >= 0, axis=1)  # noqa: E731
    assert is_suffix(suffix).all()
    assert is_suffix(scattered).mean() < 0.3  # only the near-empty and near-full draws
    assert 0.4 < is_suffix(mixed).mean() < 0.75
    # Both at a ratio r drawn from U(0.05, 1), mean 0.525; a suffix masks ceil(15 r) inputs, half a token more.
    assert abs(scattered.mean() - 0.525) < 0.02, scattered.mean()
    assert abs(suffix.mean() - (0.525 + 0.5 / 15)) < 0.02, suffix.mean()


def _run(steps: int, seed: int, stream: np.ndarray) -> list[tuple[float, float, float]]:
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = small_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    pool = train.SelfGeneratedPool(sequences=8, prompt=16, continuation=16)
    losses = []
    for step in range(steps):
        causal, block = train.joint_loss(model, train.sample_batch(stream, 2, 32, rng), rng)
        if step % 4 == 0:
            pool.refresh(model, stream, rng)
        self_block = pool.loss(model, 2, rng)
        optimizer.zero_grad()
        (causal + block + self_block).backward()
        optimizer.step()
        losses.append((causal.item(), block.item(), self_block.item()))
    return losses


def test_the_joint_objective_learns_and_is_deterministic():
    # A corpus of one repeated 24-token phrase: both modes should quickly learn to continue it.
    phrase = np.random.default_rng(5).integers(0, 3000, 24)
    stream = np.tile(phrase, 200)
    first = _run(16, seed=0, stream=stream)
    again = _run(16, seed=0, stream=stream)
    assert first == again
    start, end = np.mean(first[:3], axis=0), np.mean(first[-3:], axis=0)
    assert end[0] < 0.5 * start[0] and end[1] < 0.5 * start[1], (start, end)


def test_the_pool_continues_prompts_with_greedy_ar():
    from clover_ref.decode import generate

    model = small_model().requires_grad_(False)
    stream = np.random.default_rng(6).integers(0, 3000, 1000)
    pool = train.SelfGeneratedPool(sequences=2, prompt=16, continuation=8)
    pool.refresh(model, stream, np.random.default_rng(0))
    assert pool.ids.shape == (2, 24)
    for row in pool.ids:
        prompt = row[:16].tolist()
        assert generate(model, prompt, mode="ar", max_new_tokens=8, stop_ids=[]).tokens == row[16:].tolist()
