"""The one `--json` output of `clover-ref generate`, `clover-cpp generate` and `llama-clover`.

The three commands print the same object, so a script or a comparison can read any of them: the table in
docs/engine-python.md ("The `--json` output") and the JSON Schema docs/generate-output.schema.json define it;
llama-clover.cpp writes the same keys with the same formulas. Histograms are objects {"value": count} with
the values in increasing order, zero counts left out, and the value HIST_LAST standing for HIST_LAST or more
(the native engine's last bin).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

HIST_LAST = 64  # CLOVER_HIST_SIZE - 1 in clover.h

# The required keys, in the order they are printed (the schema file lists the same).
TOP_KEYS = ("text", "prompt_ids", "tokens", "stats")
STATS_KEYS = ("mode", "block_size", "threshold", "prompt_tokens", "generated_tokens", "block_passes",
              "causal_passes", "tokens_per_pass", "prefill_ms", "decode_ms", "prefill_tok_per_s",
              "decode_tok_per_s", "steps_per_block", "accepted_lengths", "stop_reason")


@dataclass
class RunStats:
    """What the stats of every generation hold, the reference's (clover_ref.decode.GenerationStats) and the
    engine's (clover_cpp.model.Stats), and the TPF both compute from them; each adds its own fields."""

    mode: str
    block_size: int
    threshold: float
    prompt_tokens: int = 0
    generated_tokens: int = 0
    block_passes: int = 0
    causal_passes: int = 0  # decode-time causal passes: ar steps, commits, verifications

    @property
    def passes(self) -> int:
        return self.block_passes + self.causal_passes

    @property
    def tokens_per_pass(self) -> float:
        """TPF: generated tokens / decode-time passes (block + causal), the project's tokens per forward."""
        return self.generated_tokens / self.passes if self.passes else 0.0


def histogram_from_bins(bins: Sequence[int]) -> dict[str, int]:
    """{"value": count} from a list indexed by value (the native engine's form)."""
    return {str(min(v, HIST_LAST)): int(n) for v, n in enumerate(bins) if n}


def histogram_from_samples(samples: Iterable[int]) -> dict[str, int]:
    """{"value": count} from the values themselves (the reference's per-block and per-round lists)."""
    counts = Counter(min(int(v), HIST_LAST) for v in samples)
    return {str(v): counts[v] for v in sorted(counts)}


def per_second(count: int, ms: float) -> float:
    """count / (ms / 1000), 0 when no time was measured."""
    return count / (ms / 1e3) if ms > 0 else 0.0


def generate_output(*, text: str, prompt_ids: Sequence[int], tokens: Sequence[int], mode: str, block_size: int,
                    threshold: float, prompt_tokens: int, block_passes: int, causal_passes: int,
                    prefill_ms: float, decode_ms: float, steps_per_block: dict[str, int],
                    accepted_lengths: dict[str, int], stop_reason: str, **extra: Any) -> dict[str, Any]:
    """The `--json` object; ``extra`` adds implementation-specific stats (threads, seconds, auto_rounds, ...)."""
    generated = len(tokens)
    passes = block_passes + causal_passes
    stats = {
        "mode": mode, "block_size": int(block_size), "threshold": float(threshold),
        "prompt_tokens": int(prompt_tokens), "generated_tokens": generated,
        "block_passes": int(block_passes), "causal_passes": int(causal_passes),
        "tokens_per_pass": generated / passes if passes else 0.0,
        "prefill_ms": float(prefill_ms), "decode_ms": float(decode_ms),
        "prefill_tok_per_s": per_second(prompt_tokens, prefill_ms),
        "decode_tok_per_s": per_second(generated, decode_ms),
        "steps_per_block": steps_per_block, "accepted_lengths": accepted_lengths, "stop_reason": stop_reason,
    }
    clash = set(extra) & set(stats)
    assert not clash, f"extra stats may not redefine {sorted(clash)}"
    return {"text": text, "prompt_ids": [int(t) for t in prompt_ids], "tokens": [int(t) for t in tokens],
            "stats": stats | extra}
