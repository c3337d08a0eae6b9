"""Block diffusion as a llama-server generation mode (docs/serve.md, "Block diffusion in llama-server"), through its
HTTP API and against the engine (`clover-cpp generate --mode diffusion` and the Python API):

- a request's `mode: diffusion` gives the engine's tokens, and the same number of block and causal passes, for the
  same settings and prompt: on the trained demo model and on a checkpoint transformers wrote, at B = 4, 8 and 32,
  thresholds 0.5 and 0.9, with max_tokens cutting inside a block. Both run LowConfidence's one implementation
  (common/block-diffusion.h) on the same arithmetic, so they agree exactly; the engine's diffusion is held to the
  PyTorch reference by tests/engine/test_engine.py;
- a request's `coreset_top_p` routes its block passes as the engine's does at that top_p;
- two slots, one in diffusion and one in ar, each give what they give alone;
- canvas events, asked for, rebuild the streamed text block by block (native and OpenAI streams);
- a request with a grammar decodes as auto (lossless: ar's tokens, no block pass);
- bad values get a 400 with the API's error body; a model without block passes refuses diffusion.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from clover_dev import REPO_ROOT
from clover_dev.convert import clover_convert
from tests.support.native import llama_server, native_tool
from tests.support.serve import emitted_tokens, http, post, post_raw, sse_chunks

pytestmark = pytest.mark.native

SERVER_ARGS = ("-c", "1024", "-np", "1", "-t", "2", "--no-warmup")
TWO_SLOTS = ("-c", "2048", "-np", "2", "-t", "2", "--no-warmup")
DEMO_PROMPTS = ["def parse(line):\n", "import os\n\n\ndef walk(root):\n",
                "class Stack:\n    def __init__(self):\n        self.items = []\n"]
# (B, threshold, max_tokens): cuts inside a block (21, 37) and on a block's end (40, 64)
SETTINGS = [(4, 0.9, 40), (4, 0.5, 21), (8, 0.9, 37), (8, 0.5, 64), (32, 0.9, 50), (32, 0.5, 37)]


def _tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(10, 3000, n)]


def diffuse(url: str, prompt: list[int], block_size: int, threshold: float, n: int, **fields: Any) -> dict[str, Any]:
    status, answer = post(url + "/completion", {"prompt": prompt, "n_predict": n, "temperature": 0.0,
                                                "mode": "diffusion", "block_size": block_size,
                                                "threshold": threshold, "return_tokens": True,
                                                "cache_prompt": False, **fields})
    assert status == 200, answer
    return answer


def sse(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The data events of a streamed request."""
    status, _, raw = http(url, body, timeout=300)
    assert status == 200, raw[-2000:]
    return sse_chunks(raw)


def engine_runs(gguf: Path, prompts: list[list[int]]) -> dict[tuple[int, int, float, int], Any]:
    """The engine's diffusion (the Python API over libclover) for every prompt and setting."""
    from clover_cpp import Model

    out = {}
    with Model(gguf, n_ctx=1024, max_block_size=32) as m:
        for k, prompt in enumerate(prompts):
            for block_size, threshold, n in SETTINGS:
                m.reset()
                out[(k, block_size, threshold, n)] = m.run(prompt, mode="diffusion", block_size=block_size,
                                                           threshold=threshold, max_tokens=n)
    return out


def check_equal_to_engine(gguf: Path, prompts: list[list[int]]) -> int:
    """Every setting's server answer equals the engine's tokens and passes; the number of blocks a cut ended.
    Both are sized for blocks of 32 (a model's own block size may be smaller: --max-block-size, max_block_size)."""
    want = engine_runs(gguf, prompts)
    cut = 0
    with llama_server(gguf, *SERVER_ARGS, "--max-block-size", "32") as url:
        for (k, block_size, threshold, n), run in want.items():
            got = diffuse(url, prompts[k], block_size, threshold, n)
            case = f"prompt {k}, B={block_size}, threshold={threshold}, max_tokens={n}"
            assert emitted_tokens(got) == run.tokens, f"{case}\nserver {emitted_tokens(got)}\nengine {run.tokens}"
            timings = got["timings"]
            assert (timings["block_passes"], timings["causal_passes"]) == \
                (run.stats.block_passes, run.stats.causal_passes), (case, timings, run.stats)
            assert timings["tokens_per_pass"] == pytest.approx(
                timings["predicted_n"] / (timings["block_passes"] + timings["causal_passes"]))
            cut += got["stop_type"] == "limit" and n % block_size != 0
    return cut


def test_diffusion_in_llama_server_equals_the_engine_on_the_demo_model(demo_gguf: Path) -> None:
    from clover_cpp import Model

    with Model(demo_gguf, n_ctx=256) as m:
        prompts = [m.tokenize(p) for p in DEMO_PROMPTS]
    assert check_equal_to_engine(demo_gguf, prompts) > 0, "no max_tokens cut fell inside a block"


def test_diffusion_in_llama_server_equals_the_engine_on_a_checkpoint_written_by_transformers(
        handmade: tuple[Path, object], tmp_path: Path) -> None:
    gguf = clover_convert(handmade[0], tmp_path / "handmade.gguf", "f32")
    check_equal_to_engine(gguf, [_tokens(3, 7), _tokens(4, 30)])


def test_diffusion_in_llama_server_follows_the_reference_step_by_step(handmade: tuple[Path, object],
                                                                      tmp_path: Path) -> None:
    """The PyTorch reference directly: every step's canvas, read from the server's canvas events, is the reference's,
    or the two part first at a near-tie of the reference (tests/support/engine.py), and so are the tokens."""
    from clover_ref.checkpoint import load_model
    from tests.support.engine import REF_TOL, Ledger, reference_run

    checkpoint, _ = handmade
    gguf = clover_convert(checkpoint, tmp_path / "handmade.gguf", "f32")
    ref = load_model(checkpoint)
    mask = ref.config.mask_token_id
    ledger = Ledger(rel_tol=REF_TOL)
    with llama_server(gguf, *SERVER_ARGS, "--max-block-size", "32") as url:
        cases = [(_tokens(5, 9), 4, 0.5, 21), (_tokens(6, 17), 8, 0.9, 30), (_tokens(7, 12), 32, 0.5, 37)]
        for k, (prompt, block_size, threshold, n) in enumerate(cases):
            (want,), session = reference_run(ref, [(prompt, {"mode": "diffusion", "block_size": block_size,
                                                             "threshold": threshold, "max_new_tokens": n})])
            events = sse(url + "/completion", {"prompt": prompt, "n_predict": n, "temperature": 0.0,
                                               "mode": "diffusion", "block_size": block_size, "threshold": threshold,
                                               "stream": True, "return_canvas": True, "cache_prompt": False})
            canvases = [[mask if t is None else t for t in e["canvas"]["tokens"]] for e in events if "canvas" in e]
            tokens = [t for e in events if "canvas" not in e for t in e.get("tokens", [])]
            tokens = [t for t in tokens if t not in ref.config.eos_token_ids]
            ledger.check(f"handmade/{k}", tokens, want.tokens, ref, prompt, None, canvases, session.trace)
    ledger.assert_budget()


def test_diffusion_in_llama_server_equals_clover_cpp_generate(demo_gguf: Path) -> None:
    """The command a user runs: `clover-cpp generate --mode diffusion --json`, and the server started with the same
    settings as its defaults (--mode, --block-size, --threshold), asked with no decoding field."""
    prompt, block_size, threshold, n = DEMO_PROMPTS[1], 8, 0.5, 37
    done = subprocess.run([sys.executable, "-m", "clover_cpp.cli", "generate", "-m", str(demo_gguf), "-p", prompt,
                           "--mode", "diffusion", "--block-size", str(block_size), "--threshold", str(threshold),
                           "--temp", "0", "-n", str(n), "-c", "1024", "--json"],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    want = json.loads(done.stdout)
    with llama_server(demo_gguf, *SERVER_ARGS, "--mode", "diffusion", "--block-size", str(block_size),
                      "--threshold", str(threshold)) as url:
        status, got = post(url + "/completion", {"prompt": want["prompt_ids"], "n_predict": n, "temperature": 0.0,
                                                 "return_tokens": True, "cache_prompt": False})
    assert status == 200, got
    assert emitted_tokens(got) == want["tokens"]
    assert got["timings"]["block_passes"] == want["stats"]["block_passes"] > 0



def test_a_request_without_a_threshold_takes_the_calibrated_one_for_its_block_size(tmp_path: Path) -> None:
    """The default threshold is the GGUF's calibrated one for the block size when the file lists it
    (docs/gguf-format.md), in llama-server as in the engine: on a demo file whose threshold for B = 8 is 0.5 (0.9 for
    every other size), a request at B = 8 without one gives the engine's tokens and passes at its default, and the
    file's 0.9 gives other passes, so the comparison sees a server that ignores the calibrated value."""
    from clover_cpp import Model

    model = Path(shutil.copytree(REPO_ROOT / "models" / "clover-demo", tmp_path / "model"))
    config = json.loads((model / "config.json").read_text())
    assert config["calibrated_block_sizes"] == [8, 16, 32] and config["confidence_threshold"] == 0.9, config
    config["calibrated_thresholds"] = [0.5, 0.9, 0.9]
    (model / "config.json").write_text(json.dumps(config))
    gguf = clover_convert(model, tmp_path / "demo-calibrated.gguf", "f32")
    prompt, n = DEMO_PROMPTS[1], 40
    with Model(gguf, n_ctx=1024) as m:
        want = m.run(prompt, mode="diffusion", block_size=8, max_tokens=n)
        m.reset()
        at_file_default = m.run(prompt, mode="diffusion", block_size=8, threshold=0.9, max_tokens=n)
    assert want.stats.threshold == pytest.approx(0.5)
    assert want.stats.block_passes != at_file_default.stats.block_passes
    with llama_server(gguf, *SERVER_ARGS) as url:
        status, got = post(url + "/completion", {"prompt": prompt, "n_predict": n, "temperature": 0.0,
                                                 "mode": "diffusion", "block_size": 8, "return_tokens": True,
                                                 "cache_prompt": False})
    assert status == 200, got
    assert emitted_tokens(got) == want.tokens
    assert got["timings"]["block_passes"] == want.stats.block_passes

def test_a_requests_coreset_top_p_reaches_its_block_passes(demo_gguf: Path) -> None:
    """`coreset_top_p` per request (spec 3.3): a diffusion request routed inside a coreset of top_p 0.5 gives the
    engine's tokens and passes at that top_p, as one at 1 (no coreset) gives the engine's at 1, on one server; and top_p
    0.5 changes at least one prompt's tokens, so the test sees a server that ignores the field."""
    from clover_cpp import Model

    block_size, threshold, n = 8, 0.5, 37
    want = {}
    with Model(demo_gguf, n_ctx=1024, max_block_size=32) as m:
        prompts = [m.tokenize(p) for p in DEMO_PROMPTS]
        for top_p in (0.5, 1.0):
            for k, prompt in enumerate(prompts):
                m.reset()
                want[(top_p, k)] = m.run(prompt, mode="diffusion", block_size=block_size, threshold=threshold,
                                         max_tokens=n, coreset_top_p=top_p)
    assert any(want[(0.5, k)].tokens != want[(1.0, k)].tokens for k in range(len(prompts))), \
        "coreset_top_p 0.5 changed no prompt's tokens on the demo model: this test cannot tell it is applied"
    with llama_server(demo_gguf, *SERVER_ARGS, "--max-block-size", "32") as url:
        for top_p, k in sorted(want, key=lambda case: (case[1], case[0])):  # the values alternate on one slot
            run = want[(top_p, k)]
            got = diffuse(url, prompts[k], block_size, threshold, n, coreset_top_p=top_p)
            assert emitted_tokens(got) == run.tokens, (top_p, k, emitted_tokens(got), run.tokens)
            assert got["timings"]["block_passes"] == run.stats.block_passes, (top_p, k, got["timings"])


def test_a_diffusion_slot_and_an_ar_slot_each_give_what_they_give_alone(demo_gguf: Path) -> None:
    from clover_cpp import Model

    with Model(demo_gguf, n_ctx=256) as m:
        prompts = [m.tokenize(p) for p in DEMO_PROMPTS[:2]]
    requests = [
        {"prompt": prompts[0], "mode": "diffusion", "block_size": 8, "threshold": 0.5},
        {"prompt": prompts[1], "mode": "ar"},
    ]
    base = {"n_predict": 48, "temperature": 0.0, "return_tokens": True, "cache_prompt": False, "ignore_eos": True}
    with llama_server(demo_gguf, *TWO_SLOTS) as url:
        alone = []
        for body in requests:
            status, answer = post(url + "/completion", {**base, **body})
            assert status == 200, answer
            alone.append(answer)
        together: list[Any] = [None, None]

        def ask(i: int) -> None:
            together[i] = post(url + "/completion", {**base, **requests[i]})

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    for i, (status, answer) in enumerate(together):
        assert status == 200, answer
        assert answer["tokens"] == alone[i]["tokens"], requests[i]["mode"]
    assert alone[0]["timings"]["block_passes"] > 0 and alone[1]["timings"]["block_passes"] == 0
    assert {together[0][1]["id_slot"], together[1][1]["id_slot"]} == {0, 1}, "the requests did not share the server"


def _graphs_reused(log: Path) -> int:
    """The graphs the server's context has reused so far: the last request's timings in llama-server's log."""
    counts = re.findall(r"graphs reused =\s+(\d+)", log.read_text(errors="replace"))
    assert counts, f"{log} has no request timings"
    return int(counts[-1])


def test_graph_cache_gives_the_same_tokens_and_reuses_more_graphs(demo_gguf: Path, tmp_path: Path) -> None:
    """`--graph-cache N` (common's option over llama_set_graph_cache_size, docs/native.md): a server that keeps 6
    graphs answers block diffusion (block passes alternate with a commit) and draft-clover's speculative decoding
    (block drafts alternate with verifications) with the tokens of one that keeps none, and reuses more graphs. A
    value outside [0, 64] is refused at start, naming the option."""
    prompt = DEMO_PROMPTS[0]
    spec = {"prompt": prompt, "n_predict": 48, "temperature": 0.0, "return_tokens": True, "cache_prompt": False}
    runs = {}
    for extra in ((), ("--graph-cache", "6")):
        log = tmp_path / f"server{len(extra)}.log"
        with llama_server(demo_gguf, *SERVER_ARGS, "--spec-type", "draft-clover", *extra, log_path=log) as url:
            status, answer = post(url + "/completion", spec)
            assert status == 200, answer
            assert answer["timings"]["draft_n"] > 0, answer["timings"]
            tokens = (diffuse(url, prompt, 8, 0.9, 48)["tokens"], answer["tokens"])
        runs[extra] = (tokens, _graphs_reused(log))
    (plain, plain_reused), (kept, kept_reused) = runs.values()
    assert kept == plain
    assert kept_reused > plain_reused, (kept_reused, plain_reused)

    bad = subprocess.run([str(native_tool("llama-server")), "-m", str(demo_gguf), "--graph-cache", "65"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--graph-cache must be in [0, 64], got 65" in bad.stderr, bad.stderr[-2000:]


def test_sampled_diffusion_follows_the_seed(demo_gguf: Path) -> None:
    """Sampled targets are drawn through the request's sampler chain (common_sampler_sample_target): the same seed
    gives the same blocks, another seed other ones."""
    with llama_server(demo_gguf, *SERVER_ARGS) as url:
        prompt = DEMO_PROMPTS[0]
        answers = [diffuse(url, prompt, 8, 0.5, 48, temperature=1.0, seed=seed)["tokens"] for seed in (7, 7, 8)]
    assert answers[0] == answers[1]
    assert answers[0] != answers[2]



def test_a_chain_without_temperature_draws_at_temperature_one(demo_gguf: Path) -> None:
    """`temperature: 0` sets the temperature sampler; a request whose `samplers` leave it out draws from the
    truncated distribution at 1, in `ar`, and so in diffusion: its targets follow the seed instead of being the
    argmax (the greedy shortcut of common_sampler_sample_target needs the temperature sampler in the chain)."""
    prompt, fields = DEMO_PROMPTS[0], {"samplers": ["top_k"], "top_k": 40}
    with llama_server(demo_gguf, *SERVER_ARGS) as url:
        greedy = diffuse(url, prompt, 8, 0.5, 48)["tokens"]
        drawn = [diffuse(url, prompt, 8, 0.5, 48, seed=seed, **fields)["tokens"] for seed in (7, 7, 8, 9)]
    assert drawn[0] == drawn[1], "one seed, one draw"
    assert any(d != greedy for d in drawn), "every draw was the argmax: the temperature was applied"

def test_diffusion_runs_to_the_context_end_as_ar_does(demo_gguf: Path) -> None:
    """The last block is as wide as the context leaves (spec 4.1), and llama-server's own rule ends the answer where it
    ends an ar one: the same number of tokens, the same stop."""
    with llama_server(demo_gguf, "-c", "160", "-np", "1", "-t", "2", "--no-warmup") as url:
        prompt = list(range(300, 400))  # 100 tokens: three blocks of 16, then 12 positions
        answers = [post(url + "/completion", {"prompt": prompt, "n_predict": -1, "temperature": 0.0, "ignore_eos": True,
                                              "return_tokens": True, "cache_prompt": False, "mode": mode,
                                              "block_size": 16, "threshold": 0.5})[1] for mode in ("ar", "diffusion")]
    ar, diffusion = answers
    assert diffusion["timings"]["block_passes"] > 0
    assert len(diffusion["tokens"]) == len(ar["tokens"]) > 48, (len(diffusion["tokens"]), len(ar["tokens"]))
    assert (diffusion["stop_type"], diffusion["truncated"]) == (ar["stop_type"], ar["truncated"])


def rebuild(events: list[dict[str, Any]]) -> str:
    """The text of every block from its last canvas event: its first n_produced cells (less the end of
    generation)."""
    last: dict[int, dict[str, Any]] = {}
    steps: dict[int, list[int]] = {}
    for e in events:
        canvas = e["canvas"]
        last[canvas["block"]] = canvas
        steps.setdefault(canvas["block"], []).append(canvas["step"])
    text = ""
    for block in sorted(last):
        canvas = last[block]
        assert steps[block] == list(range(1, len(steps[block]) + 1)), steps[block]
        assert canvas["done"], canvas
        n = canvas["n_produced"] - (1 if canvas["eog"] else 0)
        assert all(c is not None for c in canvas["cells"][:n]), canvas
        text += "".join(canvas["cells"][:n])
    return text


def test_canvas_events_rebuild_the_streamed_text(demo_gguf: Path) -> None:
    body = {"n_predict": 30, "max_tokens": 30, "temperature": 0.0, "mode": "diffusion", "block_size": 8,
            "threshold": 0.5, "stream": True, "return_canvas": True, "cache_prompt": False}
    with llama_server(demo_gguf, *SERVER_ARGS) as url:
        events = sse(url + "/completion", {**body, "prompt": DEMO_PROMPTS[0]})
        canvas = [e for e in events if "canvas" in e]
        text = "".join(e["content"] for e in events if "canvas" not in e)
        assert len({e["canvas"]["block"] for e in canvas}) >= 4 and len(canvas) > 4, canvas
        assert any(None in e["canvas"]["cells"] for e in canvas), "no step left a cell masked"
        assert rebuild(canvas) == text

        chat = sse(url + "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "Hi"}]})
        canvas = [e for e in chat if "canvas" in e]
        assert canvas and all(e["object"] == "chat.completion.chunk" for e in chat)
        # the chat template's parser may move a part of the text to reasoning_content; both come from the blocks
        rebuilt = rebuild(canvas)
        for part in ("content", "reasoning_content"):
            streamed = "".join(e["choices"][0]["delta"].get(part) or "" for e in chat if e["choices"])
            assert streamed.strip() in rebuilt, (part, streamed, rebuilt)

        plain = sse(url + "/completion", {**body, "prompt": DEMO_PROMPTS[0], "return_canvas": False})
        assert not any("canvas" in e for e in plain)


def test_a_grammar_request_in_diffusion_decodes_as_auto(demo_gguf: Path) -> None:
    """LowConfidence fills targets out of order, a grammar judges a token after the ones before it
    (docs/decoding.md, "Constrained decoding"): the request decodes losslessly, ar's tokens, with no block pass."""
    grammar = 'root ::= [a-z_ ():\\n]+'
    base = {"prompt": DEMO_PROMPTS[0], "n_predict": 24, "temperature": 0.0, "grammar": grammar,
            "return_tokens": True, "cache_prompt": False}
    with llama_server(demo_gguf, *SERVER_ARGS) as url:
        answers = [post(url + "/completion", {**base, "mode": mode}) for mode in ("ar", "diffusion")]
    for status, answer in answers:
        assert status == 200, answer
    assert answers[0][1]["tokens"] == answers[1][1]["tokens"]
    assert answers[1][1]["timings"]["block_passes"] == 0


@pytest.mark.parametrize("fields,name", [
    ({"block_size": 0}, "block_size"),
    ({"block_size": 33}, "block_size"),  # above the widest block: the model's, 32
    ({"threshold": 1.5}, "threshold"),
    ({"threshold": -0.1}, "threshold"),
    ({"threshold": "nan"}, "threshold"),
    ({"mode": "fast"}, "mode"),
    ({"coreset_top_p": 0}, "coreset_top_p"),
    ({"mirostat": 2}, "mirostat"),  # its state follows each draw, a block draws many at a time
    ({"n": 2}, "n"),
])
def test_bad_decoding_fields_get_a_400_naming_the_field(demo_gguf: Path, fields: dict[str, Any], name: str) -> None:
    bodies = [("/completion", {"prompt": "x"}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})]
    if name not in ("mirostat", "n"):  # the Anthropic API has neither field
        bodies.append(("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}))
    with llama_server(demo_gguf, *SERVER_ARGS) as url:
        for path, body in bodies:
            status, answer = post(url + path, {"n_predict": 4, **body, "mode": "diffusion", **fields})
            assert status == 400, (path, answer)
            assert f"'{name}'" in answer["error"]["message"], (path, answer)
        # a NaN literal is not JSON: a 400 with the error body too
        status, answer = post_raw(url + "/completion", b'{"prompt": "x", "mode": "diffusion", "threshold": NaN}')
        assert status == 400 and answer["error"]["type"] == "invalid_request_error", answer


def test_a_model_without_block_passes_refuses_diffusion(tiny_checkpoint: Path, tmp_path: Path) -> None:
    gguf = clover_convert(tiny_checkpoint, tmp_path / "trunk.gguf", "f32", "--bd-sidecar")
    with llama_server(gguf, *SERVER_ARGS) as url:
        status, answer = post(url + "/completion", {"prompt": "x", "n_predict": 4, "mode": "diffusion"})
        assert status == 400 and "'mode'" in answer["error"]["message"], answer
        status, answer = post(url + "/completion", {"prompt": "x", "n_predict": 4, "mode": "ar"})
        assert status == 200, answer
