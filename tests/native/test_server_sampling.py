"""llama-server's sampler chain on a Clover GGUF (spec 4.5), through its HTTP API and against the engine:

- the GGUF's penalties are llama-server's defaults and count the response only, all of it, as the engine's do
  (spec 4), so a request that sets none gets the engine's greedy tokens; a request can turn that off;
- the mask token is never sampled, whatever a request's logit_bias says;
- the engine draws with the same chain (common_sampler), so a seed gives `clover-cpp generate`, the Python `Model`
  and llama-server the same sampled tokens wherever their passes have the same shapes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from clover_dev import REPO_ROOT
from clover_dev.convert import clover_convert
from tests.support.engine import FLASH_ATTN_TOL, Ledger, penalised_logprobs
from tests.support.native import llama_server
from tests.support.serve import emitted_tokens, get, post
from tests.support.tmp import MkTemp

pytestmark = pytest.mark.native

DEMO = REPO_ROOT / "models" / "clover-demo"
PENALTIES = {"repetition_penalty": 1.3, "presence_penalty": 0.6, "frequency_penalty": 0.25}
# code the answer would quote: llama.cpp's default counts these prompt tokens, Clover's penalties do not
PROMPTS = ["def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n",
           "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
           "        self.items.append(item)\n\n"]
N_PREDICT = 96  # past llama.cpp's default window of 64 tokens
SERVER_ARGS = ("-c", "1024", "-np", "1", "-t", "2", "--no-warmup")


@pytest.fixture(scope="module")
def penalised_demo(module_tmp: MkTemp) -> Path:
    """The demo model with a generation_config.json that sets all three penalties, as an f32 GGUF."""
    where = module_tmp("penalised")
    model = Path(shutil.copytree(DEMO, where / "model"))
    (model / "generation_config.json").write_text(json.dumps(PENALTIES))
    return clover_convert(model, where / "demo-penalised.gguf", "f32")


def complete(url: str, prompt: list[int], **fields: Any) -> list[int]:
    status, answer = post(url + "/completion", {"prompt": prompt, "n_predict": N_PREDICT, "temperature": 0.0,
                                                "return_tokens": True, "cache_prompt": False, **fields})
    assert status == 200, answer
    return emitted_tokens(answer)


def penalised_gap(ref: Any, context: list[int], response: list[int], tol: float) -> tuple[float, float]:
    """(top-2 gap, tolerance) of the reference's next token after context + response, under spec 4's penalties
    with the response's tokens counted (llama.cpp's rule, as the engine and the penalties sampler apply it)."""
    with torch.no_grad():
        row = ref.forward_causal(context + response, ref.new_history())[-1].numpy()
    counts = np.bincount(np.array(response, dtype=np.int64), minlength=len(row))[: len(row)]
    logp = penalised_logprobs(row, counts, PENALTIES["repetition_penalty"], PENALTIES["frequency_penalty"],
                              PENALTIES["presence_penalty"], [ref.config.mask_token_id])
    top2 = np.sort(logp)[-2:]
    return float(top2[1] - top2[0]), tol * max(1.0, float(np.abs(row).max()))


def test_the_gguf_penalties_count_the_response_in_llama_server_as_in_the_engine(penalised_demo: Path) -> None:
    """A request that sets no penalty gets the GGUF's, over the response only and with no window: the engine's
    greedy `ar` tokens (near-tie rule). The same values over the prompt and a 64-token window (llama.cpp's
    default, `penalty_response_only: false`) give other tokens, so the comparison can fail."""
    from clover_cpp import Model
    from clover_ref.checkpoint import load_model

    ref = load_model(DEMO)
    ledger = Ledger(rel_tol=FLASH_ATTN_TOL)
    with Model(penalised_demo, n_ctx=1024) as m:
        info = m.info
        assert (info.repeat_penalty, info.presence_penalty, info.frequency_penalty) == pytest.approx(
            (1.3, 0.6, 0.25))
        prompts = [m.tokenize(p) for p in PROMPTS]
        engine = []
        for prompt in prompts:
            m.reset()
            engine.append(m.run(prompt, mode="ar", max_tokens=N_PREDICT).tokens)
    changed = 0
    with llama_server(penalised_demo, *SERVER_ARGS) as url:
        defaults = get(url + "/props")["default_generation_settings"]["params"]
        assert defaults["penalty_response_only"] is True and defaults["repeat_last_n"] == -1, defaults
        assert (defaults["repeat_penalty"], defaults["presence_penalty"], defaults["frequency_penalty"]) == \
            pytest.approx((1.3, 0.6, 0.25)), defaults
        for k, (prompt, want) in enumerate(zip(prompts, engine)):
            got = complete(url, prompt)
            ledger.check_margin(f"penalised/{k}", got, want,
                                lambda i, w=want, c=prompt: penalised_gap(ref, c, w[:i], FLASH_ATTN_TOL))
            llama_default = complete(url, prompt, penalty_response_only=False, repeat_last_n=64)
            changed += llama_default != got
    ledger.assert_budget()
    assert changed > 0, "counting the prompt changed no answer: the test cannot tell the two rules apart"


def test_llama_server_never_samples_the_mask_token(demo_gguf: Path) -> None:
    """common_sampler bans the vocabulary's mask token (tokenizer.ggml.mask_token_id): a request that biases it
    above every other token still never gets it, greedy or sampled, while the same bias on an ordinary token
    makes that token the answer."""
    from clover_cpp import Model

    with Model(demo_gguf, n_ctx=256) as m:
        mask = m.info.mask_token_id
        prompt = m.tokenize(PROMPTS[0])
    other = 100 if mask != 100 else 101
    with llama_server(demo_gguf, *SERVER_ARGS) as url:
        for temperature in (0.0, 1.0):
            got = complete(url, prompt, n_predict=8, temperature=temperature, seed=7, logit_bias=[[mask, 1e4]])
            assert mask not in got, (temperature, got)
        assert complete(url, prompt, n_predict=8, logit_bias=[[other, 1e4]]) == [other] * 8


@pytest.mark.parametrize("fields,name", [
    ({"repeat_last_n": -2}, "repeat_last_n"),  # -1 is "all of them", below that nothing
    ({"penalty_response_only": "yes"}, "penalty_response_only"),
])
def test_bad_penalty_fields_get_a_400_naming_the_field(demo_gguf: Path, fields: dict[str, Any], name: str) -> None:
    with llama_server(demo_gguf, *SERVER_ARGS) as url:
        status, answer = post(url + "/completion", {"prompt": "def f(x):\n", "n_predict": 4, **fields})
        assert status == 400 and answer["error"]["type"] == "invalid_request_error", answer
        assert f"'{name}'" in answer["error"]["message"], answer
        # the values the patch added are accepted
        status, answer = post(url + "/completion", {"prompt": "def f(x):\n", "n_predict": 4, "repeat_last_n": -1,
                                                    "penalty_response_only": True})
        assert status == 200, answer


# the chain spec 4.5 describes, in llama-server's request form: the penalties, then temperature, top-k and top-p (no
# min-p; a chain without "penalties" has no penalties sampler)
SAMPLED = {"temperature": 0.8, "top_k": 20, "top_p": 0.9}
SAMPLED_REQUEST = {**SAMPLED, "min_p": 0.0, "samplers": ["penalties", "temperature", "top_k", "top_p"]}
SEEDS = (1, 2, 3)


def sampled_engine(gguf: Path, mode: str, prompts: list[str], n: int,
                   **fields: Any) -> dict[tuple[int, int], list[int]]:
    """The engine's sampled tokens through the Python API, (prompt index, seed) -> tokens."""
    from clover_cpp import Model

    out = {}
    with Model(gguf, n_ctx=1024) as m:
        for k, prompt in enumerate(prompts):
            for seed in SEEDS:
                m.reset()
                out[(k, seed)] = m.run(m.tokenize(prompt), mode=mode, max_tokens=n, seed=seed, **SAMPLED,
                                       **fields).tokens
    return out


def sampled_server(url: str, prompts: list[str], n: int, **fields: Any) -> dict[tuple[int, int], list[int]]:
    out = {}
    for k, prompt in enumerate(prompts):
        for seed in SEEDS:
            status, answer = post(url + "/completion", {"prompt": prompt, "n_predict": n, "seed": seed,
                                                        "return_tokens": True, "cache_prompt": False,
                                                        **SAMPLED_REQUEST, **fields})
            assert status == 200, answer
            out[(k, seed)] = emitted_tokens(answer)
    return out


@pytest.mark.parametrize("mode,server_args,fields", [
    ("ar", (), {}),
    ("spec", ("--spec-type", "draft-clover"), {}),
    ("diffusion", (), {"mode": "diffusion"}),
], ids=["ar-plain", "spec-draft-clover", "diffusion"])
def test_a_seed_draws_the_same_tokens_in_the_engine_and_in_llama_server(penalised_demo: Path, mode: str,
                                                                       server_args: tuple[str, ...],
                                                                       fields: dict[str, Any]) -> None:
    """The engine draws from Q with llama.cpp's chain (logit bias, temperature, top-k, top-p, then `dist` seeded with
    the call's seed: one number per drawn token), the chain llama-server builds for the request. Where both sides run
    passes of the same shapes (`ar` steps and plain llama-server; `spec` and `--spec-type draft-clover`, whose block
    pass and verification are spec's; a diffusion block's steps), the logits are the same numbers, so every sampled
    token agrees, with the GGUF's penalties on (counted over the response on both sides, and over a diffusion
    window's known targets). A sampled acceptance is llama-server's: a draft is kept when the draw equals it. The
    engine's earlier sampler (its own RNG) failed the `ar` case; sampled `auto` and `spec` against `ar` keep the
    distribution, not the draws (tests/engine/test_auto.py), since their rows are batched differently."""
    engine = sampled_engine(penalised_demo, mode, PROMPTS, N_PREDICT)
    with llama_server(penalised_demo, *SERVER_ARGS, *server_args) as url:
        server = sampled_server(url, PROMPTS, N_PREDICT, **fields)
    differ = {key: (server[key], engine[key]) for key in engine if server[key] != engine[key]}
    assert not differ, differ
    assert len({tuple(t) for t in engine.values()}) == len(engine), "two seeds gave one text: the seed is not used"


# Python-like lines with lower-case names only: the demo model's likelier tokens after these prompts (capitals,
# digits, other punctuation) are often outside it, so top-k and top-p see other candidates with the grammar applied
# first than without
LINES_GRAMMAR = r'''root ::= line+
line ::= "    "? [a-z_]+ [a-z_ (),.=:+-]* "\n"'''


@pytest.mark.parametrize("mode,server_args", [("ar", ()), ("spec", ("--spec-type", "draft-clover"))],
                         ids=["ar-plain", "spec-draft-clover"])
def test_a_seed_draws_the_same_tokens_under_a_grammar_with_grammar_first(penalised_demo: Path, mode: str,
                                                                         server_args: tuple[str, ...]) -> None:
    """Spec 4 puts the grammar in P: the engine masks, then draws through temperature, top-k and top-p
    (common_sampler's grammar_first). llama-server draws first and masks only after a refused draw unless a request
    sets `grammar_first` (patch sampling-grammar-first-option); with it, a seed gives the engine's tokens under a
    grammar, and the field shows in the response's settings. Without it, the draws differ for some seed here: the
    grammar changes which candidates the truncation keeps, so the test's grammar does constrain these draws."""
    n = 48
    engine = sampled_engine(penalised_demo, mode, PROMPTS, n, grammar=LINES_GRAMMAR)
    with llama_server(penalised_demo, *SERVER_ARGS, *server_args) as url:
        first = sampled_server(url, PROMPTS, n, grammar=LINES_GRAMMAR, grammar_first=True)
        default = sampled_server(url, PROMPTS, n, grammar=LINES_GRAMMAR)
        status, answer = post(url + "/completion", {"prompt": PROMPTS[0], "n_predict": 1, "grammar_first": True})
    assert status == 200 and answer["generation_settings"]["grammar_first"] is True, answer
    differ = {key: (first[key], engine[key]) for key in engine if first[key] != engine[key]}
    assert not differ, differ
    assert any(default[key] != engine[key] for key in engine), "the grammar never changed a draw: the test is void"


def test_clover_cpp_generate_samples_llama_servers_tokens(demo_gguf: Path) -> None:
    """`clover-cpp generate --mode ar` with a seed prints llama-server's tokens for the same request."""
    n = 32
    with llama_server(demo_gguf, *SERVER_ARGS) as url:
        server = sampled_server(url, PROMPTS[:1], n, repeat_penalty=1.0)
    for seed in SEEDS:
        done = subprocess.run([sys.executable, "-m", "clover_cpp.cli", "generate", "-m", str(demo_gguf), "-p",
                               PROMPTS[0], "--mode", "ar", "-n", str(n), "--temp", str(SAMPLED["temperature"]),
                               "--top-k", str(SAMPLED["top_k"]), "--top-p", str(SAMPLED["top_p"]), "-s", str(seed),
                               "--repeat-penalty", "1", "-c", "1024", "--json"],
                              capture_output=True, text=True, cwd=str(REPO_ROOT), timeout=300)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["tokens"] == server[(0, seed)], seed
