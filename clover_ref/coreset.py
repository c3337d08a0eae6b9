"""The block expert coreset of spec v2 section 3.3: a block pass routes every row of its window inside one
expert set per MoE layer.

1. Each row's router probabilities pi_i (softmax over all experts, as causal mode computes them).
2. Block mass m_e = mean over the window's rows of pi_i[e].
3. The coreset C: experts by decreasing m_e (ties to the lower id), the shortest prefix whose mass, summed in
   float32 in that order, is >= top_p, extended to at least top_k experts.
4. Row i takes its top_k experts within C by pi_i, weighted as causal mode weights its top-k.

top_p = 1 means every expert, with no cut computed (a float32 sum may never reach exactly 1): per-row
routing, exactly causal mode's choice. So is a window of one row, at any top_p. The release's exact rule is
not public ("a two-phase coreset"); this one is the spec's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def check_top_p(top_p: float) -> float:
    """``top_p`` as a float in (0, 1]; ValueError otherwise (spec 3.3 refuses anything else)."""
    value = float(top_p)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"coreset_top_p must be in (0, 1], got {top_p!r}")
    return value


@dataclass(frozen=True)
class Coreset:
    """One layer's coreset: ``experts`` (ids, in order of decreasing block mass); ``order``, ``mass`` and
    ``cumulative``: every expert in that order, its block mass and the float32 cumulative mass; ``cut``: the
    prefix length that top_p chose, before the extension to top_k (n_expert when top_p = 1)."""
    experts: torch.Tensor
    order: torch.Tensor
    mass: torch.Tensor
    cumulative: torch.Tensor
    cut: int

    @property
    def size(self) -> int:
        return int(self.experts.numel())

    def allowed(self, n_expert: int) -> torch.Tensor:
        """A [n_expert] bool mask of the coreset's experts."""
        mask = torch.zeros(n_expert, dtype=torch.bool)
        mask[self.experts] = True
        return mask


def _cuts(probs: torch.Tensor, top_p: float, top_k: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 2-3 for a batch of windows [N, W, n_expert] at once: per window, the experts by decreasing block mass
    (stable, so ties keep the lower id first), their masses, the float32 cumulative mass, the prefix length top_p
    chooses (n_expert at top_p = 1: no cut is computed) and the coreset's size (the cut extended to top_k)."""
    n_expert = probs.shape[-1]
    mass = probs.float().mean(-2)
    order = torch.sort(mass, dim=-1, descending=True, stable=True).indices
    sorted_mass = torch.gather(mass, -1, order)
    cumulative = torch.cumsum(sorted_mass, -1, dtype=torch.float32)
    reached = cumulative >= top_p
    if top_p >= 1.0:
        reached = torch.zeros_like(reached)
    cut = torch.where(reached.any(-1), reached.float().argmax(-1) + 1, torch.full_like(order[:, 0], n_expert))
    return order, sorted_mass, cumulative, cut, cut.clamp(min=top_k, max=n_expert)


def block_coreset(probs: torch.Tensor, top_p: float, top_k: int) -> Coreset:
    """The coreset of a window whose rows have router probabilities ``probs`` [W, n_expert]."""
    order, sorted_mass, cumulative, cut, size = (t[0] for t in _cuts(probs[None], check_top_p(top_p), top_k))
    return Coreset(order[:int(size)], order, sorted_mass, cumulative, int(cut))


def route_in_coreset(probs: torch.Tensor, top_p: float, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's top_k experts within its window's coreset, and their probabilities (not renormalised).

    ``probs`` is one window's rows [W, n_expert], or a batch of windows [N, W, n_expert] (one coreset per
    window; training uses this). Returns ([..., top_k] weights, [..., top_k] expert ids). top_p = 1 and
    one-row windows give per-row top-k. Differentiable in ``probs`` (only the choice of experts is not)."""
    if check_top_p(top_p) >= 1.0 or probs.shape[-2] == 1:
        return probs.topk(top_k, dim=-1)
    windows = probs.detach().reshape(-1, *probs.shape[-2:])
    order, _, _, _, size = _cuts(windows, top_p, top_k)
    in_sorted = torch.arange(probs.shape[-1], device=probs.device)[None, :] < size[:, None]
    allowed = torch.zeros_like(in_sorted).scatter(-1, order, in_sorted)  # [N, n_expert], in expert order
    _, experts = probs.masked_fill(~allowed.reshape(*probs.shape[:-2], 1, -1), -1.0).topk(top_k, dim=-1)
    return probs.gather(-1, experts), experts


CUT_NEAR_TIE = 1e-5


def cut_is_near_tie(coreset: Coreset, top_p: float, top_k: int, tol: float = CUT_NEAR_TIE) -> bool:
    """spec 3.3's near-tie of the cut, where another backend's rounding may pick another coreset: top_p
    decided the size and a cumulative mass next to the cut is within ``tol`` of top_p, or the last expert in
    C and the first one left out have block masses within ``tol``."""
    n = coreset.size
    if top_p >= 1.0 or n >= coreset.order.numel():
        return False
    cut, cumulative = coreset.cut, coreset.cumulative
    if cut >= top_k and abs(float(cumulative[cut - 1]) - top_p) < tol:  # rounded below: C grows by one
        return True
    if cut - 1 >= top_k and abs(float(cumulative[cut - 2]) - top_p) < tol:  # rounded above: C shrinks by one
        return True
    return abs(float(coreset.mass[n - 1]) - float(coreset.mass[n])) < tol
