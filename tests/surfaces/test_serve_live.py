"""`clover-cpp serve` (docs/serve.md): the patched llama-server, live on the tiny GGUF, driven by the official `openai`
client and plain HTTP.

Every answer is compared with the reference: the checkpoint's chat template rendered by clover_ref, tokenized by its
tokenizer.json and decoded greedily by clover_ref.decode on a fresh history. llama-server gives the token ids when a
request asks (`"verbose": true, "return_tokens": true`: the answer's `__verbose.tokens`, and `__verbose.prompt`, the
prompt it ran on); the decoding statistics the earlier server reported in `usage.clover` are the answer's `timings`
(`causal_passes`, `block_passes`, `tokens_per_pass`, `draft_n`, `draft_n_accepted`).

These tests began as the earlier FastAPI server's (`clover-cpp serve-legacy`). Where llama-server answers otherwise
but soundly (its error messages and types, its field names, its limits), they assert what llama-server does, and say
so where they do; where it lacked a behaviour the earlier server had, a strict xfail named the gap until a patch
filled it (none is left). What
tests/native/test_serve_*.py and test_server_*.py already check (the Host check, tool_choice errors, the fuzz of bad
bodies, the metrics of passes, diffusion against the engine) is not repeated here.

The observations that wait (a shutdown, a template that never ends, an abandoned request, a body that never comes)
run in the background as the module starts, most on servers of their own (the `background` fixture), and their tests
read what they saw.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from http import client as http_client
from pathlib import Path
from typing import Any

import pytest

from clover_dev.process import server_metrics
from tests.support.chat import Reference
from tests.support.engine import run_concurrently
from tests.support.serve import (MODEL_ID, THINK_OFF, address, auth, clover_serve, emitted_tokens, get, http, post,
                                 post_raw)

pytestmark = pytest.mark.native  # every test here runs a live server (skipped without the build; a failure in CI)

# served as "tiny", as the earlier server named the file; a fixed seed for the requests that sample (llama-server's
# default temperature is 0.8, its default seed random); one thread: two on a small shared machine wait on each other
# at every pass (a 24-token answer took from 25 ms to 1 s), and the tiny model needs no more
BASE = ("-t", "1", "--no-warmup", "--alias", MODEL_ID, "--seed", "7")
TOKENS = {"verbose": True, "return_tokens": True}  # the answer's __verbose carries the prompt and the token ids
USER = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Write a function that adds two numbers."}]
DIFFUSION = {"block_size": 8, "threshold": 0.006}
LONG = {"mode": "diffusion", "block_size": 16, "threshold": 1.0, "ignore_eos": True}  # one token a step: about a minute
N_VOCAB = 3072


@pytest.fixture(scope="module")
def server(tiny_gguf: Path) -> Iterator[str]:
    """One slot, the earlier server's default context (4096) and block room (--max-block-size 32)."""
    with clover_serve(tiny_gguf, *BASE, "-c", "4096", "-np", "1", "--max-block-size", "32", "--metrics") as (url, _, _):
        yield url


def _client(url: str, key: str = "none", timeout: float = 120) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=timeout)


@pytest.fixture(scope="module")
def client(server: str) -> Any:
    return _client(server)


@pytest.fixture(scope="module", autouse=True)
def background(tiny_gguf: Path, server: str) -> Iterator[dict[str, Future[dict[str, Any]]]]:
    """The observations that wait (a shutdown that hangs, a template that never ends or crashes the server, an
    abandoned request, a body that never comes), mostly on servers of their own, started together as the module
    starts and read by their tests, so that their waits overlap the other tests'."""
    args = _hardened_args(tiny_gguf.parent)
    with ThreadPoolExecutor(5) as pool:
        yield {"sigterm": pool.submit(_sigterm, tiny_gguf),
               "endless": pool.submit(_endless_template, tiny_gguf, args),
               "recurse": pool.submit(_recursing_template, tiny_gguf, args),
               "abandoned": pool.submit(_abandoned, tiny_gguf),
               "declared length": pool.submit(_declared_length, server)}


def _verbose(resp: Any) -> dict[str, Any]:
    return resp.model_extra["__verbose"]


def _tokens(resp: Any) -> list[int]:
    """The generated ids (less the end-of-generation token llama-server stopped at)."""
    return emitted_tokens(_verbose(resp))


def _timings(resp: Any) -> dict[str, Any]:
    return resp.model_extra["timings"]


def _slots(url: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(url + "/slots", timeout=30) as r:
        return json.loads(r.read())


def _content(want: Any) -> str:
    """The message content llama-server gives for an answer without reasoning or tool calls: the decoded text as it
    is (the reference's answer read by common/chat's parser)."""
    assert want.parsed.reasoning is None and not want.parsed.tool_calls and want.parsed.content == want.text
    return want.text


def _check_timings(timings: dict[str, Any], want: Any, mode: str) -> None:
    """The earlier `usage.clover` checks on llama-server's `timings`: diffusion and ar count the reference's passes;
    `spec` is llama-server's drafters (--spec-type ngram-mod,draft-clover), whose passes are not the engine's
    block-draft rounds: a drafter's own passes are not counted, and every round is one causal pass."""
    assert timings["predicted_n"] == want.stats.generated_tokens
    passes = timings["block_passes"] + timings["causal_passes"]
    assert timings["tokens_per_pass"] == pytest.approx(timings["predicted_n"] / passes)
    if mode == "spec":
        assert timings["block_passes"] == 0 and 0 < timings["causal_passes"] <= timings["predicted_n"], timings
        assert timings["draft_n"] >= timings["draft_n_accepted"] >= 0 and timings["draft_n"] > 0, timings
    else:
        assert (timings["block_passes"], timings["causal_passes"]) == \
            (want.stats.block_passes, want.stats.causal_passes), (timings, want.stats)
        assert "draft_n" not in timings, timings


def test_models_and_health(client: Any, server: str) -> None:
    """llama-server's shapes: /v1/models lists the alias with its `meta`, /props the slots and the context, /health
    `{"status": "ok"}` (the earlier `clover` card and job counters are gone; there is no /v1/models/{id})."""
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_ID]
    meta = models.data[0].model_extra["meta"]
    assert (meta["n_ctx"], meta["n_vocab"], meta["n_ctx_train"]) == (4096, N_VOCAB, 4096), meta
    props = get(server + "/props")
    assert props["total_slots"] == 1 and props["default_generation_settings"]["n_ctx"] == 4096
    assert props["default_generation_settings"]["params"]["mode"] == "auto"  # llama-server's default decoding
    assert get(server + "/health") == {"status": "ok"}
    status, _, body = http(server + f"/v1/models/{MODEL_ID}")
    assert status == 404 and json.loads(body)["error"]["type"] == "not_found_error"


def _piece_bytes(piece: str | list[int]) -> bytes:
    return piece.encode() if isinstance(piece, str) else bytes(piece)


def test_tokenize_and_detokenize_as_llama_server(server: str, ref: Reference) -> None:
    """tools/server/README.md, "POST /tokenize" and "POST /detokenize": ``{"tokens": [ids]}``; with ``with_pieces``,
    ``{"id", "piece"}`` objects whose piece is the text when it is valid UTF-8 and a list of bytes otherwise. The ids
    are the checkpoint's tokenizer.json's; special tokens are parsed unless ``parse_special`` is false."""
    text = "def add(a, b):\n    return a + b  # \U0001d518 sum"
    got, body = post(server + "/tokenize", {"content": text})
    assert got == 200 and list(body) == ["tokens"] and body["tokens"] == ref.ids(text)
    got, pieces = post(server + "/tokenize", {"content": text, "with_pieces": True})
    assert got == 200 and [p["id"] for p in pieces["tokens"]] == body["tokens"]
    assert b"".join(_piece_bytes(p["piece"]) for p in pieces["tokens"]).decode() == text
    assert any(isinstance(p["piece"], list) for p in pieces["tokens"]), "a 4-byte character split into byte pieces"
    assert all(isinstance(p["piece"], str) for p in pieces["tokens"] if p["id"] in ref.ids("def add"))

    special = "<|im_start|>user"
    _, parsed = post(server + "/tokenize", {"content": special})
    _, plain = post(server + "/tokenize", {"content": special, "parse_special": False})
    im_start = ref.ids("<|im_start|>")
    assert parsed["tokens"] == ref.ids(special) and len(im_start) == 1
    assert im_start[0] not in plain["tokens"] and len(plain["tokens"]) > len(parsed["tokens"])

    got, back = post(server + "/detokenize", {"tokens": body["tokens"]})
    assert got == 200 and back == {"content": text}
    assert post(server + "/detokenize", {"tokens": parsed["tokens"]})[1] == {"content": special}
    got, err = post(server + "/detokenize", {"tokens": [1, N_VOCAB]})
    assert got == 400 and f"token id {N_VOCAB} is not in the vocabulary (0 .. {N_VOCAB - 1})" in \
        err["error"]["message"], err
    # llama-server reads a body without "content" as empty text (the earlier server: a 400 naming the field)
    assert post(server + "/tokenize", {"text": "x"}) == (200, {"tokens": []})


def test_apply_template_as_llama_server(server: str, ref: Reference) -> None:
    """tools/server/README.md, "POST /apply-template": ``{"prompt": text}``, the rendering a chat completion runs on."""
    got, body = post(server + "/apply-template", {"messages": USER})
    assert got == 200 and body == {"prompt": ref.render(USER)}
    got, body = post(server + "/apply-template", {"messages": USER, **THINK_OFF})
    assert body == {"prompt": ref.render(USER, thinking=False)}
    # no messages: the Qwen3.5 family's template raises "No messages provided.", and llama-server answers a 400 with
    # its message (patch server-template-error-is-a-bad-request; it was a 500)
    got, body = post(server + "/apply-template", {"messages": []})
    assert got == 400 and "No messages provided." in body["error"]["message"], body


@pytest.mark.parametrize("mode,opts", [("ar", {}), ("diffusion", DIFFUSION), ("spec", {"block_size": 4})])
def test_chat_equals_reference_and_stream_reassembles(client: Any, ref: Reference, mode: str,
                                                      opts: dict[str, Any]) -> None:
    want = ref.chat(USER, mode, 24, thinking=False, **opts)
    extra = {"mode": mode, **opts, **THINK_OFF}
    resp = client.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=24, temperature=0,
                                          extra_body={**extra, **TOKENS})
    assert _verbose(resp)["prompt"] == want.prompt_text
    assert _tokens(resp) == want.tokens
    msg = resp.choices[0].message
    assert msg.content == want.text and msg.content  # the decoded text as it is (see _content)
    assert msg.model_extra.get("reasoning_content") is None
    assert resp.choices[0].finish_reason == ("length" if want.stats.stop_reason == "length" else "stop")
    assert resp.usage.prompt_tokens == len(want.prompt_ids)
    assert resp.usage.completion_tokens == len(want.tokens)
    assert resp.usage.total_tokens == len(want.prompt_ids) + len(want.tokens)
    _check_timings(_timings(resp), want, mode)

    stream = client.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True}, extra_body=extra)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == msg.content
    assert finish == [resp.choices[0].finish_reason]
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1  # it streamed
    # the usage chunk comes last, with the request's timings (a chat stream carries no token ids)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == resp.usage.completion_tokens
    streamed = chunks[-1].model_extra["timings"]
    assert (streamed["block_passes"], streamed["causal_passes"]) == \
        (_timings(resp)["block_passes"], _timings(resp)["causal_passes"])


def test_thinking_on_and_off(client: Any, ref: Reference) -> None:
    opts = {"mode": "diffusion", **DIFFUSION}
    on = ref.chat(USER, "diffusion", 20, thinking=True, **DIFFUSION)
    off = ref.chat(USER, "diffusion", 20, thinking=False, **DIFFUSION)
    assert on.prompt_text.endswith("<think>\n") and off.prompt_text.endswith("<think>\n\n</think>\n\n")
    r_on = client.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=20, temperature=0,
                                          extra_body={**opts, **TOKENS,
                                                      "chat_template_kwargs": {"enable_thinking": True}})
    r_default = client.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=20, temperature=0,
                                               extra_body=opts)
    r_off = client.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=20, temperature=0,
                                           extra_body={**opts, **TOKENS, **THINK_OFF})
    assert (_verbose(r_on)["prompt"], _tokens(r_on)) == (on.prompt_text, on.tokens)
    assert (_verbose(r_off)["prompt"], _tokens(r_off)) == (off.prompt_text, off.tokens)
    # thinking on: the model is inside <think>; without a </think> everything it wrote is reasoning
    assert on.parsed.reasoning and not on.parsed.content and "</think>" not in on.text
    assert r_on.choices[0].message.model_extra["reasoning_content"] == on.text
    assert r_on.choices[0].message.content == ""
    assert r_default.choices[0].message.model_extra["reasoning_content"] == on.text  # the default
    assert r_off.choices[0].message.model_extra.get("reasoning_content") is None
    assert r_off.choices[0].message.content == _content(off)
    # streamed reasoning arrives as delta.reasoning_content and reassembles
    chunks = list(client.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=20, temperature=0,
                                                 stream=True, extra_body=opts))
    streamed = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices)
    assert streamed == on.text
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_tool_call_round_trip(client: Any, ref: Reference) -> None:
    """tools, an assistant message with tool_calls and the tool's result go through the template: the
    server's prompt equals the reference rendering, and so does the answer."""
    args = json.dumps({"city": "Paris"})
    convo = [{"role": "user", "content": "What is the weather in Paris?"},
             {"role": "assistant", "content": "",
              "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                                 "arguments": args}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\": 21, \"sky\": \"clear\"}"}]
    want = ref.chat(convo, "ar", 16, thinking=False, tools=TOOLS, parse_tools=True)
    assert "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>" \
        in want.prompt_text
    assert "<tool_response>\n{\"temp_c\": 21" in want.prompt_text and "\"name\": \"get_weather\"" in want.prompt_text
    resp = client.chat.completions.create(model=MODEL_ID, messages=convo, tools=TOOLS, tool_choice="auto",
                                          max_tokens=16, temperature=0,
                                          extra_body={"mode": "ar", **TOKENS, **THINK_OFF})
    assert (_verbose(resp)["prompt"], _tokens(resp)) == (want.prompt_text, want.tokens)
    assert resp.usage.prompt_tokens == len(want.prompt_ids)
    assert resp.choices[0].message.content == _content(want)
    assert (resp.choices[0].message.tool_calls or []) == []  # random weights write no <tool_call>
    # content given as text parts renders the same prompt
    parts = [dict(m) for m in convo]
    parts[0]["content"] = [{"type": "text", "text": "What is the weather in Paris?"}]
    again = client.chat.completions.create(model=MODEL_ID, messages=parts, tools=TOOLS, max_tokens=16,
                                           temperature=0, extra_body={"mode": "ar", **TOKENS, **THINK_OFF})
    assert (_verbose(again)["prompt"], _tokens(again)) == (want.prompt_text, want.tokens)


def test_completions_and_stop(client: Any, ref: Reference) -> None:
    prompt = "def fibonacci(n):\n    if n < 2:\n"
    want = ref.completion(prompt, "diffusion", 24, **DIFFUSION)
    extra = {"mode": "diffusion", **DIFFUSION}
    resp = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=24, temperature=0,
                                     extra_body={**extra, **TOKENS})
    assert resp.choices[0].text == want.text
    assert _tokens(resp) == want.tokens
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(want.prompt_ids), len(want.tokens))
    _check_timings(_timings(resp), want, "diffusion")
    ids = client.completions.create(model=MODEL_ID, prompt=want.prompt_ids, max_tokens=24, temperature=0,
                                    extra_body={**extra, **TOKENS})
    assert (ids.choices[0].text, _tokens(ids)) == (want.text, want.tokens)  # the prompt as token ids
    chunks = list(client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=24, temperature=0,
                                            stream=True, extra_body=extra))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    # a stop string cuts the text before it, with finish_reason "stop"
    stop = want.text[len(want.text) // 2:len(want.text) // 2 + 3]
    cut = want.text[:want.text.index(stop)]
    stopped = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
                                        extra_body=extra)
    assert stopped.choices[0].text == cut and stopped.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=24, temperature=0,
                                            stop=stop, stream=True, extra_body=extra))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == cut


def test_echo_is_honoured(client: Any) -> None:
    """/v1/completions' echo puts the prompt before the answer, streamed or not, for each prompt of a list (patch
    server-completions-echo-and-openai-logprobs: llama-server ignored it)."""
    prompt = "def fibonacci(n):\n"
    plain = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=4, temperature=0)
    echo = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=4, temperature=0, echo=True)
    assert echo.choices[0].text == prompt + plain.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL_ID, prompt=prompt, max_tokens=4, temperature=0, echo=True, stream=True) if c.choices)
    assert streamed == echo.choices[0].text
    both = client.completions.create(model=MODEL_ID, prompt=[prompt, "x = "], max_tokens=2, temperature=0, echo=True)
    texts = [c.text for c in sorted(both.choices, key=lambda c: c.index)]
    assert texts[0].startswith(prompt) and texts[1].startswith("x = "), texts


@pytest.mark.parametrize(("field", "value", "fragment"), [
    ("suffix", "    return n\n", "Unsupported param: suffix"), ("best_of", 2, "Unsupported param: best_of")])
def test_completions_fields_llama_server_does_not_carry_out(server: str, field: str, value: Any,
                                                            fragment: str) -> None:
    got, err = post_raw(server + "/v1/completions", json.dumps(
        {"model": MODEL_ID, "prompt": "def fibonacci(n):\n", field: value, "max_tokens": 4}).encode())
    assert got == 400 and fragment in err["error"]["message"], (got, err)
    assert err["error"]["type"] == "invalid_request_error", err


def test_eight_concurrent_clients(client: Any, ref: Reference, server: str) -> None:
    """Eight threads at once on one slot (llama-server queues them), mixed modes and streaming: each answer equals
    the reference's, and /metrics counts every generated token."""
    before = server_metrics(server)
    cases = []
    for i in range(8):
        mode = ("ar", "diffusion", "spec")[i % 3]
        opts = {"diffusion": DIFFUSION, "spec": {"block_size": 8}}.get(mode, {})
        messages = [{"role": "user", "content": f"Client {i}: write a loop that counts to {3 + i}."}]
        cases.append((messages, mode, opts, i % 2 == 1))

    def run(i: int) -> tuple[str | None, list[int] | None, int]:
        messages, mode, opts, stream = cases[i]
        extra = {"mode": mode, **opts, **THINK_OFF}
        if stream:
            chunks = list(client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=20,
                                                         temperature=0, stream=True,
                                                         stream_options={"include_usage": True}, extra_body=extra))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            return text, None, chunks[-1].usage.completion_tokens
        resp = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=20,
                                              temperature=0, extra_body={**extra, **TOKENS})
        return resp.choices[0].message.content, _tokens(resp), resp.usage.completion_tokens

    results = run_concurrently(run, 8)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors
    for i, (messages, mode, opts, stream) in enumerate(cases):
        want = ref.chat(messages, mode, 20, thinking=False, **opts)
        text, tokens, n = results[i]
        assert text == _content(want), f"client {i} ({mode})"
        assert n == len(want.tokens), f"client {i} ({mode})"
        if not stream:
            assert tokens == want.tokens, f"client {i} ({mode})"
    after = server_metrics(server)
    assert after["tokens_predicted_total"] - before["tokens_predicted_total"] == sum(r[2] for r in results)
    assert after["requests_processing"] == 0 and after["requests_deferred"] == 0, after


@pytest.fixture(scope="module")
def parallel(tiny_gguf: Path) -> Iterator[str]:
    with clover_serve(tiny_gguf, *BASE, "-np", "3", "-c", "6144", "--max-block-size", "32", "--metrics") as \
            (url, _, _):
        yield url


def test_parallel_slots_serve_concurrent_clients(parallel: str, ref: Reference) -> None:
    """`-np 3`: six clients at once, mixed modes; each answer equals the reference's, every slot served, their
    tokens decoded in shared batches (/metrics' busy slots per decode), and -c divided among the slots."""
    client = _client(parallel)
    assert get(parallel + "/props")["default_generation_settings"]["n_ctx"] == 2048
    assert [(s["id"], s["n_ctx"]) for s in _slots(parallel)] == [(0, 2048), (1, 2048), (2, 2048)]
    cases = [([{"role": "user", "content": f"Client {i}: write a loop that counts to {3 + i}."}],
              ("ar", "ar", "spec", "diffusion", "auto", "ar")[i]) for i in range(6)]
    opts = {"diffusion": DIFFUSION, "spec": {"block_size": 8}}

    def run(i: int) -> tuple[str | None, list[int], int]:
        messages, mode = cases[i]
        resp = client.chat.completions.create(
            model=MODEL_ID, messages=messages, max_tokens=20, temperature=0,
            extra_body={"mode": mode, **TOKENS, **opts.get(mode, {}), **THINK_OFF})
        return resp.choices[0].message.content, _tokens(resp), _verbose(resp)["id_slot"]

    results = run_concurrently(run, len(cases))
    for i, (messages, mode) in enumerate(cases):
        assert not isinstance(results[i], BaseException), f"client {i} ({mode}): {results[i]!r}"
        want = ref.chat(messages, "ar" if mode == "auto" else mode, 20, thinking=False, **opts.get(mode, {}))
        assert results[i][1] == want.tokens, f"client {i} ({mode})"
        assert results[i][0] == _content(want), f"client {i} ({mode})"
    assert sorted({r[2] for r in results}) == [0, 1, 2], results
    assert server_metrics(parallel)["n_busy_slots_per_decode"] > 1


def _idle(url: str, deadline_s: float) -> bool:
    """Whether every slot is idle within ``deadline_s``, asked at 1.1 s intervals: llama-server notices a closed
    connection of a request that is not streamed only after a second without any result on its queue, and each
    /slots answer is such a result."""
    deadline = time.monotonic() + deadline_s
    while True:
        time.sleep(1.1)
        if not any(s["is_processing"] for s in _slots(url)):
            return True
        if time.monotonic() > deadline:
            return False


def _answer(client: Any, messages: list[dict[str, Any]], mode: str, thinking: bool,
            cache: bool) -> tuple[str, list[int], int, Any]:
    resp = client.chat.completions.create(
        model=MODEL_ID, messages=messages, max_tokens=16, temperature=0,
        extra_body={"mode": mode, **TOKENS, "cache_prompt": cache,
                    "chat_template_kwargs": {"enable_thinking": thinking}})
    return _verbose(resp)["prompt"], _tokens(resp), resp.usage.prompt_tokens_details.cached_tokens, resp


@pytest.mark.parametrize("mode", ["ar", "auto"])
@pytest.mark.parametrize("thinking", [False, True])
def test_multi_turn_chat_reuses_the_prefix_and_answers_as_without(client: Any, ref: Reference, tiny_model: Any,
                                                                  mode: str, thinking: bool) -> None:
    """Turns 2 and 3 reuse a prefix of the history (usage.prompt_tokens_details.cached_tokens), a rollback (turn 3
    asks turn 2 again) and a cancelled request in between change nothing: every answer equals the same request on a
    fresh history (cache_prompt false), or diverges first at a near-tie of the reference. llama-server restores the
    recurrent state from its checkpoints, the nearest at the start of an earlier user message: at least the system
    turn is reused (the earlier server reused all but the last generation prompt)."""
    from tests.support.engine import Ledger

    ledger = Ledger()
    messages = list(USER)
    for turn, question in enumerate(["And now subtract them.", "Multiply them too.", "Divide them instead."]):
        if turn == 2:  # rollback: turn 2 asked again, after a request that is cancelled mid-stream
            messages = messages[:-2]
            stream = client.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=400, temperature=0,
                                                    stream=True, extra_body={"mode": mode, "ignore_eos": True})
            next(iter(stream))
            stream.close()
        prompt, tokens, cached, resp = _answer(client, messages, mode, thinking, cache=True)
        prompt_ids = ref.ids(prompt)
        assert prompt == ref.render(messages, thinking=thinking) and resp.usage.prompt_tokens == len(prompt_ids)
        if turn == 0:
            system_turn = len(ref.ids(prompt[:prompt.index("<|im_start|>user")]))
        else:
            assert system_turn <= cached < len(prompt_ids), (cached, system_turn, len(prompt_ids))
        want_prompt, want, fresh, _ = _answer(client, messages, mode, thinking, cache=False)
        assert fresh == 0 and prompt == want_prompt
        ledger.check(f"serve/turn{turn}/{mode}/think={thinking}", tokens, want, tiny_model, prompt_ids)
        messages = messages + [{"role": "assistant", "content": resp.choices[0].message.content or "ok"},
                               {"role": "user", "content": question}]
    assert len(ledger.near_ties) <= 1, ledger.near_ties


def test_disconnect_mid_stream_frees_the_slot(client: Any, ref: Reference, server: str) -> None:
    """A long streamed generation (about a minute here) is dropped after its first chunks: llama-server cancels it,
    the slot is free at once, and the next request is answered at once and correctly."""
    before = server_metrics(server)
    stream = client.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=4000, temperature=0,
                                            stream=True, extra_body={**LONG, **THINK_OFF})
    seen = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            seen += 1
            if seen == 2:
                break
    stream.close()
    start = time.monotonic()
    want = ref.chat(USER, "ar", 12, thinking=False)
    resp = client.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=12, temperature=0,
                                          extra_body={"mode": "ar", **TOKENS, **THINK_OFF})
    waited = time.monotonic() - start
    assert _tokens(resp) == want.tokens
    assert waited < 15, f"the next request waited {waited:.1f} s: the dropped generation kept the slot"
    dropped = server_metrics(server)["tokens_predicted_total"] - before["tokens_predicted_total"] - len(want.tokens)
    assert 2 <= dropped < 1000, dropped


def _send(url: str, path: str, body: dict[str, Any]) -> socket.socket:
    """A POST on a raw socket, left open (its answer unread)."""
    host, port = address(url)
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, port), timeout=30)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _abandoned(gguf: Path) -> dict[str, Any]:
    """On a one-slot server of its own: a long answer that is not streamed, its client gone after 0.5 s; whether its
    slot still decodes after 1.5 s of /slots asked back to back (a monitor; any other request's result does the
    same), whether it is idle after a second of quiet then, and how many tokens it decoded."""
    with clover_serve(gguf, *BASE, "-c", "4096", "-np", "1", "--max-block-size", "32", "--metrics") as (url, _, _):
        sock = _send(url, "/v1/chat/completions", {"model": MODEL_ID, "messages": USER, "max_tokens": 4000,
                                                   "temperature": 0, **LONG, **THINK_OFF})
        time.sleep(0.5)
        sock.close()
        end = time.monotonic() + 1.5
        while True:
            polled = _slots(url)[0]["is_processing"]
            if time.monotonic() > end:
                break
        idle = _idle(url, 15)
        return {"decoding while polled": polled, "idle after quiet": idle,
                "decoded": server_metrics(url)["tokens_predicted_total"]}


def test_disconnect_while_waiting_for_a_full_answer(background: dict[str, Future[dict[str, Any]]]) -> None:
    """A client that stops waiting for an answer that is not streamed: llama-server cancels the request (within a
    second), long before its 4000 tokens."""
    abandoned = background["abandoned"].result()
    assert abandoned["idle after quiet"] and 0 < abandoned["decoded"] < 3000, abandoned


def test_disconnect_while_waiting_is_noticed_on_a_busy_server(background: dict[str, Future[dict[str, Any]]]) -> None:
    """Noticed while others are answered (patch server-result-wait-has-a-deadline): every result sent to any request
    restarted the HTTP thread's one-second wait, so with /slots asked back to back the abandoned answer decoded on."""
    abandoned = background["abandoned"].result()
    assert not abandoned["decoding while polled"], abandoned


# ============================================================================ bad requests
def _chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


CONTEXT = "exceed_context_size_error"
# (name, body, message fragment, error type): llama-server's 400s, each naming the problem in its message (its error
# object has no `param`; its type is invalid_request_error, or exceed_context_size_error for the context)
IMAGE = _chat_body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
NOT_A_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": ["not", "a", "schema"]}}
BAD_CHAT = [
    ("no messages", {"model": MODEL_ID}, "'messages' is required", None),
    ("user without content", _chat_body(messages=[{"role": "user"}]), "must contain 'content'", None),
    ("prompt too long", _chat_body(messages=[{"role": "user", "content": "word " * 5000}]),
     "exceeds the available context size (4096 tokens)", CONTEXT),
    ("prompt characters", _chat_body(messages=[{"role": "user", "content": "x" * 300_000}]),
     "exceeds the available context size (4096 tokens)", CONTEXT),
    ("n beyond the slots", _chat_body(n=2), "Field 'n': Value must be between 1 <= value <= 1", None),
    ("mode", _chat_body(mode="beam"), "Field 'mode': unknown mode 'beam'", None),
    ("block_size 0", _chat_body(block_size=0), "Field 'block_size': Value must be between 1 <= value <= 32", None),
    ("block_size beyond --max-block-size", _chat_body(block_size=33),
     "Field 'block_size': Value must be between 1 <= value <= 32", None),
    ("threshold", _chat_body(threshold=1.5), "Field 'threshold'", None),
    ("bad tool", _chat_body(tools=[{"type": "function", "function": {"description": "no name"}}]),
     "Failed to parse tools", None),
    ("top_logprobs without logprobs", _chat_body(top_logprobs=2), "top_logprobs requires logprobs", None),
    ("response_format unknown", _chat_body(response_format={"type": "xml"}), "response_format type must be", None),
    ("enable_thinking type", _chat_body(chat_template_kwargs={"enable_thinking": "yes"}),
     "invalid type for \"enable_thinking\"", None),
    ("schema with a dangling $ref", _chat_body(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}),
     "cannot resolve $ref #/nowhere", None),
    ("json_schema not an object", _chat_body(json_schema=["not", "a", "schema"]), "schema must be an object", None),
    ("left-recursive grammar", _chat_body(grammar='root ::= root "a"'),
     "failed to parse grammar: unsupported grammar, left recursion detected", None),
    ("presence_penalty string", _chat_body(presence_penalty="2"), "Field 'presence_penalty'", None),
    ("frequency_penalty string", _chat_body(frequency_penalty="-3"), "Field 'frequency_penalty'", None),
    ("repeat_penalty 0", _chat_body(repeat_penalty=0), "penalty_repeat must be finite and greater than 0", None),
    ("stream type", _chat_body(stream="maybe"), "Field 'stream'", None),
    ("stream string yes", _chat_body(stream="yes"), "Field 'stream'", None),
    ("max_tokens string", _chat_body(max_tokens="8"), "Field 'max_tokens'", None),
    ("n string", _chat_body(n="1"), "Field 'n'", None),
    ("temperature string", _chat_body(temperature="0.5"), "Field 'temperature'", None),
    ("ignore_eos number", _chat_body(ignore_eos=1), "Field 'ignore_eos'", None),
    ("include_usage string", _chat_body(stream=True, stream_options={"include_usage": "true"}),
     "Field 'include_usage'", None),
    ("lone surrogate", _chat_body(messages=[{"role": "user", "content": "a\ud800b"}]), "invalid JSON", None),
    ("lone surrogate in the model", _chat_body(model="x\udfff"), "invalid JSON", None),
    # 500s or ignored before patch server-more-bad-requests-are-400
    ("image part", IMAGE, "image input is not supported", None),
    ("grammar and json_schema", _chat_body(grammar='root ::= "a"', json_schema={"type": "object"}),
     "Cannot use both json_schema and grammar", None),
    ("response_format schema not an object", _chat_body(response_format=NOT_A_SCHEMA, **THINK_OFF),
     "'response_format.json_schema.schema' must be an object", None),
    ("tool_choice required without tools", _chat_body(tool_choice="required"), "lists no tools", None),
    # a 500 (the grammar failed on the token it could not refuse) before patch sampling-no-candidate-is-a-bad-request
    ("grammar token outside the vocabulary", _chat_body(grammar="root ::= <[999999]>"),
     "the grammar, the logit bias and the banned tokens together allow none", None),
    # the Qwen3.5 family's template raises on these: 500s before patch server-template-error-is-a-bad-request
    ("empty messages", _chat_body(messages=[]), "No messages provided.", None),
    ("no user turn", _chat_body(messages=[{"role": "system", "content": "x"}]), "No user query found in messages.",
     None),
    ("bad role", _chat_body(messages=[{"role": "user", "content": "x"}, {"role": "robot", "content": "x"}]),
     "Unexpected message role.", None),
]


def _check_error(got: int, err: dict[str, Any], fragment: str, kind: str | None = None, status: int = 400) -> None:
    assert got == status, err
    assert set(err) == {"error"} and err["error"]["code"] == status, err
    assert err["error"]["type"] == (kind or "invalid_request_error"), err
    assert fragment in err["error"]["message"], err


@pytest.mark.parametrize("name,body,fragment,kind", BAD_CHAT, ids=[c[0] for c in BAD_CHAT])
def test_bad_chat_requests(server: str, name: str, body: dict[str, Any], fragment: str, kind: str | None) -> None:
    got, err = post_raw(server + "/v1/chat/completions", json.dumps(body).encode())
    _check_error(got, err, fragment, kind)


# Requests the earlier server refused that llama-server answers, each with what it does instead
# (name, body, check of the answer)
def _first_ids(answer: dict[str, Any]) -> list[int]:
    return emitted_tokens(answer["__verbose"])


ACCEPTED_CHAT: list[tuple[str, dict[str, Any], Any]] = [
    # one model: the field is not checked, the answer names the served model
    ("unknown model", _chat_body(model="gpt-4o"), lambda a: a["model"] == MODEL_ID),
    # out-of-range sampling values are clamped: temperature to 0 (greedy), top_p to [0, 1]
    ("temperature -1", _chat_body(temperature=-1, **TOKENS),
     lambda a: a["__verbose"]["generation_settings"]["temperature"] == 0),
    ("top_p 0", _chat_body(top_p=0, **TOKENS), lambda a: a["__verbose"]["generation_settings"]["top_p"] == 0),
    # no cap on top_logprobs (OpenAI's is 20) or on the number of stop strings (OpenAI's is 4)
    ("top_logprobs 21", _chat_body(logprobs=True, top_logprobs=21),
     lambda a: [len(t["top_logprobs"]) for t in a["choices"][0]["logprobs"]["content"]] == [21] * 4),
    ("five stops", _chat_body(stop=["a", "b", "c", "d", "e"], **TOKENS),
     lambda a: a["__verbose"]["generation_settings"]["stop"] == ["a", "b", "c", "d", "e"]),
    # logit_bias: any value (300 makes the token every answer), ids outside the vocabulary are skipped
    ("logit_bias 300", _chat_body(logit_bias={"5": 300}, **TOKENS), lambda a: _first_ids(a) == [5] * 4),
    ("logit_bias token outside the vocabulary", _chat_body(logit_bias={"999999": 1, "7": 300}, **TOKENS),
     lambda a: _first_ids(a) == [7] * 4 and a["__verbose"]["generation_settings"]["logit_bias"] == [
         {"bias": 300.0, "token": 7}]),
    ("stream_options without stream", _chat_body(stream_options={"include_usage": True}),
     lambda a: a["object"] == "chat.completion" and a["usage"]["completion_tokens"] == 4),
]


@pytest.mark.parametrize("name,body,check", ACCEPTED_CHAT, ids=[c[0] for c in ACCEPTED_CHAT])
def test_chat_requests_llama_server_accepts(server: str, name: str, body: dict[str, Any], check: Any) -> None:
    got, answer = post_raw(server + "/v1/chat/completions", json.dumps(body).encode())
    assert got == 200, answer
    assert check(answer), answer


@pytest.mark.parametrize("mode", ["ar", "auto", "diffusion"])
def test_max_tokens_0_generates_nothing(server: str, mode: str) -> None:
    """max_tokens 0 is documented (tools/server/README.md, n_predict) as 'no tokens will be generated but the prompt
    is evaluated into the cache' (patch server-max-tokens-0-generates-nothing; llama-server generated one token)."""
    prompt = f"def count_{mode}(items):\n    total = 0\n    for item in items:\n"
    got, answer = post(server + "/v1/completions", {"model": MODEL_ID, "prompt": prompt, "max_tokens": 0,
                                                    "mode": mode})
    assert got == 200 and answer["usage"]["completion_tokens"] == 0 and answer["choices"][0]["text"] == "", answer
    assert answer["choices"][0]["finish_reason"] == "length", answer
    # the prompt went into the cache: the same prompt again reuses it
    got, again = post(server + "/v1/completions", {"model": MODEL_ID, "prompt": prompt, "max_tokens": 1,
                                                   "mode": mode})
    assert got == 200 and again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, again
    got, answer = post(server + "/v1/chat/completions", {"model": MODEL_ID, "max_tokens": 0, "mode": mode,
                                                         "messages": [{"role": "user", "content": prompt}]})
    assert got == 200 and answer["usage"]["completion_tokens"] == 0, answer
    assert not answer["choices"][0]["message"].get("content"), answer


# (name, fields, status, message fragment or the check of a 200 answer): llama-server's own rules for the prompt
COMPLETIONS = [
    ("batched prompts", {"prompt": ["a", "b"]}, 200, lambda a: [c["index"] for c in a["choices"]] == [0, 1]),
    ("token ids as strings", {"prompt": ["1", "2"]}, 200, lambda a: len(a["choices"]) == 2),  # two text prompts
    ("empty prompt", {"prompt": ""}, 200, lambda a: a["usage"]["total_tokens"] == 0 and a["choices"][0]["text"] == ""),
    ("logprobs 21", {"prompt": "x", "logprobs": 21},
     200, lambda a: [len(t["top_logprobs"]) for t in a["choices"][0]["logprobs"]["content"]] == [21, 21]),
    ("stream_options without stream", {"prompt": "x", "stream_options": {"include_usage": True}},
     200, lambda a: a["object"] == "text_completion"),
    ("token outside the vocabulary", {"prompt": [1, 2, 999999]}, 400, "Prompt contains invalid tokens"),
    ("prompt type", {"prompt": {"text": "x"}}, 400, '"prompt" elements must be'),
    ("max_tokens string", {"prompt": "x", "max_tokens": "8"}, 400, "Field 'max_tokens'"),
    ("echo string", {"prompt": "x", "echo": "yes"}, 400, "Field 'echo'"),
    ("lone surrogate", {"prompt": "\udc80"}, 400, "invalid JSON"),
    ("prompt characters", {"prompt": "x" * 300_000}, 400, "exceeds the available context size (4096 tokens)"),
]


@pytest.mark.parametrize("name,fields,status,expect", COMPLETIONS, ids=[c[0] for c in COMPLETIONS])
def test_completion_requests(server: str, name: str, fields: dict[str, Any], status: int, expect: Any) -> None:
    got, answer = post_raw(server + "/v1/completions", json.dumps({"model": MODEL_ID, "max_tokens": 2,
                                                                   **fields}).encode())
    if status == 200:
        assert got == 200 and expect(answer), answer
    else:
        _check_error(got, answer, expect, CONTEXT if "context" in expect else None)


# llama-server reads the sampling fields into 32-bit values: numbers beyond a float's range become +-inf and are
# taken, out-of-range ones are clamped where its schema has soft limits (temperature >= 0, top_k), and refused where
# it has hard ones (block_size) or the sampler checks them (repeat_penalty > 0)
SAMPLING_RANGES = [
    ({"temperature": 3.5, "presence_penalty": -5, "frequency_penalty": 7.5, "repeat_penalty": 20}, None),
    ({"temperature": 0, "presence_penalty": 3.4e38, "frequency_penalty": -3.4e38, "repeat_penalty": 1e-3}, None),
    ({"temperature": -0.1}, None), ({"temperature": 1e308}, None),
    ({"presence_penalty": 1e39}, None), ({"frequency_penalty": -1e39}, None), ({"repeat_penalty": 1e39}, None),
    ({"top_k": 2**31}, None), ({"top_k": 2**63}, None),
    ({"repeat_penalty": 0}, "penalty_repeat must be finite and greater than 0"),
    ({"block_size": 2**31}, "Field 'block_size': Value must be between 1 <= value <= 32"),
]


@pytest.mark.parametrize("fields,fragment", SAMPLING_RANGES)
def test_sampling_ranges_are_llama_servers(server: str, fields: dict[str, Any], fragment: str | None) -> None:
    got, body = post_raw(server + "/v1/completions", json.dumps({"model": MODEL_ID, "prompt": "x", "max_tokens": 1,
                                                                "mode": "ar", **fields}).encode())
    if fragment is None:
        assert got == 200 and body["usage"]["completion_tokens"] == 1, body
    else:
        _check_error(got, body, fragment)


def test_bad_http(server: str, client: Any) -> None:
    from openai import BadRequestError

    for raw, fragment in ((b'{"model": "tiny", "messages": [', "invalid JSON"), (b"[1, 2]", "'messages' is required"),
                          (b"\xff\xfe garbage", "invalid JSON")):
        got, err = post_raw(server + "/v1/chat/completions", raw)
        _check_error(got, err, fragment)
    # llama-server's unknown route, and a known one with another method, are 404s (the earlier server: 405 for this)
    for method, path in (("POST", "/v1/nothing"), ("GET", "/v1/chat/completions")):
        got, err = post_raw(server + path, b"{}", method=method)
        assert (got, err["error"]["type"], err["error"]["message"]) == (404, "not_found_error", "File Not Found")
    with pytest.raises(BadRequestError) as br:
        client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "x"}], n=3)
    assert "Field 'n'" in br.value.message
    # after all that the server still answers
    assert get(server + "/health") == {"status": "ok"}
    ok = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                        extra_body={"mode": "ar"})
    assert ok.usage.completion_tokens == 3


# ============================================================================ hardening: limits, keys, hostile input
@pytest.mark.parametrize("ask", [{"mode": "ar", "temperature": 0}, {"mode": "ar", "temperature": 1.0, "seed": 3},
                                 {"mode": "diffusion", "temperature": 0}], ids=["greedy", "sampled", "diffusion"])
def test_logit_bias_that_bans_every_token(server: str, ask: dict[str, Any]) -> None:
    """A bias that bans every token is a 400 naming it (it gave tokens it had banned, 30 '?' four times), in every
    mode (patch sampling-no-candidate-is-a-bad-request)."""
    got, answer = post(server + "/completion", {"prompt": "x", "n_predict": 4, "return_tokens": True, **ask,
                                                "logit_bias": [[t, False] for t in range(N_VOCAB)]})
    assert got == 400 and "the logit bias" in answer["error"]["message"], (got, answer)
    assert answer["error"]["type"] == "invalid_request_error", answer


def test_logit_bias_that_leaves_one_token(server: str) -> None:
    got, answer = post(server + "/completion", {"prompt": "x", "n_predict": 4, "return_tokens": True,
                                                "logit_bias": [[t, False] for t in range(N_VOCAB) if t != 5]})
    assert got == 200 and answer["tokens"] == [5] * 4, answer


def _over_the_cap() -> Iterator[bytes]:
    """A chat body of more than cpp-httplib's 100 MiB payload cap, in 1 MiB pieces."""
    yield b'{"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "'
    piece = b"x" * 2**20
    for _ in range(101):
        yield piece
    yield b'"}]}'


def _chunked_over_the_cap(server: str) -> tuple[int, bytes]:
    conn = http_client.HTTPConnection(*address(server), timeout=60)
    try:
        conn.request("POST", "/v1/chat/completions", body=_over_the_cap(), headers={"Content-Type": "application/json"},
                     encode_chunked=True)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_a_body_over_the_cap_is_a_413(server: str) -> None:
    """llama-server's body limit is cpp-httplib's payload cap, 100 MiB (no flag sets it: --max-body-bytes, 8 MiB by
    default in the earlier server, is refused): a chunked body is counted while it arrives."""
    status, _ = _chunked_over_the_cap(server)
    assert status == 413
    assert get(server + "/health") == {"status": "ok"}


def test_the_413_has_the_error_body(server: str) -> None:
    """cpp-httplib's own 413 had an empty body (patch server-http-errors-have-a-body)."""
    status, body = _chunked_over_the_cap(server)
    assert status == 413 and "error" in json.loads(body or b"{}"), body[:200]


def _declared_length(url: str) -> dict[str, Any]:
    """A request that declares a body over the cap (101 MiB) and sends none: its answer within 1 s (None: none)."""
    conn = http_client.HTTPConnection(*address(url), timeout=1)
    try:
        conn.putrequest("POST", "/v1/chat/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(101 * 2**20))
        conn.endheaders()  # and no body: the answer should come without it
        try:
            return {"status": conn.getresponse().status}
        except TimeoutError:
            return {"status": None}
    finally:
        conn.close()


def test_a_declared_length_over_the_cap_is_answered_at_once(background: dict[str, Future[dict[str, Any]]]) -> None:
    """cpp-httplib read (and discarded) a declared length over the cap before its 413, holding the connection until
    the read timeout (patch vendor-httplib-refuse-declared-oversize-body)."""
    declared = background["declared length"].result()
    assert declared["status"] == 413, declared


HOSTILE_TEMPLATE = """{%- macro deeper(n) -%}{{ deeper(n + 1) }}{%- endmacro -%}
{%- set c = messages[-1]['content'] -%}
{%- if c == 'loop' -%}{%- for i in range(100000) -%}{%- for j in range(100000) -%}{%- endfor -%}{%- endfor -%}
{%- elif c == 'raise' -%}{{ raise_exception('this template refuses') }}
{%- elif c == 'recurse' -%}{{ deeper(0) }}
{%- else -%}<|im_start|>user
{{ c }}<|im_end|>
<|im_start|>assistant
{% endif -%}"""
KEYS = ["file-key-1", "file-key-2"]


def _hardened_args(folder: Path) -> tuple[str, ...]:
    """-c 64, API keys (the flag and a file, with a comment and blank lines), a hostile chat template, at most 1,024
    messages; the files are written once (servers of the background observations may be reading them)."""
    for name, text in (("hostile.jinja", HOSTILE_TEMPLATE), ("keys.txt", f"\n{KEYS[0]}\n# a comment, not a key\n"
                                                                         f"{KEYS[1]}\n\n")):
        if not (folder / name).exists() or (folder / name).read_text() != text:
            (folder / name).write_text(text)
    return ("-c", "64", "-np", "1", "--api-key", "flag-key", "--api-key-file", str(folder / "keys.txt"),
            "--chat-template-file", str(folder / "hostile.jinja"), "--max-messages", "1024")


@pytest.fixture(scope="module")
def hardened(tiny_gguf: Path) -> Iterator[str]:
    with clover_serve(tiny_gguf, *BASE, *_hardened_args(tiny_gguf.parent)) as (url, _, _):
        yield url


KEY = auth("flag-key")


def test_api_keys(hardened: str) -> None:
    """Beyond tests/native/test_serve_api.py's one key: the keys of --api-key and of --api-key-file (its comment
    and blank lines are not keys), the X-Api-Key header, near misses refused, every API route guarded."""
    from openai import AuthenticationError

    body = json.dumps({"model": MODEL_ID, "prompt": "x", "max_tokens": 2}).encode()
    for headers in ({}, auth("wrong"), auth("flag-keyx"), {"Authorization": "Basic flag-key"}, auth("file-key-1x"),
                    auth("# a comment, not a key"), auth("")):
        got, err = post_raw(hardened + "/v1/completions", body, headers=headers)
        assert (got, err) == (401, {"error": {"message": "Invalid API Key", "type": "authentication_error",
                                              "code": 401}}), headers
    for path in ("/v1/models", "/props", "/slots", "/v1/nothing"):
        got, err = post_raw(hardened + path, b"", method="GET")
        assert got == 401 and err["error"]["type"] == "authentication_error", (path, err)
    for path in ("/tokenize", "/detokenize", "/apply-template", "/completion", "/v1/messages"):
        got, err = post_raw(hardened + path, b"{}")
        assert got == 401 and err["error"]["type"] == "authentication_error", (path, err)
    assert get(hardened + "/health") == {"status": "ok"}  # open without a key
    for key in ("flag-key", *KEYS):
        got, ok = post_raw(hardened + "/v1/completions", body, headers=auth(key))
        assert got == 200 and ok["usage"]["completion_tokens"] == 2, (key, ok)
    got, _ = post_raw(hardened + "/v1/completions", body, headers={"X-Api-Key": KEYS[1]})
    assert got == 200
    with pytest.raises(AuthenticationError):
        _client(hardened, "nope").models.list()
    assert _client(hardened, KEYS[0]).models.list().data[0].id == MODEL_ID


def test_small_context_is_reported_and_enforced(hardened: str) -> None:
    """-c 64: llama.cpp pads the context to a multiple of 256, and the server reports and enforces 256. A prompt
    that fills it is a 400 naming both sizes; a max_tokens beyond the room left is answered up to the context's end
    (finish_reason length; the earlier server refused it), as a request without max_tokens is."""
    props = post_raw(hardened + "/props", b"", method="GET", headers=KEY)[1]
    assert props["default_generation_settings"]["n_ctx"] == 256
    assert [s["n_ctx"] for s in post_raw(hardened + "/slots", b"", method="GET", headers=KEY)[1]] == [256]

    def complete(prompt: Any, **fields: Any) -> tuple[int, dict[str, Any]]:
        body = {"model": MODEL_ID, "prompt": prompt, "ignore_eos": True, **fields}
        return post_raw(hardened + "/v1/completions", json.dumps(body).encode(), headers=KEY)

    for prompt in ([5] * 256, [5] * 300, "word " * 300):
        got, err = complete(prompt, max_tokens=1)
        _check_error(got, err, "exceeds the available context size (256 tokens)", CONTEXT)
        assert err["error"]["n_ctx"] == 256 and err["error"]["n_prompt_tokens"] >= 256, err
    got, ok = complete([5] * 250, max_tokens=4)
    assert got == 200 and (ok["usage"]["prompt_tokens"], ok["usage"]["completion_tokens"]) == (250, 4), ok
    for fields in ({"max_tokens": 20}, {}):  # the room left: 256 - 250 positions
        got, ok = complete([5] * 250, **fields)
        assert got == 200 and ok["usage"]["completion_tokens"] == 6, (fields, ok)
        assert ok["choices"][0]["finish_reason"] == "length"


def _health_time(url: str) -> float:
    start = time.monotonic()
    assert get(url + "/health") == {"status": "ok"}
    return time.monotonic() - start


def _watch(url: str, send: Any, window: float) -> tuple[Any, float]:
    """send() on a thread while /health is asked every 0.1 s, for at most ``window`` seconds: (its answer, or None
    when it has not come, and the slowest /health)."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["answer"] = send()
        except (OSError, http_client.HTTPException):  # the connection of a request never answered, when it ends
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    slowest = 0.0
    end = time.monotonic() + window
    while thread.is_alive() and time.monotonic() < end:
        slowest = max(slowest, _health_time(url))
        time.sleep(0.1)
    thread.join(timeout=0.5)
    return result.get("answer"), slowest


def _hostile_chat(url: str, content: str, timeout: float = 60) -> Any:
    return http(url + "/v1/chat/completions", _chat_body(messages=[{"role": "user", "content": content}]), KEY,
                timeout=timeout)


def test_a_template_that_raises_is_a_400_and_health_answers(hardened: str) -> None:
    """The template's exception is the 400's message (llama-server's, several lines with the template's source)."""
    (got, _, raw), slowest = _watch(hardened, lambda: _hostile_chat(hardened, "raise"), 10)
    err = json.loads(raw)
    _check_error(got, err, "Jinja Exception: this template refuses")
    assert slowest < 1.0
    got, _, ok = _hostile_chat(hardened, "hello")
    assert got == 200, ok  # and the server still answers


def _endless_template(gguf: Path, args: tuple[str, ...]) -> dict[str, Any]:
    """A chat whose template loops 10^10 times, on a server of its own with --template-timeout 1, watched for 3 s;
    then the same server's answer to a chat the template renders at once."""
    with clover_serve(gguf, *BASE, *args, "--template-timeout", "1", alive_at_end=False) as (url, proc, _):
        try:
            answer, slowest = _watch(url, lambda: _hostile_chat(url, "loop", timeout=10), 3)
            after = _hostile_chat(url, "hello", timeout=60)[0] if answer is not None else None
            alive = proc.poll() is None
        finally:
            proc.kill()
    if answer is not None:
        answer = (answer[0], json.loads(answer[2]))
    return {"answer": answer, "slowest /health": slowest, "alive": alive, "after": after}


def _recursing_template(gguf: Path, args: tuple[str, ...]) -> dict[str, Any]:
    """A chat whose template recurses without end, on a server of its own: the answer (or the error of a connection
    closed without one) and whether the server is alive after."""
    with clover_serve(gguf, *BASE, *args, alive_at_end=False) as (url, proc, _):
        try:
            try:
                got: Any = _hostile_chat(url, "recurse")[0]
            except (OSError, http_client.HTTPException) as exc:
                got = repr(exc)
            time.sleep(0.2)
            alive = proc.poll() is None
        finally:
            proc.kill()
    return {"answer": got, "alive": alive, "exit status": proc.returncode}


def _stream_long(url: str) -> socket.socket:
    return _send(url, "/v1/completions", {"model": MODEL_ID, "prompt": "x", "max_tokens": 4000, "stream": True,
                                          **LONG})


def _busy_with_one_waiting(url: str, socks: list[socket.socket]) -> None:
    """The first long stream (``socks``) is under way on the one slot; a second is sent and waits for it (a
    RuntimeError otherwise, not an AssertionError: the test did not get to ask its question)."""
    if not socks[0].recv(4096).startswith(b"HTTP/1.1 200"):
        raise RuntimeError("the first stream has not started")
    socks.append(_stream_long(url))
    time.sleep(0.5)  # read, it waits for the slot
    if [s["is_processing"] for s in _slots(url)] != [True]:
        raise RuntimeError("the slot is not decoding the first stream")


# An idle machine exits in well under a second; the module's other background servers (an endless template among
# them) share the cores meanwhile, and a CI run once took over 2 s. Before the fix it never exited by itself.
SIGTERM_EXIT_S = 10


def _sigterm(gguf: Path) -> dict[str, Any]:
    """SIGTERM to a one-slot server while a long answer streams and another request waits for the slot: its exit
    status within SIGTERM_EXIT_S (None: still running; it is killed then)."""
    with clover_serve(gguf, *BASE, "-c", "4096", "-np", "1", "--max-block-size", "32", alive_at_end=False) as \
            (url, proc, _):
        socks = [_stream_long(url)]
        try:
            _busy_with_one_waiting(url, socks)
            start = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            try:
                status = proc.wait(timeout=SIGTERM_EXIT_S)
            except subprocess.TimeoutExpired:
                status = None
            return {"exit status": status, "seconds": time.monotonic() - start}
        finally:
            proc.kill()
            for s in socks:
                s.close()


def test_an_endless_template_does_not_hold_up_health(background: dict[str, Future[dict[str, Any]]]) -> None:
    endless = background["endless"].result()
    assert endless["alive"] and endless["slowest /health"] < 1.0, endless


def test_an_endless_template_is_a_400_at_the_time_limit(background: dict[str, Future[dict[str, Any]]]) -> None:
    """--template-timeout 1 ends the rendering: a 400 naming the limit, and the next chat is answered (patches
    chat-template-render-timeout, server-template-timeout; before them a loop of 10^6 steps took 35 s and was
    answered 200, one of 10^10 hours)."""
    endless = background["endless"].result()
    assert endless["answer"] is not None, endless
    status, body = endless["answer"]
    assert status == 400 and "time limit" in body["error"]["message"], endless
    assert endless["after"] == 200, endless


def test_a_recursing_template_is_a_4xx(background: dict[str, Future[dict[str, Any]]]) -> None:
    """A macro that calls itself without end overflowed an HTTP thread's stack: llama-server died with SIGSEGV (in
    common/jinja), every slot gone (patch jinja-macro-call-depth)."""
    recurse = background["recurse"].result()
    assert isinstance(recurse["answer"], int) and 400 <= recurse["answer"] < 500 and recurse["alive"], recurse


@pytest.fixture(scope="module")
def forty_thousand(hardened: str) -> dict[str, Any]:
    """40,000 messages, sent once and watched (the hostile template renders the last message alone)."""
    body = json.dumps(_chat_body(messages=[{"role": "user", "content": "hello there"}] * 40_000)).encode()
    answer, slowest = _watch(hardened, lambda: post_raw(hardened + "/v1/chat/completions", body, headers=KEY), 60)
    return {"answer": answer, "slowest": slowest}


def test_forty_thousand_messages_are_refused_and_do_not_freeze_the_server(forty_thousand: dict[str, Any]) -> None:
    """/health answers while the request is read; --max-messages 1024 refuses it before the template renders it
    (patch server-max-messages: with no cap, llama-server answered 40,000 messages, and with the checkpoint's own
    template the request kept an HTTP thread busy 80 s before its 400 for the context)."""
    assert forty_thousand["slowest"] < 1.0, forty_thousand["slowest"]
    got, answer = forty_thousand["answer"]
    assert got == 400 and "more than the 1024" in answer["error"]["message"], answer


def test_a_full_queue_is_a_429(tiny_gguf: Path) -> None:
    """With one slot decoding and one request waiting, a third is answered 429 at once (--max-queue 1, patch
    server-max-queue; llama-server queued every request before)."""
    with clover_serve(tiny_gguf, *BASE, "-c", "4096", "-np", "1", "--max-block-size", "32", "--max-queue", "1",
                      ready_s=30) as (url, _, _):
        socks = [_stream_long(url)]
        try:
            _busy_with_one_waiting(url, socks)
            got, err = post_raw(url + "/v1/completions", json.dumps({"model": MODEL_ID, "prompt": "x"}).encode())
            assert got == 429 and "--max-queue" in err["error"]["message"], (got, err)
            assert err["error"]["type"] == "rate_limit_error", err
        finally:
            for sock in socks:
                sock.close()
        # the two left: their places are free again (the server notices a gone client within about a second)
        deadline = time.monotonic() + 15
        while (got := post_raw(url + "/v1/completions", json.dumps({"model": MODEL_ID, "prompt": "x",
                                                                     "max_tokens": 2}).encode())[0]) == 429:
            assert time.monotonic() < deadline, "still 429 after the requests went"
            time.sleep(0.2)
        assert got == 200


def test_sigterm_stops_the_server_quickly(background: dict[str, Future[dict[str, Any]]]) -> None:
    """It exits by itself, with status 0, within SIGTERM_EXIT_S. Before patch server-stop-ends-waiting-handlers,
    llama-server logged 'cleaning up before exit...' and went on until a second signal (6 of 6 tries): its HTTP
    handlers kept waiting for results of the stopped decoding loop."""
    sigterm = background["sigterm"].result()
    assert sigterm["exit status"] == 0, sigterm
