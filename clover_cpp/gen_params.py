"""``GenParams``: what one generation asks of the engine, the one Python shape of libclover's
``clover_gen_params``. ``Model.generate`` / ``Model.run`` take it (or its fields as keywords); ``clover-cpp``
builds it from its options (clover_cpp/options.py), chat keeps one for its turns, and the server fills one per
request from the request and its defaults.

Its checks are the Python API's and the command line's one place for these values: a bad value is a
``GenParamError`` naming the field, which the CLI turns into its option's name. Request fields are checked
by their pydantic models (clover_cpp/serve/schema.py); limits of a loaded engine (its largest block size, its
vocabulary, its context) are checked by libclover.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from clover_common.errors import BadInput

MODES = ("ar", "diffusion", "spec", "auto")
DEFAULT_MODE = "auto"  # lossless, and faster than ar where drafts are accepted (docs/decoding.md)


class GenParamError(BadInput):
    """A generation parameter out of its range: ``field`` must ``rule``, and is ``value``."""

    def __init__(self, field: str, rule: str, value: Any, message: str | None = None) -> None:
        self.field, self.rule, self.value = field, rule, value
        super().__init__(message or f"{field} {rule}, got {value!r}")


@dataclass(frozen=True)
class GenParams:
    """``None`` takes the GGUF's value: the block size (``ARCH.block_size``), the threshold calibrated for it
    (spec 4.3), the coreset top_p (spec 3.3). ``stop_ids=None`` stops at the vocabulary's end-of-generation
    tokens, ``()`` at none. ``draft_steps``: spec mode's LowConfidence steps before the argmax draft (greedy
    only)."""

    mode: str = DEFAULT_MODE
    block_size: int | None = None
    threshold: float | None = None
    coreset_top_p: float | None = None
    draft_steps: int = 0
    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: tuple[int, ...] | None = None
    banned_ids: tuple[int, ...] = ()
    # the distribution stage (spec 4): logit_bias as (id, bias) pairs (a dict is taken too; -inf bans), the
    # penalties over the response's tokens (None: the GGUF's), a GBNF grammar the response must match (applied
    # from the token after the first of ``grammar_after_ids`` when given, e.g. ``</think>``), and logprobs: None =
    # none, k = each token's log P and its k most likely alternatives
    logit_bias: tuple[tuple[int, float], ...] = ()
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    grammar: str | None = None
    grammar_after_ids: tuple[int, ...] = ()
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.stop_ids is not None and not isinstance(self.stop_ids, tuple):
            object.__setattr__(self, "stop_ids", tuple(int(t) for t in self.stop_ids))
        for name in ("banned_ids", "grammar_after_ids"):
            if not isinstance(getattr(self, name), tuple):
                object.__setattr__(self, name, tuple(int(t) for t in getattr(self, name) or ()))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias or ()))
        self._check()

    def _check(self) -> None:
        if self.mode not in MODES:
            raise GenParamError("mode", f"must be one of {', '.join(MODES)}", self.mode,
                                f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        rules = (
            ("block_size", self.block_size is None or self.block_size >= 1, "must be at least 1"),
            ("threshold", self.threshold is None or 0.0 <= self.threshold <= 1.0, "must be in [0, 1]"),  # NaN fails
            ("coreset_top_p", self.coreset_top_p is None or 0.0 < self.coreset_top_p <= 1.0, "must be in (0, 1]"),
            ("draft_steps", self.draft_steps >= 0, "must be >= 0"),
            ("max_tokens", self.max_tokens >= 0, "must be >= 0"),
            ("temperature", self.temperature >= 0.0 and math.isfinite(self.temperature),
             "must be a finite number >= 0"),
            ("top_k", self.top_k >= 0, "must be >= 0 (0 = off)"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1] (1 = off)"),
            ("repeat_penalty", self.repeat_penalty is None or 0.0 < self.repeat_penalty < math.inf,
             "must be a finite number > 0 (1 = off)"),
            ("presence_penalty", self.presence_penalty is None or math.isfinite(self.presence_penalty),
             "must be finite (0 = off)"),
            ("frequency_penalty", self.frequency_penalty is None or math.isfinite(self.frequency_penalty),
             "must be finite (0 = off)"),
            ("logit_bias", all(math.isfinite(b) or b == -math.inf for _, b in self.logit_bias),
             "values must be finite or -inf"),
            ("logprobs", self.logprobs is None or self.logprobs >= 0, "must be >= 0 (None = off)"),
        )
        for field, ok, rule in rules:
            if not ok:
                raise GenParamError(field, rule, getattr(self, field))

    def replace(self, **changes: Any) -> "GenParams":
        """A copy with some fields changed (checked again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


def merge(params: GenParams | None, overrides: dict[str, Any]) -> GenParams:
    """``params`` (default: ``GenParams()``) with the keyword overrides of Model.generate/run; a keyword that is
    no field is a TypeError, as for any function."""
    unknown = set(overrides) - set(GenParams.fields())
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(unknown))}")
    base = params or GenParams()
    return base.replace(**overrides) if overrides else base
