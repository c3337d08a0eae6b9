"""Helpers for the native engine tests (tests/engine/test_engine.py): a tracing reference session and the
near-tie rule (docs/decoding.md); a test model's engine (tests/engine/test_auto.py,
test_distribution.py).

Native and reference logits differ by float rounding, so a token comparison may diverge only where the
decision at the first differing step was a near-tie: the reference's top-2 logit gap, or for a fill
decision the confidence's distance to the threshold, below the parity tolerance
``REF_TOL * max(1, max|logit|)``. Fill margins are measured as |ln(conf) - ln(threshold)| (and, when the
single most confident target is filled, as the log-ratio of the two best confidences): a logit error
of d moves ln(conf) by at most 2d, and since confidences are below 1 this is stricter than the absolute
|conf - threshold| of the issue's wording.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from clover_ref.decode import Session
from clover_ref.sampling import Sampler, SamplingParams
from tests.support.routing import recording_router_probs, routing_near_ties

REF_TOL = 1e-3  # the parity tolerance of the cpp_patch issue (tests/native/test_native_clover.py)
# A trained model's sharper attention carries the CPU's flash-attention rounding further: ggml's CPU kernel takes
# Q in f16 and accumulates P.V in f16 (F16 V), a few f16 roundings (unit 2^-11) per output. On the demo model the
# engine's causal logits sit 2.1e-3 (relative) from the reference with flash attention on (llama.cpp's auto, the
# engine's default) and 2.1e-4 with it off (40 random ids; a 46-token code prompt's block pass: 1.1e-3 and
# 2.1e-4). Four f16 units bound a logit's error; a fill margin is a log-probability, which moves by up to twice
# that (the target's logit and the normaliser), so the margins get eight.
FLASH_ATTN_TOL = 8 * 2**-11


class Case:
    """A model, its f32 GGUF, a native engine and the reference (for near-ties)."""

    def __init__(self, ref: Any, gguf: Path) -> None:
        from clover_cpp import Model

        self.ref = ref
        self.gguf = gguf
        self.model = Model(gguf, n_ctx=1024, max_block_size=32)
        self.eos = list(ref.config.eos_token_ids)

    def run(self, prompt: list[int], mode: str, **opts: Any) -> Any:
        """A run on a fresh history (Model.run continues the history otherwise)."""
        self.model.reset()
        return self.model.run(prompt, mode=mode, **opts)


class NearTieError(AssertionError):
    pass


@dataclass
class StepTrace:
    canvas: list[int]                           # after the step; mask id where still masked
    targets: dict[int, tuple[int, float, float]]  # masked target -> (token, confidence, top-2 logit gap)
    threshold: float
    fallback: bool                              # no target cleared the threshold
    scale: float                                # max(1, max|logit|) of the step's rows
    routing_ties: list[str] = field(default_factory=list)  # the pass's routing near-ties (routing_support)


def top2_gap(sampler: Sampler, row: torch.Tensor) -> float:
    """The gap between the two largest logits of a row, over the tokens the sampler may choose."""
    top2 = torch.topk(sampler.masked_logits(row), 2).values
    return float(top2[0] - top2[1])


@dataclass
class DraftTrace:
    drafts: list[int]       # d_{p+1} .. d_{p+B} of one spec round
    gaps: list[float]       # top-2 logit gap of each argmax draft (inf where draft_steps filled it)
    scale: float            # max(1, max|logit|) of the draft pass


class TracingSession(Session):
    """The reference ``Session`` that also records every LowConfidence step (canvas and margins) and
    every spec draft (drafts and their top-2 gaps)."""

    def __init__(self, model: Any, n_ctx: int | None = None) -> None:
        super().__init__(model, n_ctx)
        self.trace: list[StepTrace] = []
        self.drafts: list[DraftTrace] = []

    @contextmanager
    def _capturing(self) -> Iterator[list[tuple[list[int], torch.Tensor]]]:
        """Collect (rows, logits) of every block pass the model runs inside the body, in order."""
        calls: list[tuple[list[int], torch.Tensor]] = []
        shadowed = vars(self.model).get("forward_block")  # an enclosing capture's wrapper, if any
        original = self.model.forward_block

        def forward_block(window: Any, history: Any, rows: list[int] | None = None,
                          coreset_top_p: float = 1.0) -> torch.Tensor:
            out = original(window, history, rows=rows, coreset_top_p=coreset_top_p)
            calls.append((list(range(len(window))) if rows is None else list(rows), out))
            return out

        self.model.forward_block = forward_block  # an instance attribute over the method, undone below
        try:
            yield calls
        finally:
            if shadowed is None:
                del self.model.forward_block
            else:
                self.model.forward_block = shadowed

    def _draft(self, width: int, run: Any) -> list[int]:
        steps_before = len(self.trace)
        with self._capturing() as calls:
            drafts = super()._draft(width, run)
        gaps, scale = [math.inf] * width, 1.0
        # past the draft_steps' passes: the argmax pass over the targets they left masked, if any
        for rows, logits in calls[len(self.trace) - steps_before:]:
            for j, row in zip(rows, logits):
                gaps[j] = top2_gap(run.sampler, row)
            scale = max(1.0, float(logits.abs().max()))
        self.drafts.append(DraftTrace(drafts, gaps, scale))
        return drafts

    def _step(self, canvas: list[int | None], run: Any) -> None:
        masked = [j for j, token in enumerate(canvas) if token is None]
        with self._capturing() as calls, recording_router_probs(self.model) as probs:
            super()._step(canvas, run)
        top_ks = [layer.mlp.top_k for layer in self.model.model.layers]
        routing_ties = routing_near_ties(probs[-len(top_ks):], top_ks, run.coreset_top_p)
        _, logits = calls[-1]
        targets = {}
        threshold = float(run.threshold)
        fallback = True
        for j, row in zip(masked, logits):
            p = run.sampler.probabilities(row)
            token = int(torch.argmax(p))
            conf = float(p[token])
            if torch.tensor(conf, dtype=torch.float32) > torch.tensor(threshold, dtype=torch.float32):
                fallback = False
            targets[j] = (token, conf, top2_gap(run.sampler, row))
        mask = self.config.mask_token_id
        scale = max(1.0, float(logits.abs().max()))
        self.trace.append(StepTrace([mask if t is None else int(t) for t in canvas], targets, threshold,
                                    fallback, scale, routing_ties))


def reference_run(model: Any, turns: list[tuple[list[int], dict[str, Any]]]) -> tuple[list[Any], TracingSession]:
    """Run the reference over one or more turns on one session; returns the per-turn results."""
    session = TracingSession(model)
    results = [session.generate(prompt, **opts) for prompt, opts in turns]
    return results, session


def _excluded(model: Any, banned: list[int] | None) -> Sampler:
    return Sampler(model.config.vocab_size, [model.config.mask_token_id] + list(banned or []), SamplingParams())


def penalised_logprobs(raw: np.ndarray, counts: np.ndarray, repeat: float, frequency: float, presence: float,
                       excluded: list[int]) -> np.ndarray:
    """Spec 4's log P of one target: llama.cpp's penalties rule (llama_sampler_penalties) in float32 on the tokens
    ``counts`` holds (the response's, before the target), then log-softmax in float64 over the tokens not excluded."""
    logits = raw.astype(np.float32).copy()
    seen = counts > 0
    x = logits[seen]
    x = np.where(x > 0, x / np.float32(repeat), x * np.float32(repeat))
    logits[seen] = x - (counts[seen].astype(np.float32) * np.float32(frequency) + np.float32(presence))
    d = logits.astype(np.float64)
    d[excluded] = -np.inf
    top = d.max()
    return (d - (top + np.log(np.exp(d - top).sum()))).astype(np.float32)


def causal_gap(model: Any, context: list[int], banned: list[int] | None,
               rel_tol: float = REF_TOL) -> tuple[float, float]:
    """(top-2 logit gap, tolerance) of the reference's next-token decision after ``context``."""
    h = model.new_history()
    with torch.no_grad():
        row = model.forward_causal(context, h)[-1]
    return top2_gap(_excluded(model, banned), row), rel_tol * max(1.0, float(row.abs().max()))


def step_margin(step: StepTrace, native_canvas: list[int] | None) -> float:
    """The smallest decision margin at a reference step, over the targets where the native canvas differs."""
    margins = []
    differing = [j for j in step.targets if native_canvas is None or j >= len(native_canvas)
                 or native_canvas[j] != step.canvas[j]] or list(step.targets)
    confs = sorted((c for (_, c, _) in step.targets.values()), reverse=True)
    for j in differing:
        token, conf, gap = step.targets[j]
        margins.append(gap)
        if 0.0 < step.threshold < 1.0 and conf > 0:
            margins.append(abs(math.log(conf) - math.log(step.threshold)))
    if step.fallback and len(confs) > 1 and confs[1] > 0:
        margins.append(math.log(confs[0]) - math.log(confs[1]))
    return min(margins) if margins else math.inf


def decision_key(context: list[int], banned: list[int] | None = None) -> str:
    """A short name of the reference's next-token decision after ``context`` (the tokens before it), with ``banned``
    tokens excluded."""
    tokens = sorted(banned or []) + [-1] + list(context)
    return hashlib.sha1(np.asarray(tokens, dtype=np.int64).tobytes()).hexdigest()[:12]


@dataclass
class Ledger:
    """Counts compared cases and the near-tie divergences: at most 1 in 20. A divergence is counted once per decision
    of the reference: cases that run the same greedy text (spec and ar at several block sizes) meet the same near-tie,
    and which of them flip there depends on their pass shapes' rounding, so the tie is one event seen several times."""

    compared: int = 0
    near_ties: list[dict[str, Any]] = field(default_factory=list)
    rel_tol: float = REF_TOL  # FLASH_ATTN_TOL for a trained model

    def check(self, name: str, native: list[int], ref: list[int], model: Any, context: list[int],
              banned: list[int] | None = None, native_canvases: list[list[int]] | None = None,
              ref_trace: list[StepTrace] | None = None) -> None:
        """Tokens (and, when given, the diffusion canvases step by step) must be equal, or diverge first at a
        near-tie of the reference. ``context`` is everything before the generated tokens."""
        if native_canvases is not None and ref_trace is not None:
            self.compared += 1
            for k, step in enumerate(ref_trace):
                got = native_canvases[k] if k < len(native_canvases) else None
                if got != step.canvas:
                    margin = step_margin(step, got)
                    if not margin < self.rel_tol * step.scale and step.routing_ties:
                        # the routing near-tie rule (routing_support): another backend's rounding may route this
                        # pass differently, top-k or coreset cut, which moves the logits by more than the tolerance
                        self.near_ties.append({"case": name, "at": f"step {k}", "routing": step.routing_ties[:4]})
                        return
                    self._tie(name, f"step {k}", margin, self.rel_tol * step.scale, native, ref)
                    return
            if len(native_canvases) != len(ref_trace):
                raise AssertionError(f"{name}: native ran {len(native_canvases)} steps, reference "
                                     f"{len(ref_trace)}, with equal canvases up to there")
            assert native == ref, f"{name}: equal canvases but different tokens:\n{native}\n{ref}"
            return
        self.check_margin(name, native, ref, lambda i: causal_gap(model, context + ref[:i], banned, self.rel_tol),
                          decision=lambda i: decision_key(context + ref[:i], banned))

    def check_margin(self, name: str, native: list[int], ref: list[int],
                     margin: Callable[[int], tuple[float, float]],
                     decision: Callable[[int], str] | None = None) -> None:
        """``check`` for token lists whose decisions are not the reference's raw ones: the distribution stage (spec 4:
        logit_bias, penalties, a grammar) moves the top-2 gap, so ``margin(i)`` gives the (gap, tolerance) of the
        decision at the first differing token i, as the caller measured it; ``decision(i)`` names that decision
        when other cases can meet it too (decision_key)."""
        self.compared += 1
        if native == ref:
            return
        i = next((k for k, (a, b) in enumerate(zip(native, ref)) if a != b), min(len(native), len(ref)))
        gap, tol = margin(i)
        self._tie(name, f"token {i}", gap, tol, native, ref, decision(i) if decision else None)

    def check_rounds(self, name: str, native: list[int], ref: list[int], drafts: list[DraftTrace]) -> None:
        """Spec rounds with equal output may still accept different lengths: a draft that is a near-tie of
        the reference's draft pass can go either way without changing a token. At the first round whose
        emitted length differs, some draft the acceptance compared must have been a near-tie."""
        if native == ref:
            return
        k = next((k for k, (a, b) in enumerate(zip(native, ref)) if a != b), min(len(native), len(ref)))
        if k >= len(drafts):
            raise AssertionError(f"{name}: native rounds {native} and reference rounds {ref} differ after the "
                                 f"reference's last round")
        compared = max(native[k] if k < len(native) else 0, ref[k])  # drafts d_{p+1} .. d_{p+m} decided it
        round_ = drafts[k]
        self._tie(name, f"round {k}", min(round_.gaps[:compared]), self.rel_tol * round_.scale, native, ref)

    def _tie(self, name: str, where: str, margin: float, tol: float, native: list[int], ref: list[int],
             decision: str | None = None) -> None:
        record = {"case": name, "at": where, "margin": margin, "tol": tol}
        if decision is not None:
            record["decision"] = decision
        if not margin < tol:
            raise AssertionError(f"{name}: diverges at {where} where the reference's margin {margin:.4g} is not "
                                 f"a near-tie (tol {tol:.3g})\nnative {native}\nref    {ref}")
        self.near_ties.append(record)

    def distinct_ties(self) -> int:
        """Near-tie divergences, one per decision of the reference (a record without one is its own)."""
        return len({t.get("decision", f"case:{k}") for k, t in enumerate(self.near_ties)})

    def assert_budget(self) -> None:
        allowed, ties = self.compared // 20, self.distinct_ties()
        assert ties <= allowed, \
            f"{ties} near-tie divergences in {self.compared} cases (allowed {allowed}): {self.near_ties}"


def run_concurrently(fn: Callable[[int], Any], n: int, timeout: float = 300) -> list[Any]:
    """fn(0) .. fn(n - 1) on n threads started together; each result, or the exception it raised."""
    results: list[Any] = [None] * n
    barrier = threading.Barrier(n)

    def run(i: int) -> None:
        try:
            barrier.wait(timeout=60)
            results[i] = fn(i)
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    return results
