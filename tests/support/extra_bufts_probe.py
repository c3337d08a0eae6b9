"""Run one quantized GGUF with and without the CPU extra buffer types (AMX tiles, repacked weight layouts)
and write what each gives, for tests/native/test_extra_bufts.py, which runs this in a subprocess so that a native
crash is that test's failure with a message, not a dead test session.

    python -m tests.support.extra_bufts_probe QUANTIZED.gguf F16.gguf OUT_DIR      (from the repository root)

OUT_DIR/result.json: per setting, the weight buffer types llama.cpp allocated and the greedy tokens of ar,
diffusion and spec; where the two settings' tokens differ, the plain model's decision margin at the first
difference. OUT_DIR/logits.npz: causal and block logits per setting and of the f16 file, and the plain model's routing
margin of each of those rows (plain_causal_margin, plain_block_margin).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from clover_cpp import Model
from clover_dev import REPO_ROOT
from clover_dev.native import buffer_types, causal_and_block_logits
from clover_native import bindings
from tests.support.routing import NativeRouterMargins

WINDOW = 8
N_TOKENS = 96
PROMPT_TOKENS = 40
NEW_TOKENS = 32


def documents(path: Path) -> list[tuple[list[int], list[tuple[int, list[int]]]]]:
    """One document of held-out code: causal rows for all of it, block windows at three boundaries (fully
    masked, half masked, one masked target)."""
    model = bindings.LlamaModel(path)
    tokens = model.tokenize((REPO_ROOT / "clover_ref" / "decode.py").read_text()[:3000])[:N_TOKENS]
    model.close()
    windows = [(16, list(range(WINDOW))), (48, [1, 3, 5, 7]), (80, [WINDOW - 1])]
    return [(tokens, windows)]


def decode_modes(path: Path, prompt: list[int], use_extra_bufts: bool) -> dict[str, dict]:
    """Greedy tokens of each mode; for diffusion also every step's canvas, with the tokens produced before
    its block (enough to replay the step)."""
    out: dict[str, dict] = {}
    with Model(path, n_ctx=512, use_extra_bufts=use_extra_bufts) as model:
        for mode in ("ar", "diffusion", "spec"):
            model.reset()
            produced: list[int] = []
            steps: list[tuple[int, list[int]]] = []
            res = model.run(prompt, mode=mode, max_tokens=NEW_TOKENS, stop_ids=[],
                            on_tokens=lambda block: produced.extend(block),
                            on_step=lambda canvas: steps.append((len(produced), list(canvas))))
            out[mode] = {"tokens": res.tokens, "steps": steps, "block_size": res.stats.block_size,
                         "threshold": res.stats.threshold}
    return out


class Replay:
    """One decision replayed with native causal and block passes: its margins on the plain model (no extra
    buffer types), and how far the other setting moves that decision's logits."""

    def __init__(self, path: Path, use_extra_bufts: bool = False) -> None:
        self.model = bindings.LlamaModel(path, use_extra_bufts=use_extra_bufts)
        self.ctx = bindings.Context(self.model, n_ctx=512, n_ubatch=64)
        self.mask = self.model.mask_token()
        self.other: Replay | None = None  # the extra-buffers model, for logit_diff
        self.logit_diff = 0.0  # of the last decision replayed

    def _probs(self, row: np.ndarray) -> tuple[np.ndarray, float]:
        x = row.astype(np.float64)
        x[self.mask] = -np.inf
        top2 = np.sort(x)[-2:]
        p = np.exp(x - x.max())
        return p / p.sum(), float(top2[1] - top2[0])

    def causal_logits(self, context: list[int]) -> np.ndarray:
        self.ctx.clear()
        return self.ctx.causal(context)[-1]

    def step_logits(self, context: list[int], window: list[int], masked: list[int]) -> np.ndarray:
        self.ctx.clear()
        self.ctx.causal(context[:-1])
        return self.ctx.block(window, rows=masked)

    def _compare(self, logits: np.ndarray, replay: Callable[["Replay"], np.ndarray]) -> None:
        other = replay(self.other) if self.other is not None else logits
        self.logit_diff = float(np.abs(other.astype(np.float64) - logits).max())

    def causal_gap(self, context: list[int]) -> float:
        """Top-2 logit gap of the next-token decision after ``context``."""
        logits = self.causal_logits(context)
        self._compare(logits, lambda r: r.causal_logits(context))
        return self._probs(logits)[1]

    def step_margin(self, context: list[int], before: list[int], got: list[int], want: list[int],
                    threshold: float) -> float:
        """The smallest margin of the LowConfidence step that turned canvas ``before`` into ``want`` (plain)
        and ``got`` (extra), over the targets where the two differ: argmax gaps, |ln conf - ln threshold|,
        and when no target cleared the threshold, the log-ratio of the two best confidences."""
        window = [context[-1]] + before[:-1]
        masked = [j for j, t in enumerate(before) if t == self.mask]
        differing = {j for j in masked if got[j] != want[j]} or set(masked)
        logits = self.step_logits(context, window, masked)
        self._compare(logits, lambda r: r.step_logits(context, window, masked))
        margins, confs = [], []
        for j, row in zip(masked, logits):
            p, gap = self._probs(row)
            conf = float(p.max())
            confs.append(conf)
            if j in differing:
                margins += [gap, abs(math.log(conf) - math.log(threshold))] if 0 < threshold < 1 else [gap]
        confs.sort(reverse=True)
        if len(confs) > 1 and np.float32(confs[0]) <= np.float32(threshold):
            margins.append(math.log(confs[0]) - math.log(confs[1]))
        return min(margins) if margins else math.inf

    def close(self) -> None:
        self.ctx.close()
        self.model.close()


def first_difference(prompt: list[int], extra: dict, plain: dict, mode: str, replay: Replay) -> dict | None:
    """Where the two settings' outputs first differ, the plain model's margin there, and how far the extra
    buffer types move that decision's logits (logit_diff: the probe's fixed passes may never reach the
    shapes where a repacked kernel is used, so their difference can be 0 while a decode pass differs)."""
    if mode == "diffusion":
        for k, ((n_before, got), (_, want)) in enumerate(zip(extra["steps"], plain["steps"])):
            if got != want:
                prev = plain["steps"][k - 1] if k > 0 and plain["steps"][k - 1][0] == n_before else None
                before = prev[1] if prev else [replay.mask] * len(want)
                context = prompt + plain["tokens"][:n_before]
                margin = replay.step_margin(context, before, got, want, plain["threshold"])
                return {"at": f"step {k}", "margin": margin, "logit_diff": replay.logit_diff}
        if extra["tokens"] == plain["tokens"]:
            return None
        return {"at": "after equal canvases", "margin": math.inf}
    if extra["tokens"] == plain["tokens"]:
        return None
    a, b = extra["tokens"], plain["tokens"]
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    margin = replay.causal_gap(prompt + b[:i])
    return {"at": f"token {i}", "margin": margin, "logit_diff": replay.logit_diff}


def routing_margins(path: Path, docs: list) -> tuple[np.ndarray, np.ndarray]:
    """The plain model's routing margin of each causal and block row (tests/support/routing.py), from a
    run of its own: reading the router splits the graph."""
    model = bindings.LlamaModel(path)
    top_k = int(model.meta(f"{model.meta('general.architecture')}.expert_used_count"))
    model.close()
    router = NativeRouterMargins(top_k)
    causal_and_block_logits(path, docs, WINDOW, use_extra_bufts=False, router=router)
    return np.array(router.margins["causal"]), np.array(router.margins["block"])


def main() -> int:
    path, f16, out_dir = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    docs = documents(path)
    prompt = docs[0][0][:PROMPT_TOKENS]
    result: dict[str, dict] = {}
    arrays: dict[str, np.ndarray] = {}
    arrays["f16_causal"], arrays["f16_block"] = causal_and_block_logits(f16, docs, WINDOW)
    for name, flag in (("extra", True), ("plain", False)):
        bufts = buffer_types(path, flag)
        arrays[f"{name}_causal"], arrays[f"{name}_block"] = causal_and_block_logits(path, docs, WINDOW, flag)
        result[name] = {"buffer_types": bufts, "modes": decode_modes(path, prompt, flag)}
        print(f"{name}: {bufts}", flush=True)
    arrays["plain_causal_margin"], arrays["plain_block_margin"] = routing_margins(path, docs)
    replay = Replay(path)
    replay.other = Replay(path, use_extra_bufts=True)
    try:
        result["differences"] = {mode: first_difference(prompt, result["extra"]["modes"][mode],
                                                        result["plain"]["modes"][mode], mode, replay)
                                 for mode in ("ar", "diffusion", "spec")}
    finally:
        replay.other.close()
        replay.close()
    np.savez(out_dir / "logits.npz", **arrays)
    (out_dir / "result.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
