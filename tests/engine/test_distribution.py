"""The distribution stage (shared/clover-spec.md section 4, "Distributions and confidence" and "Penalties";
docs/decoding.md, "Constrained decoding"): logit_bias, the response-only penalties, a GBNF grammar, logprobs, and the
GGUF's default penalties, in every mode of the native engine.

- Greedy `spec` and `auto` (and `diffusion` with a grammar, which runs as `auto`) equal greedy `ar` with each part of
  the stage on, up to a near-tie (spec 4.2): the first differing decision must have a top-2 gap of the adjusted
  distribution (ar's own logprobs) below the parity tolerance of tests/support/engine.py, and at most 1 case in 20
  may end at one.
- The penalties' arithmetic against an oracle: the raw logits of the same passes the engine ran (a bindings context
  replaying prefill, `ar` steps, block passes and commits), llama.cpp's rule applied in numpy with the counts spec 4
  names, renormalised; the engine's logprobs must agree to float32 rounding.
- logit_bias -inf is never emitted and a large bias forces its token; logprobs are spec 4's P, sorted, normalised
  and the same in the lossless modes; grammar output validates against its JSON schema in every mode, greedy and
  sampled; grammar errors are refused with a clear message.
"""

from __future__ import annotations

import ctypes
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.engine import REF_TOL, Case, Ledger, causal_gap, penalised_logprobs
from clover_dev.convert import clover_convert
from tests.support.native import dump_results, record
from tests.support.schema import validate
from tests.support.tmp import MkTemp

pytestmark = pytest.mark.native  # every test here runs the native build (skipped without it; a failure in CI)

LEDGER = Ledger()
NINF = float("-inf")
F32_EPS = float(np.finfo(np.float32).eps)

# A schema with a nested object, an enum, an array and required fields; strings, arrays and numbers are bounded so
# that a random model's output ends (the converter's whitespace is bounded too).
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "inner": {"type": "object",
                  "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
                  "required": ["ok", "n"], "additionalProperties": False},
    },
    "required": ["name", "kind", "inner"],
    "additionalProperties": False,
}

# penalties that change a random model's greedy text: negative presence and a repetition penalty below 1 make it
# repeat itself, so that the counts matter at most steps
PENALTIES = {
    "presence": {"presence_penalty": -2.0},
    "frequency": {"frequency_penalty": 0.7, "presence_penalty": -1.0},
    "repeat": {"repeat_penalty": 0.6},
    "mixed": {"repeat_penalty": 1.3, "frequency_penalty": 0.4, "presence_penalty": -1.5},
}


@pytest.fixture(scope="module", autouse=True)
def _record_results() -> Any:
    yield
    record("distribution/near_ties", {"compared": LEDGER.compared, "near_ties": LEDGER.near_ties})
    dump_results()


class Tiny(Case):
    """The tiny f32 GGUF's Case (tests/support/engine.py), with its vocabulary size, mask token id and the JSON
    schema's grammar."""

    def __init__(self, ref: Any, gguf: Path) -> None:
        from clover_native.libclover import json_schema_to_grammar

        super().__init__(ref, gguf)
        self.n_vocab = self.model.info.n_vocab
        self.mask = self.model.info.mask_token_id
        self.grammar = json_schema_to_grammar(json.dumps(SCHEMA))

    def text(self, tokens: list[int]) -> str:
        return self.model.detokenize(tokens, special=False)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint: Path, tiny_model: Any, module_tmp: MkTemp) -> Tiny:
    return Tiny(tiny_model, clover_convert(tiny_checkpoint, module_tmp("dist") / "tiny-f32.gguf", "f32"))


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 3000, size=int(rng.integers(2, 20))).tolist() for _ in range(n)]


def _dense(lp: Any, n_vocab: int) -> np.ndarray:
    """A TokenLogprob's top list as a vector (-inf where absent)."""
    out = np.full(n_vocab, NINF, dtype=np.float32)
    for t, v in lp.top:
        out[t] = v
    return out


def _ar_margin(e: Tiny, prompt: list[int], ar: Any) -> Any:
    """margin(i) for Ledger.check_margin: ar's own top-2 gap at token i (log P differences are the adjusted logits'
    differences), and the parity tolerance REF_TOL * max(1, max|logit|) of that step's raw logits."""
    def margin(i: int) -> tuple[float, float]:
        _, tol = causal_gap(e.ref, prompt + ar.tokens[:i], None)
        if i >= len(ar.logprobs) or len(ar.logprobs[i].top) < 2:
            return math.inf, tol  # ar ended here (its end-of-generation decision has no logprobs): no near-tie
        top = ar.logprobs[i].top
        return top[0][1] - top[1][1], tol
    return margin


def _compare_modes(e: Tiny, name: str, prompt: list[int], opts: dict[str, Any], diffusion: bool) -> Any:
    """Greedy ar, then spec (two block sizes, with and without a draft step) and auto, and
    diffusion when it runs as auto (a grammar), each checked against ar with the near-tie rule."""
    ar = e.run(prompt, "ar", logprobs=2, **opts)
    margin = _ar_margin(e, prompt, ar)
    runs = {"spec/b8": e.run(prompt, "spec", block_size=8, **opts),
            "spec/b4/draft1": e.run(prompt, "spec", block_size=4, draft_steps=1, **opts),
            "auto": e.run(prompt, "auto", block_size=8, **opts)}
    if diffusion:
        runs["diffusion"] = e.run(prompt, "diffusion", block_size=8, threshold=0.5, **opts)
        assert runs["diffusion"].stats.mode == "auto" and runs["diffusion"].stats.auto_rounds, "named as it ran"
    for mode, r in runs.items():
        LEDGER.check_margin(f"{name}/{mode}", r.tokens, ar.tokens, margin)
    return ar, runs


# ------------------------------------------------------------------------------------------ greedy parity
@pytest.mark.parametrize("config", list(PENALTIES))
def test_penalties_keep_spec_and_auto_equal_to_ar(tiny: Tiny, config: str) -> None:
    """spec 4: `spec` and `auto` keep ar's distribution with penalties on, since verification counts the accepted
    drafts before each target exactly as ar does. Diffusion applies them too (not lossless: only run here)."""
    opts = PENALTIES[config] | {"max_tokens": 40, "stop_ids": []}
    changed = 0
    for k, prompt in enumerate(_prompts(4, seed=21)):
        ar, runs = _compare_modes(tiny, f"penalties/{config}/{k}", prompt, opts, diffusion=False)
        plain = tiny.run(prompt, "ar", max_tokens=40, stop_ids=[])
        changed += ar.tokens != plain.tokens
        assert len(tiny.run(prompt, "diffusion", block_size=8, threshold=0.5, **opts).tokens) == 40
    assert changed >= 2, f"{config}: the penalties changed too few outputs to test anything"


def test_logit_bias_keeps_spec_and_auto_equal_to_ar(tiny: Tiny) -> None:
    """A positive bias on a spread of tokens, -inf on others and on tokens of the unbiased output."""
    for k, prompt in enumerate(_prompts(4, seed=22)):
        plain = tiny.run(prompt, "ar", max_tokens=40, stop_ids=[]).tokens
        bias = {t: 2.5 for t in range(100, 3000, 97)} | {t: NINF for t in range(50, 3000, 41)}
        bias |= {plain[0]: NINF, plain[3]: NINF, plain[6]: 1.5}
        _compare_modes(tiny, f"bias/{k}", prompt, {"logit_bias": bias, "max_tokens": 40, "stop_ids": []},
                       diffusion=False)


@pytest.mark.parametrize("extra", ["grammar", "grammar+penalties+bias"])
def test_grammar_keeps_spec_auto_and_diffusion_equal_to_ar(tiny: Tiny, extra: str) -> None:
    """A grammar is enforced in verification (the drafts follow it, verification decides), so constrained spec and
    auto stay lossless; diffusion with a grammar runs as auto, so it equals ar too."""
    opts: dict[str, Any] = {"grammar": tiny.grammar, "max_tokens": 200}
    if extra != "grammar":  # a bias towards the ASCII tokens, and one letter banned
        (x,) = tiny.model.tokenize("x")
        opts |= PENALTIES["mixed"] | {"logit_bias": {t: 1.0 for t in range(30, 130)} | {x: NINF}}
    for k, prompt in enumerate(_prompts(3, seed=23)):
        ar, _ = _compare_modes(tiny, f"{extra}/{k}", prompt, opts, diffusion=True)
        assert ar.stats.stop_reason == "eos", ar.stats
        assert not validate(json.loads(tiny.text(ar.tokens)), SCHEMA)


# ------------------------------------------------------------------------------------------ the penalties' arithmetic
def _assert_same_dist(got: Any, want: np.ndarray, n_vocab: int, where: str) -> None:
    """The engine's full logprobs against the oracle's, to float32 rounding: each penalised logit is a few float32
    operations (the compiler may fuse n * frequency + presence into one FMA) and the log-softmax is rounded to float32
    once, so 8 float32 epsilons of the largest magnitude involved bound the difference (the parity tolerance of a
    logit is ~1e4 times larger: a wrong count or rule is far outside this)."""
    have = _dense(got, n_vocab)
    assert np.array_equal(np.isfinite(have), np.isfinite(want)), f"{where}: other tokens allowed"
    fin = np.isfinite(want)
    scale = max(1.0, float(np.abs(want[fin]).max()))
    diff = float(np.abs(have[fin] - want[fin]).max())
    assert diff <= 8 * F32_EPS * scale, f"{where}: logprobs differ from llama.cpp's rule by {diff:.3g}"
    assert got.token == int(np.argmax(np.where(fin, want, -np.inf))), f"{where}: not the oracle's argmax"


@pytest.mark.parametrize("config", ["repeat>1", "repeat<1", "presence", "frequency", "mixed"])
def test_penalty_arithmetic_in_ar(tiny: Tiny, config: str) -> None:
    """ar with the full vocabulary's logprobs: at step i, the raw logits of the same passes (prefill and one-token
    steps, replayed on a bindings context) with llama.cpp's rule over the counts of tokens[:i] (the response only,
    never the prompt), renormalised, give the engine's distribution."""
    from clover_native import bindings

    pen = {"repeat>1": (1.3, 0.0, 0.0), "repeat<1": (0.6, 0.0, 0.0), "presence": (1.0, 0.0, -2.0),
           "frequency": (1.0, 0.8, 0.0), "mixed": (1.3, 0.4, -1.5)}[config]
    e, V = tiny, tiny.n_vocab
    llama = bindings.LlamaModel(e.gguf)
    try:
        for k, prompt in enumerate(_prompts(2, seed=31)):
            r = e.run(prompt, "ar", max_tokens=24, stop_ids=[], logprobs=V, repeat_penalty=pen[0],
                      frequency_penalty=pen[1], presence_penalty=pen[2])
            assert len(r.logprobs) == len(r.tokens) == 24
            ctx = bindings.Context(llama, n_ctx=1024, n_ubatch=64, n_threads=e.model.n_threads)
            try:
                if len(prompt) > 1:
                    ctx.causal(prompt[:-1])
                prev = prompt[-1]
                for i, lp in enumerate(r.logprobs):
                    raw = ctx.causal([prev])[0]
                    counts = np.bincount(np.asarray(r.tokens[:i], dtype=np.int64), minlength=V)
                    _assert_same_dist(lp, penalised_logprobs(raw, counts, *pen, [e.mask]), V, f"{config}/{k}/token {i}")
                    prev = r.tokens[i]
            finally:
                ctx.close()
    finally:
        llama.close()


def test_the_prompt_is_not_counted(tiny: Tiny) -> None:
    """A presence penalty of 50 would move every prompt token's logit by 50 if the prompt counted: the first token's
    distribution equals the unpenalised one bit for bit, and later a token only in the prompt stays unpenalised."""
    V = tiny.n_vocab
    prompt = [5, 9, 5, 9, 17, 1200, 1201, 5]
    pen = tiny.run(prompt, "ar", max_tokens=6, stop_ids=[], logprobs=V, presence_penalty=50.0)
    plain = tiny.run(prompt, "ar", max_tokens=1, stop_ids=[], logprobs=V)
    assert pen.logprobs[0].top == plain.logprobs[0].top
    assert pen.logprobs[0].token == plain.logprobs[0].token
    # at the last step the response's tokens are 50 lower; a token only in the prompt is not
    last = _dense(pen.logprobs[-1], V)
    assert all(last[t] < -40.0 for t in pen.tokens[:-1])
    for t in set(prompt) - set(pen.tokens[:-1]):
        assert last[t] > -40.0, f"prompt token {t} looks penalised: {last[t]}"


def test_penalty_arithmetic_in_a_diffusion_window(tiny: Tiny) -> None:
    """Inside a window the targets known at the start of the step, at earlier positions, count too (spec 4), besides
    the committed response. threshold 1 fills one target per step; each target's logprobs (diffusion: the step that
    filled it) equal the rule applied to a replayed block pass with those counts."""
    from clover_native import bindings

    e, V, B = tiny, tiny.n_vocab, 4
    pen = (1.3, 0.4, -1.5)
    for prompt in _prompts(2, seed=32):
        canvases: list[list[int]] = []
        r = e.run(prompt, "diffusion", block_size=B, threshold=1.0, max_tokens=3 * B, stop_ids=[], logprobs=V,
                  repeat_penalty=pen[0], frequency_penalty=pen[1], presence_penalty=pen[2], on_step=canvases.append)
        assert len(canvases) == 3 * B and len(r.logprobs) == 3 * B
        llama = bindings.LlamaModel(e.gguf)
        ctx = bindings.Context(llama, n_ctx=1024, n_ubatch=64, n_threads=e.model.n_threads)
        try:
            if len(prompt) > 1:
                ctx.causal(prompt[:-1])
            seed, committed, step = prompt[-1], [], 0
            for block in range(3):
                canvas = [e.mask] * B
                for _ in range(B):
                    after = canvases[step]
                    step += 1
                    masked = [j for j in range(B) if canvas[j] == e.mask]
                    (j,) = [j for j in masked if after[j] != e.mask]
                    raw = ctx.block([seed] + canvas[:B - 1], rows=masked)[masked.index(j)]  # the engine's rows
                    known = [t for t in canvas[:j] if t != e.mask]
                    counts = np.bincount(np.asarray(committed + known, dtype=np.int64), minlength=V)
                    _assert_same_dist(r.logprobs[block * B + j], penalised_logprobs(raw, counts, *pen, [e.mask]), V,
                                      f"block {block} target {j}")
                    canvas = after
                ctx.causal([seed] + canvas[:B - 1])  # the commit
                seed = canvas[B - 1]
                committed += canvas
            assert committed == r.tokens
        finally:
            ctx.close()
            llama.close()


# ------------------------------------------------------------------------------------------ logit_bias
MODES = ("ar", "spec", "auto", "diffusion")


def test_minus_inf_bias_is_never_emitted(tiny: Tiny) -> None:
    for prompt in _prompts(2, seed=41):
        plain = tiny.run(prompt, "ar", max_tokens=30, stop_ids=[]).tokens
        banned = set(plain) | set(range(0, 3000, 7))
        for mode in MODES:
            for temp, seed in ((0.0, 0), (0.8, 3)):
                r = tiny.run(prompt, mode, max_tokens=30, stop_ids=[], temperature=temp, seed=seed, block_size=8,
                             logit_bias={t: NINF for t in banned})
                assert len(r.tokens) == 30 and not banned & set(r.tokens), (mode, temp, r.tokens)


def test_a_large_bias_forces_its_token(tiny: Tiny) -> None:
    prompt = _prompts(1, seed=42)[0]
    for mode in MODES:
        for temp, seed in ((0.0, 0), (0.8, 5)):
            r = tiny.run(prompt, mode, max_tokens=20, stop_ids=[], temperature=temp, seed=seed, block_size=8,
                         logit_bias={1234: 100.0})
            assert r.tokens == [1234] * 20, (mode, temp, r.tokens)


def test_bias_that_leaves_nothing_is_an_error(tiny: Tiny) -> None:
    from clover_common.errors import BadInput

    from clover_cpp import EngineError

    # diffusion: a block target's choice is common's (common_block_diffusion_step), which finds no token either; the
    # engine's own step used to emit one of the banned ids
    for mode in ("ar", "diffusion"):
        with pytest.raises((EngineError, BadInput), match="no token"):
            tiny.run([1, 2, 3], mode, max_tokens=3, block_size=4, logit_bias={t: NINF for t in range(tiny.n_vocab)})
        assert tiny.run([1, 2, 3], mode, max_tokens=3, block_size=4, stop_ids=[]).tokens  # still usable


# ------------------------------------------------------------------------------------------ logprobs
def _check_top(lp: Any, where: str) -> None:
    values = [v for _, v in lp.top]
    assert all(v <= 0.0 for v in values) and lp.logprob <= 0.0, where
    assert all(a >= b for a, b in zip(values, values[1:])), f"{where}: top list not sorted"
    assert dict(lp.top).get(lp.token, lp.logprob) == lp.logprob, where


def test_logprobs_are_spec4_p_in_every_mode(tiny: Tiny) -> None:
    """Greedy ar, spec and auto give the same log P per token (to the parity tolerance of a logit, doubled in log
    space: the normaliser moves too), with penalties and bias on; the top list is sorted, its first entry is the
    greedy token, and the full list sums to 1 without the mask token, the banned ids and the -inf biases."""
    import torch

    V = tiny.n_vocab
    banned = [7, 8]
    opts = {"max_tokens": 30, "stop_ids": [], "banned_ids": banned, "logit_bias": {11: NINF, 12: 3.0},
            **PENALTIES["mixed"]}
    for k, prompt in enumerate(_prompts(3, seed=51)):
        runs = {"ar": tiny.run(prompt, "ar", logprobs=V, **opts),
                "spec": tiny.run(prompt, "spec", block_size=8, logprobs=V, **opts),
                "auto": tiny.run(prompt, "auto", block_size=8, logprobs=5, **opts)}
        ar = runs["ar"]
        with torch.no_grad():
            rows = tiny.ref.forward_causal(prompt + ar.tokens, tiny.ref.new_history())[len(prompt) - 1:]
        for mode, r in runs.items():
            assert r.logprobs is not None and len(r.logprobs) == len(r.tokens), mode
            LEDGER.check_margin(f"logprobs/{mode}/{k}", r.tokens, ar.tokens, _ar_margin(tiny, prompt, ar))
            for i, (lp, token) in enumerate(zip(r.logprobs, r.tokens)):
                where = f"{mode}/{k}/token {i}"
                assert lp.token == token and lp.top[0][0] == token, where
                _check_top(lp, where)
                if mode != "auto":  # the full list
                    assert len(lp.top) == V - 1 - len(banned) - 1, where
                    assert not {tiny.mask, *banned, 11} & {t for t, _ in lp.top}, where
                    assert abs(float(np.exp(np.array([v for _, v in lp.top], dtype=np.float64)).sum()) - 1) < 1e-5
                else:
                    assert len(lp.top) == 5, where
            for i, (a, b) in enumerate(zip(ar.logprobs, r.logprobs)):
                if a.token != b.token:
                    break  # a near-tie, checked above
                tol = 2 * REF_TOL * max(1.0, float(rows[i].abs().max()))
                assert abs(a.logprob - b.logprob) <= tol, (mode, k, i, a.logprob, b.logprob)


def test_logprobs_when_sampling_and_in_diffusion(tiny: Tiny) -> None:
    """A sampled token's logprob is its log P (temperature 1, spec 4), not the sampling distribution's; diffusion
    gives one entry per token, from the step that filled it. k = 0: no alternatives."""
    V = tiny.n_vocab
    prompt = _prompts(1, seed=52)[0]
    greedy = _dense(tiny.run(prompt, "ar", max_tokens=1, stop_ids=[], logprobs=V).logprobs[0], V)
    tol = 2 * causal_gap(tiny.ref, prompt, None)[1]  # batched and one-token passes round differently
    for mode in MODES:
        r = tiny.run(prompt, mode, max_tokens=17, stop_ids=[], temperature=0.7, top_k=40, seed=9, block_size=8,
                     logprobs=V)
        assert [lp.token for lp in r.logprobs] == r.tokens, mode
        for i, lp in enumerate(r.logprobs):
            _check_top(lp, f"{mode}/{i}")
            assert dict(lp.top)[lp.token] == lp.logprob
        if mode != "diffusion":  # the first token's P is greedy ar's, whatever the temperature and top-k
            first = _dense(r.logprobs[0], V)
            assert (first == greedy).all() if mode == "ar" else np.allclose(first, greedy, rtol=0, atol=tol), mode
    none = tiny.run(prompt, "diffusion", max_tokens=9, stop_ids=[], block_size=4, logprobs=0)
    assert len(none.logprobs) == 9 and all(lp.top == () and lp.logprob <= 0 for lp in none.logprobs)
    assert tiny.run(prompt, "ar", max_tokens=3, stop_ids=[]).logprobs is None


# ------------------------------------------------------------------------------------------ grammar
@pytest.mark.parametrize("mode", MODES)
def test_grammar_output_matches_the_schema(tiny: Tiny, mode: str) -> None:
    """JSON schema -> GBNF (llama.cpp's converter): the output parses and validates in every mode, greedy and
    sampled, unless it ran out of tokens."""
    done = 0
    for prompt in _prompts(2, seed=61):
        for temp, seed in ((0.0, 0), (0.8, 1), (0.8, 2), (0.8, 3)):
            r = tiny.run(prompt, mode, grammar=tiny.grammar, temperature=temp, seed=seed, block_size=8,
                         max_tokens=200)
            if r.stats.stop_reason == "length":
                continue
            assert r.stats.stop_reason == "eos", r.stats.stop_reason
            text = tiny.text(r.tokens)
            assert not validate(json.loads(text), SCHEMA), text
            done += 1
    assert done >= 6, f"{mode}: only {done} of 8 runs ended before their budget"


def test_grammar_errors(tiny: Tiny) -> None:
    """An invalid grammar is refused by check_grammar (BadInput) and by a run, with the same message; so is one that
    allows no token at its start. A dead end (nothing allowed after some tokens) ends the run with an error that
    says so, and the engine stays usable."""
    from clover_common.errors import BadInput

    from clover_cpp.model import GrammarDeadEnd

    m = tiny.model
    for bad, needle in (("root ::= foo", "rejected"), ("root ::= [", "rejected"), ('x ::= "a"', "'root'"),
                        ('root ::= "\\u0000"', "allows no token")):
        with pytest.raises(BadInput, match=needle) as checked:
            m.check_grammar(bad)
        assert str(checked.value).startswith("grammar: ")
        for mode in ("ar", "diffusion"):
            # a run refuses it before it prefills, as the caller's fault
            with pytest.raises(BadInput) as ran:
                tiny.run([1, 2, 3], mode, grammar=bad, max_tokens=4)
            assert needle in str(ran.value) and str(ran.value).startswith("grammar: "), str(ran.value)
    m.check_grammar(tiny.grammar)
    # "a" then "b", with every token holding a "b" banned: nothing can follow the first token
    pieces = [m.token_piece(t) for t in range(tiny.n_vocab)]
    no_b = {t: NINF for t, piece in enumerate(pieces) if b"b" in piece}
    for mode in MODES:
        with pytest.raises(GrammarDeadEnd, match="grammar allows no token"):
            tiny.run([1, 2, 3], mode, grammar='root ::= "a" "b"', logit_bias=no_b, max_tokens=8, block_size=4)
        assert m.n_past == 0  # reset after the failure
    assert tiny.text(tiny.run([1, 2, 3], "ar", grammar='root ::= "a" "b"', max_tokens=8).tokens) == "ab"


def test_grammar_root_names_the_start_symbol(tiny: Tiny) -> None:
    """The C API's grammar_root: the start symbol, which libclover passes to llama.cpp's grammar sampler (through
    common_sampler's grammar_root for a call); NULL or "" = "root". A grammar whose root rule allows nothing at its
    start is accepted when it starts at another rule, and a start the grammar does not define is refused."""
    from clover_native import libclover

    def check(grammar: str, root: str | None) -> str:
        err = ctypes.create_string_buffer(1024)
        rc = libclover.lib().clover_engine_check_grammar(tiny.model._engine(), grammar.encode(),
                                                         None if root is None else root.encode(), err, len(err))
        assert (rc == 0) == (err.value == b""), (rc, err.value)
        return err.value.decode()

    assert check('value ::= "a" | "b"', "value") == ""
    assert check('value ::= "a" | "b"', "") == check('value ::= "a" | "b"', None)
    assert "'root'" in check('value ::= "a" | "b"', None)
    assert check('root ::= value\nvalue ::= "a"', None) == ""
    assert check('root ::= value\nvalue ::= "a"', "root") == ""
    closed = 'root ::= "\\u0000"\nvalue ::= "a"'  # root allows no token at its start, value does
    assert "allows no token" in check(closed, None)
    assert check(closed, "value") == ""
    assert "'other'" in check('value ::= "a"', "other")


def test_a_constrained_text_is_whole_utf8_characters(tiny: Tiny, tiny_checkpoint: Path) -> None:
    """Under a grammar the text is well-formed UTF-8, by llama.cpp's grammar alone (the engine's own UTF-8 decoder is
    gone): it refuses a byte that begins no character and a lead byte's wrong continuation (patch
    grammar-utf8-well-formed), and it has no ended stack while a character is half written, so an end-of-generation
    token waits for the character's last byte. The grammar allows any string. Biased stray continuation byte B8 >
    end, the text is empty; biased lead byte E4 > end > B8, it grows by whole characters E4 B8 B8 and never ends
    inside one, in every mode."""
    from tokenizers import Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    letter = bytes_to_unicode()
    lead, cont, end = vocab.token_to_id(letter[0xE4]), vocab.token_to_id(letter[0xB8]), vocab.token_to_id("<|im_end|>")
    assert None not in (lead, cont, end)
    prompt = _prompts(1, seed=44)[0]
    for mode in MODES:
        stray = tiny.run(prompt, mode, max_tokens=9, block_size=8, grammar='root ::= [^"]*',
                         logit_bias={cont: 300.0, end: 200.0})
        assert stray.tokens == [], (mode, stray.tokens)
        r = tiny.run(prompt, mode, max_tokens=9, block_size=8, grammar='root ::= [^"]*',
                     logit_bias={lead: 300.0, end: 200.0, cont: 100.0})
        assert r.tokens == [lead, cont, cont] * 3, (mode, r.tokens)


def test_grammar_after_ids(tiny: Tiny) -> None:
    """grammar_after_ids: the tokens up to the first trigger are unconstrained (ar's own), the text after it matches
    the grammar; a trigger that never comes leaves the whole response unconstrained."""
    prompt = _prompts(1, seed=71)[0]
    plain = tiny.run(prompt, "ar", max_tokens=30, stop_ids=[]).tokens
    k = next(i for i in range(3, 30) if plain[i] not in plain[:i])
    trigger = plain[k]
    grammar = 'root ::= "{" [a-z]{1,5} "}"'
    ar = tiny.run(prompt, "ar", grammar=grammar, grammar_after_ids=[trigger], max_tokens=40, logprobs=2)
    assert ar.tokens[:k + 1] == plain[:k + 1], "tokens before the trigger are constrained"
    for mode in MODES:
        r = ar if mode == "ar" else tiny.run(prompt, mode, grammar=grammar, grammar_after_ids=[trigger],
                                             max_tokens=40, block_size=8)
        LEDGER.check_margin(f"grammar_after/{mode}", r.tokens, ar.tokens, _ar_margin(tiny, prompt, ar))
        assert r.stats.stop_reason == "eos", (mode, r.tokens)
        tail = tiny.text(r.tokens[r.tokens.index(trigger) + 1:])
        assert tail.startswith("{") and tail.endswith("}") and tail[1:-1].isalpha() and len(tail) <= 7, tail
    never = tiny.run(prompt, "ar", grammar=grammar, grammar_after_ids=[3006], max_tokens=30, stop_ids=[])
    assert 3006 not in plain and never.tokens == plain


# ------------------------------------------------------------------------------------------ the GGUF's defaults
def _with_keys(src: Path, dst: Path, keys: dict[str, tuple[int, Any]]) -> Path:
    """A copy of a GGUF with keys added or replaced ({key: (gguf value type, value)})."""
    from tests.support import fuzz_gguf as fg

    g = fg.parse(src.read_bytes())
    g.kvs = [kv for kv in g.kvs if kv.key not in keys] + [fg.KV(k, t, v) for k, (t, v) in keys.items()]
    dst.write_bytes(fg.serialize(g))
    return dst


@pytest.mark.parametrize("prefix,present,freq", [
    ("general.sampling.", "penalty_present", "penalty_freq"),
    ("clover_moe.sampling.", "presence_penalty", "frequency_penalty"),  # files converted before the general keys
])
def test_gguf_default_penalties(tiny: Tiny, tmp_path: Path, prefix: str, present: str, freq: str) -> None:
    """general.sampling.penalty_repeat, _penalty_present and _penalty_freq (or an older file's
    ARCH.sampling.presence_penalty and ARCH.sampling.frequency_penalty) are the defaults of a call that leaves the
    penalties None: the same output as passing them; a call's own value wins."""
    from tests.support.fuzz_gguf import F32

    from clover_cpp import Model

    keys = {"general.sampling.penalty_repeat": (F32, 0.7), prefix + present: (F32, -2.0), prefix + freq: (F32, 0.3)}
    path = _with_keys(tiny.gguf, tmp_path / "pen.gguf", keys)
    V = tiny.n_vocab
    with Model(path, n_ctx=256, max_block_size=8) as m:
        info = m.info
        assert (info.repeat_penalty, info.presence_penalty, info.frequency_penalty) == pytest.approx((0.7, -2.0, 0.3))
        prompt = _prompts(1, seed=81)[0]
        for mode in ("ar", "diffusion"):
            m.reset()
            default = m.run(prompt, mode=mode, max_tokens=24, stop_ids=[], logprobs=V, block_size=8)
            m.reset()
            explicit = m.run(prompt, mode=mode, max_tokens=24, stop_ids=[], logprobs=V, block_size=8,
                             repeat_penalty=0.7, presence_penalty=-2.0, frequency_penalty=0.3)
            m.reset()
            off = m.run(prompt, mode=mode, max_tokens=24, stop_ids=[], block_size=8, repeat_penalty=1.0,
                        presence_penalty=0.0, frequency_penalty=0.0)
            assert default.tokens == explicit.tokens and default.logprobs == explicit.logprobs, mode
            assert off.tokens == tiny.run(prompt, mode, max_tokens=24, stop_ids=[], block_size=8).tokens, mode
            assert off.tokens != default.tokens, f"{mode}: the GGUF's penalties changed nothing"


def test_converted_penalties_are_the_engine_defaults(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """clover-convert writes generation_config.json's penalties where the engine reads its defaults."""
    import shutil

    from clover_native import libclover

    model = Path(shutil.copytree(tiny_checkpoint, tmp_path / "model"))
    (model / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.25, "presence_penalty": 0.5,
                                                             "frequency_penalty": -0.75}))
    for extra in ((), ("--bd-sidecar",)):
        out = clover_convert(model, tmp_path / f"m{len(extra)}.gguf", "f32", *extra)
        info = libclover.read_model_info(str(out))
        assert (info.repeat_penalty, info.presence_penalty, info.frequency_penalty) == (1.25, 0.5, -0.75), extra


@pytest.mark.parametrize("key,value", [
    ("general.sampling.penalty_repeat", 0.0),
    ("general.sampling.penalty_repeat", -1.0),
    ("clover_moe.sampling.presence_penalty", math.inf),
    ("general.sampling.penalty_present", math.nan),
    ("clover_moe.sampling.frequency_penalty", math.nan),
    ("clover_moe.sampling.frequency_penalty", "0.5"),
])
def test_invalid_gguf_penalty_is_refused(tiny: Tiny, tmp_path: Path, key: str, value: Any) -> None:
    from tests.support.fuzz_gguf import F32, STR

    from clover_native import libclover
    from clover_cpp import EngineError, Model
    from clover_native.loader import NativeError

    path = _with_keys(tiny.gguf, tmp_path / "bad.gguf", {key: (STR if isinstance(value, str) else F32, value)})
    with pytest.raises(NativeError, match=key.replace(".", r"\.")):
        libclover.read_model_info(str(path))
    with pytest.raises(EngineError, match=key.replace(".", r"\.")):
        Model(path, n_ctx=64)


# ------------------------------------------------------------------------------------------ last: the budget
def test_near_tie_budget() -> None:
    """At most 1 in 20 compared cases may end at a near-tie (runs after the comparisons of this module; _record_results
    records them)."""
    assert LEDGER.compared > 0
    LEDGER.assert_budget()
