"""Timing single native passes through clover_native.bindings, for the benches that price pass shapes
(bench_fused_pass, bench_verify_rows)."""

from __future__ import annotations

import statistics
import time
from typing import Callable, TypeVar

K = TypeVar("K")


def synthetic_tokens(n: int, start: int, step: int) -> list[int]:
    """n token ids spread over the demo vocabulary's first 3000 (no special token), reproducible."""
    return [t % 3000 + 1 for t in range(start, start + step * n, step)]


def interleaved_times(passes: dict[K, Callable[[], None]], reps: int) -> dict[K, dict[str, float]]:
    """{kind: {median, min}} in ms. Each pass runs once first (the first pass of a shape builds its graph), then
    the kinds take turns, repetition by repetition, so a slow spell on a shared machine touches each alike."""
    for fn in passes.values():
        fn()
    times: dict[K, list[float]] = {k: [] for k in passes}
    for _ in range(reps):
        for k, fn in passes.items():
            start = time.perf_counter()
            fn()
            times[k].append((time.perf_counter() - start) * 1e3)
    return {k: {"median": statistics.median(v), "min": min(v)} for k, v in times.items()}
