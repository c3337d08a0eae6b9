"""draft-clover: Clover's block pass as a drafter of llama.cpp's own speculative framework (docs/decoding.md,
"draft-clover in llama.cpp"), driven through llama-server's HTTP API and llama-speculative-simple.

- Lossless: greedy completions with ``--spec-type draft-clover`` and ``ngram-mod,draft-clover`` equal the same
  server's greedy completions without speculation (llama.cpp's ``ar``) token for token, or diverge first at a
  near-tie of the PyTorch reference (tests/support/engine.py). Models: the tiny random one, the trained demo one and a
  checkpoint that transformers itself wrote (tests/support/handmade.py); with a grammar on and off (the near-tie
  measured among the tokens the grammar allows).
- The drafts are real: the server reports drafted tokens, and on the trained demo model accepted ones.
- A GGUF without the block-diffusion tensors runs without the drafter, and the log says why.
- At a context's end: a slot's block window stays inside its share of the unified cache (two slots), and the round
  that reaches the end emits every token it accepted (draft-clover and ngram-mod).
- llama-speculative-simple (the framework's reference loop) with draft-clover gives llama-server's greedy text, and
  with ngram-mod,draft-clover on code that repeats, where ngram-mod's drafts (48-64 tokens) outrun the recurrent
  rollback that draft-clover sizes (B - 1) and a rejection needs a checkpoint.
- `clover-cpp generate --mode auto`, which drafts with the same drafters from libclover's loop, gives llama-server's
  greedy tokens on the demo model and on the transformers-written checkpoint, with a grammar on and off.
- Sampled: the emitted tokens' distribution is the one without speculation (a chi-square test whose power it
  states and checks).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from clover_dev import REPO_ROOT
from clover_dev.convert import clover_convert
from tests.support.engine import FLASH_ATTN_TOL, REF_TOL, Ledger, causal_gap
from tests.support.homogeneity import homogeneity
from tests.support.native import llama_server, native_tool
from tests.support.serve import post
from tests.support.tmp import MkTemp

pytestmark = pytest.mark.native

DEMO = REPO_ROOT / "models" / "clover-demo"
SPEC_TYPES = ("draft-clover", "ngram-mod,draft-clover")
N_PREDICT = 48
SERVER_ARGS = ("-c", "1024", "-np", "1", "-t", "2", "--no-warmup")
# text the demo model never saw in training, as in bench/ (library code), and a few that repeat nothing
DEMO_PROMPTS = [
    "def parse(line):\n",
    "import os\n\n\ndef list_files(root):\n    \"\"\"Return every file under root.\"\"\"\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "zebra quartz 17 violet ocean",
]
GRAMMAR = 'root ::= [a-z_ ():\\n]+'  # a grammar every prompt above can continue under
GRAMMAR_TEXT = re.compile(r"[a-z_ ():\n]+")  # the texts GRAMMAR allows


def _tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(10, 3000, n)]


def complete(url: str, prompt: Any, **fields: Any) -> dict[str, Any]:
    """llama-server's /completion, greedy, without its prompt cache: the JSON answer."""
    status, answer = post(url + "/completion", {"prompt": prompt, "n_predict": N_PREDICT, "temperature": 0.0,
                                                "return_tokens": True, "cache_prompt": False, **fields})
    assert status == 200, answer
    return answer


def tokenize(url: str, text: str) -> list[int]:
    status, answer = post(url + "/tokenize", {"content": text})
    assert status == 200, answer
    return answer["tokens"]


def run_configs(gguf: Path, prompts: list[Any], **fields: Any) -> dict[str, list[dict[str, Any]]]:
    """Each prompt's answer under plain decoding ("none") and each of SPEC_TYPES, one server per configuration."""
    answers: dict[str, list[dict[str, Any]]] = {}
    for spec in ("none", *SPEC_TYPES):
        with llama_server(gguf, *SERVER_ARGS, "--spec-type", spec) as url:
            answers[spec] = [complete(url, p, **fields) for p in prompts]
            if spec == "none":
                answers["prompt_ids"] = [{"tokens": p if isinstance(p, list) else tokenize(url, p)} for p in prompts]
    return answers


def check_lossless(name: str, answers: dict[str, list[dict[str, Any]]], ref: Any, rel_tol: float,
                   banned: list[int] | None = None) -> dict[str, int]:
    """Every speculative answer equals the plain one, or diverges at a near-tie of the reference; every type drafted
    (an answer that was never drafted proves nothing about verification). The drafted and accepted token counts of
    each type."""
    ledger = Ledger(rel_tol=rel_tol)
    counts: dict[str, int] = {}
    for spec in SPEC_TYPES:
        drafted = accepted = 0
        for k, (plain, got) in enumerate(zip(answers["none"], answers[spec])):
            context = answers["prompt_ids"][k]["tokens"]
            ledger.check_margin(f"{name}/{spec}/{k}", got["tokens"], plain["tokens"],
                                lambda i, ctx=context, want=plain["tokens"]:
                                causal_gap(ref, ctx + want[:i], banned, rel_tol))
            drafted += got["timings"].get("draft_n", 0)
            accepted += got["timings"].get("draft_n_accepted", 0)
        counts[f"{spec} drafted"], counts[f"{spec} accepted"] = drafted, accepted
    ledger.assert_budget()
    assert all(counts[f"{spec} drafted"] > 0 for spec in SPEC_TYPES), counts
    return counts


@pytest.fixture(scope="module")
def tiny_f32(tiny_checkpoint: Path, module_tmp: MkTemp) -> Path:
    return clover_convert(tiny_checkpoint, module_tmp("draft-clover") / "tiny.gguf", "f32")


@pytest.fixture(scope="module")
def demo_ref() -> Any:
    from clover_ref.checkpoint import load_model

    return load_model(DEMO)


def test_greedy_draft_clover_equals_ar_on_the_tiny_model(tiny_f32: Path, tiny_model: Any) -> None:
    """Random weights: the drafts are mostly wrong, so every round rolls the GDN state back; the output must not
    notice. The end-of-generation tokens are ignored so that every answer runs its full length."""
    prompts = [_tokens(seed, n) for seed, n in ((0, 5), (1, 23), (2, 64))]
    answers = run_configs(tiny_f32, prompts, ignore_eos=True)
    counts = check_lossless("tiny", answers, tiny_model, REF_TOL, banned=list(tiny_model.config.eos_token_ids))
    assert counts["draft-clover drafted"] > 0, counts


def test_greedy_draft_clover_equals_ar_on_the_demo_model(demo_gguf: Path, demo_ref: Any) -> None:
    """The trained model: its block drafts are right often enough to be accepted."""
    answers = run_configs(demo_gguf, DEMO_PROMPTS)
    counts = check_lossless("demo", answers, demo_ref, FLASH_ATTN_TOL)
    assert counts["draft-clover drafted"] > 0 and counts["draft-clover accepted"] > 0, counts


def test_greedy_draft_clover_equals_ar_under_a_grammar(demo_gguf: Path, demo_ref: Any) -> None:
    """With a grammar the drafts are verified by the grammar-constrained sampler: the answers still equal ar's
    under the same grammar (and keep to it)."""
    answers = run_configs(demo_gguf, DEMO_PROMPTS[:2], grammar=GRAMMAR)
    for spec in ("none", *SPEC_TYPES):
        for answer in answers[spec]:
            assert GRAMMAR_TEXT.fullmatch(answer["content"]), (spec, answer["content"])
    for spec in SPEC_TYPES:
        assert [a["tokens"] for a in answers[spec]] == [a["tokens"] for a in answers["none"]], spec
    assert sum(a["timings"].get("draft_n", 0) for a in answers["draft-clover"]) > 0


def grammar_forbidden(checkpoint: Path, n_vocab: int) -> list[int]:
    """The token ids GRAMMAR never allows: a text with other characters, or none (special tokens, the vocabulary's
    padding). With them banned, the reference's top-2 gap is the one among the tokens the grammar allows, which is
    where a near-tie under the grammar is measured."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    texts = [tok.decode([i]) if i < tok.get_vocab_size() else "" for i in range(n_vocab)]
    return [i for i, text in enumerate(texts) if not GRAMMAR_TEXT.fullmatch(text)]


@pytest.mark.parametrize("grammar", [False, True], ids=["plain", "grammar"])
def test_greedy_draft_clover_equals_ar_on_a_checkpoint_written_by_transformers(
        handmade: tuple[Path, object], tmp_path: Path, grammar: bool) -> None:
    """Random weights written by transformers itself; under a grammar the answers keep to it and a near-tie is
    measured among the tokens it allows."""
    from clover_ref.checkpoint import load_model

    checkpoint, _ = handmade
    gguf = clover_convert(checkpoint, tmp_path / "handmade.gguf", "f32")
    ref = load_model(checkpoint)
    prompts = [_tokens(seed, n) for seed, n in ((3, 7), (4, 30))]
    answers = run_configs(gguf, prompts, ignore_eos=True, **({"grammar": GRAMMAR} if grammar else {}))
    banned = set(ref.config.eos_token_ids)
    if grammar:
        for spec in ("none", *SPEC_TYPES):
            for answer in answers[spec]:
                assert GRAMMAR_TEXT.fullmatch(answer["content"]), (spec, answer["content"])
        banned |= set(grammar_forbidden(checkpoint, ref.config.vocab_size))
    check_lossless("handmade" + ("+grammar" if grammar else ""), answers, ref, REF_TOL, banned=sorted(banned))


def test_a_trunk_only_file_runs_without_the_drafter(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """llama.cpp's converter writes no block-diffusion tensors: the server says why it does not draft and answers
    as without speculation."""
    gguf = clover_convert(tiny_checkpoint, tmp_path / "trunk.gguf", "f32", "--bd-sidecar")
    log = tmp_path / "server.log"
    prompt = _tokens(5, 9)
    with llama_server(gguf, *SERVER_ARGS, "--spec-type", "draft-clover", log_path=log) as url:
        got = complete(url, prompt, ignore_eos=True)
    assert "draft-clover needs a Clover model with its block-diffusion tensors" in log.read_text()
    assert got["timings"].get("draft_n", 0) == 0
    with llama_server(gguf, *SERVER_ARGS) as url:
        assert complete(url, prompt, ignore_eos=True)["tokens"] == got["tokens"]


def test_a_slot_at_the_end_of_its_share_drafts_inside_it(demo_gguf: Path, tmp_path: Path) -> None:
    """Two slots on a cache that draft-clover made unified: each keeps n_ctx / n_parallel of it (256 of 512 cells
    here). A block window stays inside its slot's share, narrower at the share's end, so it finds cells while the
    other slot holds its whole share: the second slot drafts up to its context's end, the log names no failed block
    pass, and the answer is the one without speculation."""
    log = tmp_path / "server.log"
    # -cram 0: slot 0 keeps its cells while idle (with a RAM cache llama-server moves an idle slot there and clears it)
    args = ("-c", "512", "-np", "2", "-t", "2", "--no-warmup", "-cram", "0")
    held, asked = _tokens(11, 150), _tokens(12, 150)

    def fill_both(url: str) -> dict[str, Any]:
        fields = {"n_predict": 200, "cache_prompt": True, "ignore_eos": True}
        complete(url, held, id_slot=0, **fields)
        answer = complete(url, asked, id_slot=1, **fields)
        assert 80 < len(answer["tokens"]) < 200, answer  # up to its share's end (256 positions), not n_predict
        return answer

    with llama_server(demo_gguf, *args, "--spec-type", "draft-clover", log_path=log) as url:
        got = fill_both(url)
    text = log.read_text()
    assert "the block pass failed" not in text, [ln for ln in text.splitlines() if "block pass failed" in ln][:3]
    assert got["timings"]["draft_n"] > 0
    with llama_server(demo_gguf, *args) as url:
        assert fill_both(url)["tokens"] == got["tokens"]


@pytest.mark.parametrize("spec", ["draft-clover", "ngram-mod"])
def test_a_round_at_the_context_end_emits_what_it_accepted(spec: str, demo_gguf: Path) -> None:
    """A request that runs into its context's end (-c 256, no context shift) answers with speculation what it
    answers without: the round that reaches the end emits every token it accepted (patch
    server-spec-round-at-context-end), where before, its first token stopped the slot. ngram-mod drafts on code
    that repeats, draft-clover on any prompt."""
    if spec == "ngram-mod":
        prompt: Any = "def area(w, h):\n    return w * h\n\n\n" * 9
    else:
        prompt = _tokens(13, 150)
    args = ("-c", "256", "-np", "1", "-t", "2", "--no-warmup")
    answers = {}
    for name in ("none", spec):
        with llama_server(demo_gguf, *args, "--spec-type", name) as url:
            answers[name] = complete(url, prompt, n_predict=400, ignore_eos=True)
    plain, got = answers["none"], answers[spec]
    assert plain["truncated"] and 60 < len(plain["tokens"]) < 400, plain  # it ran into the context's end
    assert got["timings"]["draft_n_accepted"] > 0, got["timings"]
    assert got["tokens"] == plain["tokens"]


def test_speculative_simple_with_draft_clover_gives_the_servers_text(demo_gguf: Path) -> None:
    prompt = DEMO_PROMPTS[2]
    with llama_server(demo_gguf, *SERVER_ARGS) as url:
        want = complete(url, prompt)["content"]
    done = subprocess.run([str(native_tool("llama-speculative-simple")), "-m", str(demo_gguf), "-p", prompt,
                           "-n", str(N_PREDICT), "--temp", "0", "-c", "1024", "-t", "2", "--spec-type",
                           "draft-clover"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"n_accept\s*=\s*[1-9]", done.stderr), done.stderr[-3000:]  # block drafts were accepted
    assert want.strip(), want  # the server generated text, so that the comparison below says something
    assert want in done.stdout, f"server: {want!r}\nspeculative-simple: {done.stdout!r}"



# code the demo model never saw, written once and then begun again, so that ngram-mod drafts its continuation whole
# (48 to 64 tokens) and the model leaves the copy somewhere inside a draft
REPEATED_CODE = [
    """class LineBuffer:
    \"\"\"Collect bytes and hand out complete lines.\"\"\"

    def __init__(self, limit=65536):
        self.limit = limit
        self.parts = []
        self.size = 0

    def feed(self, data):
        if self.size + len(data) > self.limit:
            raise ValueError("line too long")
        self.parts.append(data)
        self.size += len(data)

    def lines(self):
        text = b"".join(self.parts)
        *done, rest = text.split(b"\\n")
        self.parts = [rest] if rest else []
        self.size = len(rest)
        return [line.decode("utf-8", "replace") for line in done]
""",
    """import json
import os


def load_settings(path, defaults=None):
    \"\"\"Read a JSON settings file, falling back to defaults for missing keys.\"\"\"
    settings = dict(defaults or {})
    if not os.path.exists(path):
        return settings
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise TypeError(f"{path}: expected an object, got {type(data).__name__}")
    for key, value in data.items():
        if key in settings and type(settings[key]) is not type(value):
            raise TypeError(f"{path}: {key} should be {type(settings[key]).__name__}")
        settings[key] = value
    return settings
""",
]


def test_speculative_simple_with_ngram_mod_and_draft_clover_gives_the_servers_text(demo_gguf: Path) -> None:
    """ngram-mod drafts longer than the n_rs_seq that draft-clover sizes; a round that rejects more than that restores
    a checkpoint (as llama-server does). Without it the recurrent state kept rejected tokens and the text changed
    (both prompts, before patch speculative-simple-rs-rollback-checkpoint). On both, ngram-mod alone and draft-clover
    alone give the server's text: no near-tie of the model decides them."""
    n = 128
    prompts = [code + "\n" + code[: len(code) // cut] for code, cut in zip(REPEATED_CODE, (3, 2))]
    with llama_server(demo_gguf, "-c", "2048", "-np", "1", "-t", "2", "--no-warmup") as url:
        wants = [complete(url, prompt, n_predict=n)["content"] for prompt in prompts]
    drafted = 0
    for prompt, want in zip(prompts, wants):
        done = subprocess.run([str(native_tool("llama-speculative-simple")), "-m", str(demo_gguf), "-p", prompt,
                               "-n", str(n), "--temp", "0", "-c", "2048", "-t", "2", "--spec-type",
                               "ngram-mod,draft-clover"], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert want.strip(), want
        assert want in done.stdout, f"prompt {prompt[-60:]!r}\nserver: {want!r}\nspeculative-simple: {done.stdout!r}"
        found = re.search(r"n_drafted\s*=\s*(\d+)", done.stderr)
        assert found, done.stderr[-3000:]
        drafted += int(found.group(1))
    assert drafted >= 64, f"{drafted} drafted tokens: the prompts no longer make ngram-mod draft"

def generate_auto(gguf: Path, prompt: str, *args: str) -> dict[str, Any]:
    """`clover-cpp generate --mode auto`, greedy, as a user runs it: the --json object."""
    done = subprocess.run([sys.executable, "-m", "clover_cpp.cli", "generate", "-m", str(gguf), "-p", prompt,
                           "--mode", "auto", "--temp", "0", "-n", str(N_PREDICT), "-c", "1024", "--json", *args],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("model", ["demo", "handmade"])
def test_generate_auto_gives_the_servers_tokens(model: str, demo_gguf: Path, demo_ref: Any,
                                                handmade: tuple[Path, object], tmp_path: Path) -> None:
    """One implementation of the drafters: libclover's auto (ngram-mod, then draft-clover, from common/speculative)
    and llama-server give the same greedy tokens (near-tie rule), with and without a grammar."""
    from clover_ref.checkpoint import load_model

    if model == "demo":
        gguf, ref, tol, prompts = demo_gguf, demo_ref, FLASH_ATTN_TOL, DEMO_PROMPTS[:3]
    else:
        gguf = clover_convert(handmade[0], tmp_path / "handmade.gguf", "f32")
        ref, tol, prompts = load_model(handmade[0]), REF_TOL, ["def parse(line):\n", "zebra quartz 17"]
    ledger = Ledger(rel_tol=tol)
    drafted = 0
    with llama_server(gguf, *SERVER_ARGS) as url:
        for grammar in (None, GRAMMAR):
            fields = {"grammar": grammar} if grammar else {}
            for k, prompt in enumerate(prompts):
                want = complete(url, prompt, **fields)["tokens"]
                got = generate_auto(gguf, prompt, *(("--grammar", grammar) if grammar else ()))
                context = tokenize(url, prompt)
                assert got["prompt_ids"][-len(context):] == context, (got["prompt_ids"], context)
                ledger.check_margin(f"{model}/grammar={grammar is not None}/{k}", got["tokens"], want,
                                    lambda i, ctx=context, w=want: causal_gap(ref, ctx + w[:i], None, tol))
                drafted += got["stats"]["auto_rounds"]["ngram"] + got["stats"]["auto_rounds"]["block"]
    ledger.assert_budget()
    assert drafted > 0, "auto verified no draft: its answers were plain ar steps"


# ------------------------------------------------------------------------------------------ sampled
SAMPLES = 1200  # requests per configuration (independent seeds): power 0.9 against either shift (homogeneity.py)
SAME_SEEDS = 200  # requests with plain decoding's seeds
ALPHA = 1e-3  # the test's false-alarm rate
SHIFT_TV = 0.1  # the distance (total variation) it must detect with POWER at least
POWER = 0.9


def test_sampled_draft_clover_keeps_the_distribution(demo_gguf: Path) -> None:
    """Sampled (temperature 1, llama-server's default sampler chain, a seed per request).

    - Independent seeds: the second generated token, the first that a block draft can decide, is distributed as
      without speculation. A two-sample chi-square test of homogeneity at ALPHA, its critical value by simulation
      from the pooled counts; the same simulation shows that it detects a shift of SHIFT_TV in total variation
      with power at least POWER (asserted), whether the mass moves onto a rare token (a verification that kept one
      wrong draft in ten) or from the likeliest token to the runner-up.
    - The same seeds: llama.cpp's rule samples the target at every verified row with the request's generator, so
      the three tokens are those of plain decoding (all but a rare kernel-rounding flip at a sampling boundary)."""
    prompt = DEMO_PROMPTS[0]
    tokens: dict[str, list[list[int]]] = {}
    for spec, seeds in (("none", range(SAMPLES)), ("draft-clover", range(SAMPLES, 2 * SAMPLES)),
                        ("draft-clover same seeds", range(SAME_SEEDS))):
        with llama_server(demo_gguf, *SERVER_ARGS, "--spec-type", spec.split()[0]) as url:
            answers = [complete(url, prompt, n_predict=3, temperature=1.0, seed=i) for i in seeds]
        tokens[spec] = [a["tokens"] for a in answers]
        if spec != "none":
            # every answer's second token was verified against a block draft, and the rule both kept and rejected
            drafted = [a["timings"].get("draft_n", 0) for a in answers]
            kept = sum(a["timings"].get("draft_n_accepted", 0) for a in answers)
            assert min(drafted) >= 1, f"{drafted.count(0)} of {len(answers)} answers had no draft"
            assert 0 < kept < len(answers), f"{kept} of {len(answers)} drafts kept"

    same = sum(x == y for x, y in zip(tokens["none"], tokens["draft-clover same seeds"]))
    assert same >= 0.99 * SAME_SEEDS, f"only {same} of {SAME_SEEDS} seeded answers equal plain decoding's"

    second = {spec: [t[1] for t in tokens[spec] if len(t) > 1] for spec in ("none", "draft-clover")}
    homogeneity(second["none"], second["draft-clover"], ALPHA, SHIFT_TV).assert_same(POWER)
