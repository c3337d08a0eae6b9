"""Target distributions, token choice and confidence (spec section 4, "Distributions and confidence")."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from clover_common.config_numbers import I32_MAX
from clover_common.errors import BadInput
from clover_common.long_numbers import shown


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k cut
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        """Refuse, as BadInput naming the setting, what the sampler cannot use (torch's generator takes a seed
        of at most 64 bits)."""
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise BadInput(f"temperature must be a finite number >= 0, got {shown(self.temperature)}")
        if not 0 <= self.top_k <= I32_MAX:
            raise BadInput(f"top_k must be an integer in 0 .. {I32_MAX}, got {shown(self.top_k)}")
        if not 0.0 < self.top_p <= 1.0:
            raise BadInput(f"top_p must be in (0, 1], got {shown(self.top_p)}")
        if not 0 <= self.seed < 2**63:
            raise BadInput(f"seed must be an integer in 0 .. {2**63 - 1}, got {shown(self.seed)}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class Sampler:
    """Turns one row of logits into a token and its confidence.

    P is the temperature-1 softmax of the float32 logits with the mask token and banned tokens at -inf.
    Greedy picks argmax P (ties to the lowest id). Sampling draws from Q: P after temperature, then top-k,
    then top-p. Confidence is always P(token).
    """

    def __init__(self, vocab_size: int, excluded_ids: list[int], params: SamplingParams) -> None:
        self.params = params
        self.excluded = torch.zeros(vocab_size, dtype=torch.bool)
        self.excluded[torch.as_tensor(sorted(set(excluded_ids)), dtype=torch.long)] = True
        self.generator = torch.Generator().manual_seed(params.seed)

    def masked_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.to(torch.float32).masked_fill(self.excluded, float("-inf"))

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """P: the temperature-1 distribution."""
        return self.masked_logits(logits).softmax(-1)

    def sampling_distribution(self, logits: torch.Tensor) -> torch.Tensor:
        """Q: the distribution a sampled token is drawn from (a point mass on argmax P when greedy)."""
        masked = self.masked_logits(logits)
        if self.params.greedy:
            q = torch.zeros_like(masked)
            q[int(torch.argmax(masked))] = 1.0
            return q
        q = (masked / self.params.temperature).softmax(-1)
        if self.params.top_k > 0:
            k = min(self.params.top_k, q.numel())
            cutoff = torch.topk(q, k).values[-1]
            q = torch.where(q >= cutoff, q, torch.zeros_like(q))
            q = q / q.sum()
        if self.params.top_p < 1.0:
            order = torch.argsort(q, descending=True, stable=True)
            sorted_q = q[order]
            before = torch.cumsum(sorted_q, 0) - sorted_q  # mass strictly before each entry
            keep = before < self.params.top_p
            kept = torch.zeros_like(q)
            kept[order[keep]] = sorted_q[keep]
            q = kept / kept.sum()
        return q

    def draw(self, q: torch.Tensor) -> int:
        return int(torch.multinomial(q, 1, generator=self.generator))

    def uniform(self) -> float:
        return float(torch.rand((), generator=self.generator))

    def choose(self, logits: torch.Tensor) -> tuple[int, float]:
        """The token for one target and its confidence P(token)."""
        p = self.probabilities(logits)
        if self.params.greedy:
            token = int(torch.argmax(p))
        else:
            token = self.draw(self.sampling_distribution(logits))
        return token, float(p[token])

    def argmax(self, logits: torch.Tensor) -> int:
        return int(torch.argmax(self.masked_logits(logits)))
