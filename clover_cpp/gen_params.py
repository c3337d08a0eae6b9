"""``GenParams``: what one generation asks of the engine, the one Python shape of libclover's
``clover_gen_params``. ``Model.generate`` / ``Model.run`` take it (or its fields as keywords); ``clover-cpp``
builds it from its options (clover_cpp/options.py) and chat keeps one for its turns.

Its checks are the Python API's and the command line's one place for these values: a bad value is a
``GenParamError`` naming the field, which the CLI turns into its option's name; limits of a loaded engine (its
largest block size, its vocabulary, its context) are checked by libclover.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from clover_common.errors import BadInput
from clover_common.config_numbers import F32_MAX, I32_MAX, I32_MIN  # the engine's C types' ranges
from clover_common.long_numbers import shown
from clover_native import libclover

MODES: tuple[str, ...] = tuple(libclover.MODES)  # enum clover_mode's names, in its order: the one mode list
DEFAULT_MODE = "auto"  # lossless, and faster than ar where drafts are accepted (docs/decoding.md)
UNSET = None  # a field's "the GGUF's value" (``Param.unset``)


class GenParamError(BadInput):
    """A generation parameter out of its range: ``field`` must ``rule``, and is ``value``."""

    def __init__(self, field: str, rule: str, value: Any, message: str | None = None) -> None:
        self.field, self.rule, self.value = field, rule, value
        super().__init__(message or f"{field} {rule}, got {self.shown}")

    @property
    def shown(self) -> str:
        """The value for a message, short (an integer of hundreds of digits by its length)."""
        return shown(self.value)




@dataclass(frozen=True)
class Bound:
    """A range with open or closed ends (``None``: no end), of finite values only; ``off`` names the value that
    turns the parameter off, for the messages. The one check of a range: GenParams, the CLI and the server's
    request schema (``pydantic``) all read it.

    The engine holds an ``integer`` field in a 32-bit int and any other in a 32-bit float (clover.h's
    ``clover_gen_params``), so a value must also fit that type (``fits``): 10^12 tokens would wrap negative, 1e39
    would become inf. The C table (clover-gen-params.h) needs no such row, as its values have those types already."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    off: str = ""
    integer: bool = False

    def ok(self, value: float) -> bool:
        return self.broken(value) is None

    def broken(self, value: float) -> str | None:
        """The rule ``value`` breaks (``rule``, or ``c_rule`` when only the engine's type cannot hold it); None
        when it is valid."""
        if not isinstance(value, int) and not math.isfinite(value):  # NaN and inf fail every bound (an int of any
            # size is finite, and compared exactly below)
            return self.rule
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return self.rule
        if self.high is not None and (value >= self.high if self.high_open else value > self.high):
            return self.rule
        return None if self.fits(value) else self.c_rule

    def fits(self, value: float) -> bool:
        """Whether the engine's C type holds ``value`` (an int of any size is compared exactly)."""
        if self.integer:
            return I32_MIN <= value <= I32_MAX
        return -F32_MAX <= value <= F32_MAX

    @property
    def rule(self) -> str:
        if self.low is not None and self.high is not None:
            text = f"must be in {'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}" \
                   f"{')' if self.high_open else ']'}"
        elif self.low is not None:
            text = f"must be {'' if self.integer else 'a finite number '}{'>' if self.low_open else '>='} " \
                   f"{_num(self.low)}"
        elif self.high is not None:
            text = f"must be a finite number {'<' if self.high_open else '<='} {_num(self.high)}"
        else:
            text = "must be finite"
        return f"{text} ({self.off})" if self.off else text

    @property
    def c_rule(self) -> str:
        if self.integer:
            return f"must be at most {I32_MAX} (the engine's 32-bit integer)"
        return f"must be at most {F32_MAX:.6g} in magnitude (the engine's 32-bit float)"

    def pydantic(self) -> dict[str, float | bool]:
        """The bound as pydantic ``Field`` arguments (ge/gt/le/lt, no NaN or inf), within the engine's type."""
        out: dict[str, float | bool] = {} if self.integer else {"allow_inf_nan": False}
        type_low, type_high = (I32_MIN, I32_MAX) if self.integer else (-F32_MAX, F32_MAX)
        out["gt" if self.low_open else "ge"] = type_low if self.low is None else self.low
        out["lt" if self.high_open else "le"] = type_high if self.high is None else self.high
        return out


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


@dataclass(frozen=True)
class Param:
    """The one home of a generation parameter, as the metadata of its GenParams field: its command-line flags
    (argparse's order; ``()``: no flag), help, bound, the C field of ``clover_gen_params`` it
    sets, the C value that means "the GGUF's value" when the field is ``None`` (``c_unset``), and that value itself
    (``gguf``: from the loaded model's ``ModelInfo`` and the call's other fields, as libclover resolves it)."""

    flags: tuple[str, ...] = ()
    help: str | None = None
    bound: Bound | None = None
    c_field: str | None = None
    c_unset: float | None = None
    label: str | None = None  # how the CLI's messages name it (default: the last flag)
    gguf: Callable[[Any, "GenParams"], Any] | None = None

    @property
    def flag(self) -> str:
        return self.label or self.flags[-1]


def _from_info(name: str) -> Callable[[Any, "GenParams"], Any]:
    return lambda info, _params: getattr(info, name)


def _calibrated_threshold(info: Any, params: "GenParams") -> float:
    return float(info.threshold_for(params.block_size or info.block_size))


def param(default: Any, **meta: Any) -> Any:
    return field(default=default, metadata={"param": Param(**meta)})


@dataclass(frozen=True)
class GenParams:
    """``None`` takes the GGUF's value: the block size (``ARCH.block_size``), the threshold calibrated for it
    (spec 4.3), the coreset top_p (spec 3.3), the penalties; libclover resolves them and reports the values it used
    in its stats. ``stop_ids=None`` stops at the vocabulary's end-of-generation tokens, ``()`` at none.
    ``draft_steps``: spec mode's LowConfidence steps before the argmax draft (greedy only).

    The bounds are the engine's (clover.h) for the Python API and the CLI: as llama-server's sampling fields accept
    any temperature and penalty, the engine accepts every value that has a meaning (temperature >= 0, finite
    penalties, repeat_penalty > 0) and that its 32-bit fields hold (``Bound.fits``), not OpenAI's documented
    ranges."""

    mode: str = param(DEFAULT_MODE, flags=("--mode",), c_field="mode",
                      help=f"{DEFAULT_MODE} (default): lossless, faster than ar where drafts are accepted; "
                           "diffusion changes the output")
    block_size: int | None = param(None, flags=("--block-size",), bound=Bound(1, integer=True), c_field="block_size",
                                   c_unset=0, gguf=_from_info("block_size"),
                                   help="default: the GGUF's ARCH.block_size")
    threshold: float | None = param(None, flags=("--threshold",), bound=Bound(0.0, 1.0), c_field="threshold",
                                    c_unset=-1.0, gguf=_calibrated_threshold,
                                    help="default: the calibrated threshold for B")
    coreset_top_p: float | None = param(
        None, flags=("--coreset-top-p",), bound=Bound(0.0, 1.0, low_open=True), c_field="coreset_top_p", c_unset=0.0,
        gguf=_from_info("coreset_top_p"),
        help="the block expert coreset's top_p in (0, 1] for block passes (spec 3.3; default: the GGUF's; "
             "1 = per-row routing)")
    draft_steps: int = param(0, flags=("--draft-steps",), bound=Bound(0, integer=True), c_field="draft_steps")
    max_tokens: int = param(64, flags=("-n", "--n-predict", "--max-tokens"), bound=Bound(0, integer=True),
                            c_field="max_tokens", label="-n/--max-tokens")
    temperature: float = param(0.0, flags=("--temp", "--temperature"), bound=Bound(0.0), c_field="temperature",
                               label="--temp",
                               help="0 = greedy")
    top_k: int = param(0, flags=("--top-k",), bound=Bound(0, off="0 = off", integer=True), c_field="top_k",
                       help="0 = off")
    top_p: float = param(1.0, flags=("--top-p",), bound=Bound(0.0, 1.0, low_open=True, off="1 = off"),
                         c_field="top_p", help="1 = off")
    seed: int = param(0, flags=("-s", "--seed"), c_field="seed", label="-s/--seed")  # C: its low 32 bits
    stop_ids: tuple[int, ...] | None = None
    banned_ids: tuple[int, ...] = ()
    # the distribution stage (spec 4): logit_bias as (id, bias) pairs (a dict is taken too; -inf bans), the
    # penalties over the response's tokens (None: the GGUF's), a GBNF grammar the response must match (applied
    # from the token after the first of ``grammar_after_ids`` when given, e.g. ``</think>``), and logprobs: None =
    # none, k = each token's log P and its k most likely alternatives
    logit_bias: tuple[tuple[int, float], ...] = ()
    repeat_penalty: float | None = param(
        None, flags=("--repeat-penalty",), bound=Bound(0.0, low_open=True, off="1 = off"), c_field="repeat_penalty",
        c_unset=math.nan, gguf=_from_info("repeat_penalty"),
        help="a token already in the answer has a positive logit divided by N, a negative one multiplied (1 = off; "
             "default: the GGUF's general.sampling.penalty_repeat, else 1)")
    presence_penalty: float | None = param(
        None, flags=("--presence-penalty",), bound=Bound(off="0 = off"), c_field="presence_penalty", c_unset=math.nan,
        gguf=_from_info("presence_penalty"),
        help="subtracted from the logit of a token already in the answer (0 = off; default: the GGUF's "
             "general.sampling.penalty_present, else 0)")
    frequency_penalty: float | None = param(
        None, flags=("--frequency-penalty",), bound=Bound(off="0 = off"), c_field="frequency_penalty",
        c_unset=math.nan, gguf=_from_info("frequency_penalty"),
        help="times its count, subtracted from the logit of a token already in the answer (0 = off; default: the "
             "GGUF's general.sampling.penalty_freq, else 0)")
    grammar: str | None = None
    grammar_after_ids: tuple[int, ...] = ()
    logprobs: int | None = param(None, bound=Bound(0, off="None = off", integer=True))
    spec_fused: bool = param(False, flags=("--spec-fused",), c_field="spec_fused",
                             help="spec: verify a round's drafts and draft the next round in one fused pass while "
                                  "every draft is accepted (docs/native.md, \"The fused pass\"; same tokens; off by "
                                  "default: slower than two passes on the demo model)")

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
        for name, spec in PARAMS.items():
            value = getattr(self, name)
            broken = spec.bound.broken(value) if spec.bound is not None and value is not None else None
            if broken:
                raise GenParamError(name, broken, value)
        if not all(math.isfinite(b) or b == -math.inf for _, b in self.logit_bias):
            raise GenParamError("logit_bias", "values must be finite or -inf", self.logit_bias)

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


# the table: each GenParams field that has a flag, a bound or a C field, and its Param
PARAMS: dict[str, Param] = {f.name: f.metadata["param"] for f in dataclasses.fields(GenParams) if "param" in f.metadata}


def resolved(params: GenParams, info: Any) -> GenParams:
    """``params`` with each ``None`` that stands for the GGUF's value replaced by that value (``Param.gguf``, from
    ``info``, the model's ``ModelInfo``): what a call with these params decodes with, known before it runs (the
    engine reports the same values in its stats)."""
    changes = {name: spec.gguf(info, params) for name, spec in PARAMS.items()
               if spec.gguf is not None and getattr(params, name) is None}
    return params.replace(**changes) if changes else params


def to_c(params: GenParams, c: Any) -> None:
    """Set the scalar fields of a ``clover_gen_params`` from the table: the value, or ``c_unset`` for None."""
    for name, spec in PARAMS.items():
        if spec.c_field is None:
            continue
        value = getattr(params, name)
        if name == "mode":
            value = libclover.MODES[value]
        elif name == "seed":
            value = int(value) & 0xFFFFFFFF
        elif value is None:
            value = spec.c_unset
        setattr(c, spec.c_field, value)
