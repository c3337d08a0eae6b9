"""A two-sample test of homogeneity for sampled tokens, with its power stated: does a speculative configuration
emit the same distribution as plain decoding? (tests/native/test_draft_clover.py, tests/engine/test_auto.py)

Pearson's chi-square statistic over the tokens the two samples saw, those seen fewer than ``MIN_COUNT`` times in
both together merged into one category; its critical value at ``alpha`` by simulation from the pooled counts
(small expected counts make the chi-square table wrong); and the test's power against a shift of ``shift_tv`` in
total variation (that much of the pooled mass moved onto its least likely category, e.g. a verification that kept
one wrong draft in ten), by the same simulation.

The merge is what keeps the simulation honest. A model's distribution has a long tail of tokens each drawn once
or never; a simulation from the pooled counts knows only the tail tokens that were drawn, so it draws fewer
one-off tokens than real samples hold, and each one-off adds about 1 to the statistic: the critical value came
out too low (two samples of 1500 from plain decoding with different seeds exceeded it at alpha 1e-3).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN_COUNT = 10  # tokens seen fewer times than this in both samples together are one category


def chi2(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson's statistic of homogeneity of two count vectors over the same categories."""
    total = a + b
    keep = total > 0
    a, b, total = a[keep], b[keep], total[keep]
    n_a, n_b = a.sum(), b.sum()
    e_a, e_b = total * n_a / (n_a + n_b), total * n_b / (n_a + n_b)
    return float(((a - e_a) ** 2 / e_a).sum() + ((b - e_b) ** 2 / e_b).sum())


@dataclass
class Homogeneity:
    observed: float
    critical: float
    power: float
    counts: dict[int, tuple[int, int]]

    def assert_same(self, power: float) -> None:
        """The test is strong enough (power at least ``power``) and finds no difference."""
        assert self.power >= power, f"the test's power is only {self.power:.2f}"
        assert self.observed <= self.critical, (f"chi-square {self.observed:.1f} > critical {self.critical:.1f}: "
                                                f"{self.counts}")


def homogeneity(x: list[int], y: list[int], alpha: float, shift_tv: float, seed: int = 0) -> Homogeneity:
    """Samples x and y (token ids) against each other: the statistic, its critical value at alpha and the power
    against a shift of shift_tv."""
    seen = sorted(set(x) | set(y))
    cats = [c for c in seen if x.count(c) + y.count(c) >= MIN_COUNT]
    rare = set(seen) - set(cats)
    a = np.array([x.count(c) for c in cats] + [sum(t in rare for t in x)], dtype=float)
    b = np.array([y.count(c) for c in cats] + [sum(t in rare for t in y)], dtype=float)
    rng = np.random.default_rng(seed)
    pooled = (a + b) / (a + b).sum()
    null = np.array([chi2(rng.multinomial(int(a.sum()), pooled).astype(float),
                          rng.multinomial(int(b.sum()), pooled).astype(float)) for _ in range(4000)])
    critical = float(np.quantile(null, 1 - alpha))
    shifted = (1 - shift_tv) * pooled
    shifted[int(np.argmin(pooled))] += shift_tv
    alt = np.array([chi2(rng.multinomial(int(a.sum()), pooled).astype(float),
                         rng.multinomial(int(b.sum()), shifted).astype(float)) for _ in range(1000)])
    return Homogeneity(chi2(a, b), critical, float((alt > critical).mean()),
                       {c: (int(p), int(q)) for c, p, q in zip([*cats, -1], a, b)})  # -1: the rare ones
