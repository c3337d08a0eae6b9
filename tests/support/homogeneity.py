"""A two-sample test of homogeneity for sampled tokens, with its power stated: does a speculative configuration
emit the same distribution as plain decoding? (tests/native/test_draft_clover.py, tests/engine/test_auto.py)

Pearson's chi-square statistic over the tokens the two samples saw, those seen fewer than ``MIN_COUNT`` times in
both together merged into one category; its critical value at ``alpha`` by simulation from the pooled counts
(small expected counts make the chi-square table wrong); and the test's power against a shift of ``shift_tv`` in
total variation, by the same simulation: the lower of its power against two such shifts,
- that much of the pooled mass moved onto the least likely category (a verification that lets a wrong token
  through, e.g. one wrong draft kept in ten),
- that much moved from the most likely category to the second (a verification that leans towards a runner-up: between
  two large categories a shift is hardest for the statistic to see).

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
    power = min(float((np.array([chi2(rng.multinomial(int(a.sum()), pooled).astype(float),
                                      rng.multinomial(int(b.sum()), shifted).astype(float))
                                 for _ in range(1000)]) > critical).mean())
                for shifted in shifts(pooled, shift_tv))
    return Homogeneity(chi2(a, b), critical, power,
                       {c: (int(p), int(q)) for c, p, q in zip([*cats, -1], a, b)})  # -1: the rare ones


def shifts(pooled: np.ndarray, shift_tv: float) -> list[np.ndarray]:
    """The alternatives the power is taken against (module docstring): shift_tv of the mass onto the least likely
    category, and from the most likely to the second (as much as the most likely has)."""
    onto_rarest = (1 - shift_tv) * pooled
    onto_rarest[int(np.argmin(pooled))] += shift_tv
    if len(pooled) < 2:
        return [onto_rarest]
    order = np.argsort(-pooled, kind="stable")
    to_runner_up = pooled.copy()
    moved = min(shift_tv, float(pooled[order[0]]))
    to_runner_up[order[0]] -= moved
    to_runner_up[order[1]] += moved
    return [onto_rarest, to_runner_up]
