"""The decoders of spec section 4: ``ar``, LowConfidence block ``diffusion`` and self-speculative ``spec``.

A ``Session`` keeps the committed history and the pending token between turns, so a chat continues without a new
prefill. ``generate`` is the one-shot form.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from .coreset import check_top_p
from clover_common.config_numbers import MAX_BLOCK_SIZE
from clover_common.errors import BadInput
from clover_common.long_numbers import shown
from clover_common.generate_output import RunStats
from .model import CloverModel
from .sampling import Sampler, SamplingParams

MODES = ("ar", "diffusion", "spec")


@dataclass
class GenerationStats(RunStats):
    prefill_passes: int = 0
    steps_per_block: list[int] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)
    stop_reason: str = ""
    prefill_ms: float = 0.0  # wall time of the prompt's causal pass
    decode_ms: float = 0.0   # wall time from the end of the prefill to the last token

    def to_dict(self) -> dict:
        return {
            "mode": self.mode, "block_size": self.block_size, "threshold": self.threshold,
            "prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens,
            "prefill_passes": self.prefill_passes, "block_passes": self.block_passes,
            "causal_passes": self.causal_passes, "tokens_per_pass": self.tokens_per_pass,
            "steps_per_block": list(self.steps_per_block), "accepted_lengths": list(self.accepted_lengths),
            "stop_reason": self.stop_reason,
        }


@dataclass
class GenerationResult:
    tokens: list[int]
    stats: GenerationStats


@dataclass
class _Run:
    """The settings and the growing output of one ``generate`` call."""

    budget: int
    block_size: int
    threshold: float
    draft_steps: int
    sampler: Sampler
    stops: set[int]
    stats: GenerationStats
    on_block: Callable[[list[int]], None] | None
    coreset_top_p: float = 1.0  # block passes only (spec 3.3); 1 is per-row routing
    tokens: list[int] = field(default_factory=list)

    @property
    def remaining(self) -> int:
        return self.budget - len(self.tokens)

    def emit(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)
        if self.on_block and tokens:
            self.on_block(tokens)


class Session:
    """One sequence's committed history plus its pending token: the last known token, not yet committed (the
    spec's "seed"; ``seed`` arguments are only the sampler's RNG seed)."""

    def __init__(self, model: CloverModel, n_ctx: int | None = None) -> None:
        self.model = model
        self.config = model.config
        self.n_ctx = n_ctx or self.config.max_position_embeddings
        self.history = model.new_history()
        self.pending: int | None = None

    @property
    def position(self) -> int:
        """The pending token's position."""
        return self.history.length

    def append_prompt(self, prompt_ids: list[int]) -> int:
        """Prefill (or continue) with a prompt: causal pass over [old pending token, prompt[:-1]]; returns the
        passes run."""
        if not prompt_ids:
            raise BadInput("the prompt is empty; at least one token is needed (the last one is the pending token)")
        inputs = ([] if self.pending is None else [self.pending]) + list(prompt_ids[:-1])
        if self.history.length + len(inputs) + 1 > self.n_ctx:
            raise BadInput(f"the prompt needs {self.history.length + len(inputs) + 1} positions, "
                           f"more than the context size {self.n_ctx}")
        if inputs:
            self.model.forward_causal(inputs, self.history)
        self.pending = prompt_ids[-1]
        return 1 if inputs else 0

    def commit(self, tokens: list[int]) -> None:
        """Causal pass over [pending, tokens[:-1]]; tokens[-1] becomes the pending token."""
        assert self.pending is not None and tokens
        self.model.forward_causal([self.pending] + tokens[:-1], self.history)
        self.pending = tokens[-1]

    def generate(
        self,
        prompt_ids: list[int],
        mode: str = "diffusion",
        block_size: int | None = None,
        threshold: float | None = None,
        draft_steps: int = 0,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_ids: list[int] | None = None,
        banned_ids: list[int] | None = None,
        on_block: Callable[[list[int]], None] | None = None,
        coreset_top_p: float | None = None,
    ) -> GenerationResult:
        if mode not in MODES:
            raise BadInput(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        block_size, threshold = self.resolve_block(block_size, threshold)
        if draft_steps and temperature > 0:
            raise BadInput("draft_steps applies to greedy decoding only (temperature 0)")
        if coreset_top_p is None:  # the model's trained value (spec 3.3; config.json's coreset_top_p)
            coreset_top_p = self.config.coreset_top_p
        try:
            check_top_p(coreset_top_p)
        except ValueError as exc:
            raise BadInput(str(exc)) from None
        params = SamplingParams(temperature, top_k, top_p, seed)
        excluded = [self.config.mask_token_id] + list(banned_ids or [])
        sampler = Sampler(self.config.vocab_size, excluded, params)
        stops = set(self.config.eos_token_ids if stop_ids is None else stop_ids)
        stats = GenerationStats(mode, block_size, threshold, prompt_tokens=len(prompt_ids))
        start = time.perf_counter()
        stats.prefill_passes = self.append_prompt(prompt_ids)
        prefilled = time.perf_counter()
        run = _Run(max_new_tokens, block_size, threshold, draft_steps, sampler, stops, stats, on_block,
                   coreset_top_p)
        {"ar": self._ar, "diffusion": self._diffusion, "spec": self._spec}[mode](run)
        stats.prefill_ms = (prefilled - start) * 1e3
        stats.decode_ms = (time.perf_counter() - prefilled) * 1e3
        stats.generated_tokens = len(run.tokens)
        return GenerationResult(run.tokens, stats)

    def resolve_block(self, block_size: int | None, threshold: float | None) -> tuple[int, float]:
        """Spec 4.3: default B and the calibrated threshold for B (float32)."""
        b = block_size or self.config.block_size
        if not 1 <= b <= MAX_BLOCK_SIZE:
            raise BadInput(f"block size must be in 1 .. {MAX_BLOCK_SIZE}, got {shown(b)}")
        if threshold is not None and not 0.0 <= threshold <= 1.0:  # NaN too
            raise BadInput(f"threshold must be in [0, 1], got {shown(threshold)}")
        if threshold is None:
            threshold = self.config.threshold_for(b)
            if threshold is None:
                warnings.warn(f"block size {b} is not among the calibrated sizes "
                              f"{self.config.calibrated_block_sizes}; using the default threshold")
                threshold = self.config.confidence_threshold
        return b, float(np.float32(threshold))

    # ----- ar -----
    def _ar(self, run: _Run) -> None:
        while run.remaining > 0:
            if self.position >= self.n_ctx:
                run.stats.stop_reason = "context"
                return
            logits = self.model.forward_causal([self.pending], self.history)[0]
            run.stats.causal_passes += 1
            token, _ = run.sampler.choose(logits)
            self.pending = token
            if token in run.stops:
                run.stats.stop_reason = "eos"
                return
            run.emit([token])
        run.stats.stop_reason = "length"

    # ----- LowConfidence steps shared by diffusion and spec drafts -----
    def _step(self, canvas: list[int | None], run: _Run) -> None:
        """One block pass; fill every masked target above the threshold, or the single most confident one."""
        masked = [j for j, token in enumerate(canvas) if token is None]
        logits = self.model.forward_block(self._window(canvas), self.history, rows=masked,
                                          coreset_top_p=run.coreset_top_p)
        run.stats.block_passes += 1
        choices = [run.sampler.choose(row) for row in logits]
        threshold = np.float32(run.threshold)
        chosen = [j for j, (_, conf) in zip(masked, choices) if np.float32(conf) > threshold]
        if not chosen:
            best = max(range(len(masked)), key=lambda i: (np.float32(choices[i][1]), -masked[i]))
            chosen = [masked[best]]
        for j, (token, _) in zip(masked, choices):
            if j in chosen:
                canvas[j] = token

    def _window(self, canvas: list[int | None]) -> list[int]:
        mask = self.config.mask_token_id
        return [self.pending] + [mask if token is None else token for token in canvas[:-1]]

    def _block_width(self, run: _Run) -> int:
        """B, or what is left of the context (spec 4.1, context end); 0 ends generation."""
        width = min(run.block_size, self.n_ctx - self.position)
        if width < 1:
            run.stats.stop_reason = "context"
        return max(width, 0)

    # ----- diffusion -----
    def _diffusion(self, run: _Run) -> None:
        while run.remaining > 0:
            width = self._block_width(run)
            if not width:
                return
            canvas: list[int | None] = [None] * width
            steps = 0
            while True:
                limit, eos_at = produced_limit(canvas, run.remaining, run.stops)
                if all(token is not None for token in canvas[:limit]):
                    break
                self._step(canvas, run)
                steps += 1
            run.stats.steps_per_block.append(steps)
            produced = [int(t) for t in canvas[:limit]]  # type: ignore[arg-type]
            self.commit(produced)
            run.stats.causal_passes += 1
            if eos_at == limit:
                run.emit(produced[:-1])
                run.stats.stop_reason = "eos"
                return
            run.emit(produced)
        run.stats.stop_reason = "length"

    # ----- spec -----
    def _spec(self, run: _Run) -> None:
        while run.remaining > 0:
            width = self._block_width(run)
            if not width:
                return
            drafts = self._draft(width, run)
            emitted, hit_eos = self._verify(drafts, run)
            run.stats.causal_passes += 1
            run.stats.accepted_lengths.append(len(emitted) + (1 if hit_eos else 0))
            run.emit(emitted)
            if hit_eos:
                run.stats.stop_reason = "eos"
                return
        run.stats.stop_reason = "length"

    def _draft(self, width: int, run: _Run) -> list[int]:
        canvas: list[int | None] = [None] * width
        for _ in range(run.draft_steps):
            if all(token is not None for token in canvas):
                break
            self._step(canvas, run)
        masked = [j for j, token in enumerate(canvas) if token is None]
        if masked:
            logits = self.model.forward_block(self._window(canvas), self.history, rows=masked,
                                              coreset_top_p=run.coreset_top_p)
            run.stats.block_passes += 1
            for j, row in zip(masked, logits):
                canvas[j] = run.sampler.argmax(row)
        return [int(t) for t in canvas]  # type: ignore[arg-type]

    def _verify(self, drafts: list[int], run: _Run) -> tuple[list[int], bool]:
        """Verify drafts with a causal pass and keep the accepted prefix plus one token (spec 4.2, steps 2-4).

        Positions are evaluated in order, one at a time. Causal passes in the reference give the same
        numbers whether run in one batch or position by position, so this equals one batched verification
        pass followed by a rollback of positions p+m .. p+B-1; the rejected positions are never computed.
        """
        sampler = run.sampler
        out: list[int] = []
        inputs = [self.pending] + drafts[:-1]
        for j, (token_in, draft) in enumerate(zip(inputs, drafts), start=1):
            logits = self.model.forward_causal([token_in], self.history)[0]
            q = sampler.sampling_distribution(logits)
            accepted = sampler.uniform() < float(q[draft]) if not sampler.params.greedy else bool(q[draft] > 0)
            if accepted:
                token = draft
            elif sampler.params.greedy:
                token = int(torch.argmax(q))
            else:
                residual = q.clone()
                residual[draft] = 0.0
                token = sampler.draw(residual / residual.sum())
            self.pending = token
            if token in run.stops:
                return out, True
            out.append(token)
            if not accepted or j == len(drafts) or len(out) == run.remaining:
                return out, False
        return out, False


def produced_limit(canvas: list[int | None], remaining: int, stops: set[int]) -> tuple[int, int | None]:
    """min(K, R) of spec 4.1, and the 1-based offset of the end-of-generation target that set K (if any)."""
    for j, token in enumerate(canvas, start=1):
        if token is None:
            break
        if token in stops:
            return min(j, remaining), j
    return min(len(canvas), remaining), None


def generate(model: CloverModel, prompt_ids: list[int], n_ctx: int | None = None, **options) -> GenerationResult:
    """One-shot generation on a fresh history. Options as ``Session.generate``."""
    return Session(model, n_ctx).generate(prompt_ids, **options)
