"""`clover-cpp serve` (docs/serve.md): a live server on the tiny GGUF driven by the official `openai` client.

Every answer is compared with the reference: the checkpoint's chat template rendered by clover_ref,
tokenized by its tokenizer.json and decoded greedily by clover_ref.decode on a fresh history. The server's pure
parts are tested in tests/surfaces/test_serve_units.py.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.chat import Reference
from tests.support.engine import run_concurrently
from tests.support.serve import MODEL_ID, THINK_OFF, auth as _auth, get as _get, post as _post, post_raw as _post_raw
from tests.support.serve import serve as _serve

pytestmark = pytest.mark.native  # every test here runs a live server (skipped without the build; a failure in CI)


@pytest.fixture(scope="module")
def server(tiny_gguf: Path) -> Iterator[str]:
    with _serve(tiny_gguf, tiny_gguf.parent, "--max-block-size", "32") as (url, _, _):
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)


def _token_ids(resp: Any) -> tuple[list[int], list[int]]:
    extra = resp.model_extra or {}
    choice = resp.choices[0].model_extra or {}
    return extra["prompt_token_ids"], choice["token_ids"]


def _clover(resp: Any) -> dict[str, Any]:
    return resp.usage.model_extra["clover"]


def _check_stats(clover: dict[str, Any], want_stats: Any, mode: str) -> None:
    assert clover["mode"] == mode
    assert clover["generated_tokens"] == want_stats.generated_tokens
    assert (clover["block_passes"], clover["causal_passes"]) == (want_stats.block_passes, want_stats.causal_passes)
    assert clover["stop_reason"] == want_stats.stop_reason
    passes = clover["block_passes"] + clover["causal_passes"]
    assert clover["tokens_per_pass"] == pytest.approx(clover["generated_tokens"] / passes)


USER = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Write a function that adds two numbers."}]


def test_models_and_health(client: Any, server: str) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_ID]
    card = models.data[0].model_extra["clover"]
    assert card["n_ctx"] == 4096 and card["block_size"] == 8 and card["max_block_size"] == 32
    assert client.models.retrieve(MODEL_ID).id == MODEL_ID
    health = _get(server + "/health")
    assert health["status"] == "ok" and health["model"] == MODEL_ID


def _piece_bytes(piece: str | list[int]) -> bytes:
    return piece.encode() if isinstance(piece, str) else bytes(piece)


def test_tokenize_and_detokenize_as_llama_server(server: str, ref: Reference) -> None:
    """llama-server's shapes (tools/server/README.md of the pinned llama.cpp, "POST /tokenize" and "POST
    /detokenize"): ``{"tokens": [ids]}``; with ``with_pieces``, ``{"id", "piece"}`` objects whose piece is the text
    when it is valid UTF-8 and a list of bytes otherwise; ``{"content": text}`` back. The ids are the checkpoint's
    tokenizer.json's."""
    text = "def add(a, b):\n    return a + b  # \U0001d518 sum"
    got, body = _post(server + "/tokenize", {"content": text})
    assert got == 200 and list(body) == ["tokens"] and body["tokens"] == ref.ids(text)
    got, pieces = _post(server + "/tokenize", {"content": text, "with_pieces": True})
    assert got == 200 and list(pieces) == ["tokens"]
    assert all(list(p) == ["id", "piece"] for p in pieces["tokens"])
    assert [p["id"] for p in pieces["tokens"]] == body["tokens"]
    assert b"".join(_piece_bytes(p["piece"]) for p in pieces["tokens"]).decode() == text
    assert any(isinstance(p["piece"], list) for p in pieces["tokens"]), "a 4-byte character split into byte pieces"
    assert all(isinstance(p["piece"], str) for p in pieces["tokens"] if p["id"] in ref.ids("def add"))

    special = "<|im_start|>user"
    _, parsed = _post(server + "/tokenize", {"content": special})
    _, plain = _post(server + "/tokenize", {"content": special, "parse_special": False})
    im_start = ref.ids("<|im_start|>")
    assert parsed["tokens"] == ref.ids(special) and len(im_start) == 1
    assert im_start[0] not in plain["tokens"] and len(plain["tokens"]) > len(parsed["tokens"])

    got, back = _post(server + "/detokenize", {"tokens": body["tokens"]})
    assert got == 200 and back == {"content": text}
    assert _post(server + "/detokenize", {"tokens": parsed["tokens"]})[1] == {"content": special}
    got, err = _post(server + "/detokenize", {"tokens": [1, 10**9]})
    assert got == 400 and err["error"]["param"] == "tokens[1]" and "vocabulary" in err["error"]["message"]
    got, err = _post(server + "/tokenize", {"text": "x"})
    assert got == 400 and err["error"]["param"] == "content"


def test_apply_template_as_llama_server(server: str, ref: Reference) -> None:
    """llama-server's /apply-template (tools/server/README.md, "POST /apply-template"): ``{"prompt": text}``, the
    chat template's rendering of the messages that a chat completion would run on."""
    got, body = _post(server + "/apply-template", {"messages": USER})
    assert got == 200 and body == {"prompt": ref.render(USER)}
    got, body = _post(server + "/apply-template", {"messages": USER, **THINK_OFF})
    assert body == {"prompt": ref.render(USER, thinking=False)}
    got, err = _post(server + "/apply-template", {"messages": []})
    assert got == 400 and err["error"]["param"] == "messages"


@pytest.mark.parametrize("mode,opts", [("ar", {}), ("diffusion", {"block_size": 8, "threshold": 0.006}),
                                       ("spec", {"block_size": 4})])
def test_chat_equals_reference_and_stream_reassembles(client: Any, ref: Reference, mode: str,
                                                      opts: dict[str, Any]) -> None:
    want = ref.chat(USER, mode, 24, thinking=False, **opts)
    extra = {"mode": mode, "return_token_ids": True, **opts, **THINK_OFF}
    resp = client.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=24, temperature=0,
                                          extra_body=extra)
    prompt_ids, tokens = _token_ids(resp)
    assert prompt_ids == want.prompt_ids
    assert tokens == want.tokens
    msg = resp.choices[0].message
    assert msg.content == want.parsed.content and msg.content
    assert msg.model_extra.get("reasoning_content") is None
    assert resp.choices[0].finish_reason == ("length" if want.stats.stop_reason == "length" else "stop")
    assert resp.usage.prompt_tokens == len(want.prompt_ids)
    assert resp.usage.completion_tokens == len(want.tokens)
    assert resp.usage.total_tokens == len(want.prompt_ids) + len(want.tokens)
    _check_stats(_clover(resp), want.stats, mode)

    stream = client.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True}, extra_body=extra)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == msg.content
    assert finish == [resp.choices[0].finish_reason]
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1  # it streamed
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == resp.usage.completion_tokens
    assert chunks[-1].usage.model_extra["clover"]["block_passes"] == _clover(resp)["block_passes"]
    last = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
    assert last.choices[0].model_extra["token_ids"] == want.tokens


def test_thinking_on_and_off(client: Any, ref: Reference) -> None:
    opts = {"mode": "diffusion", "block_size": 8, "threshold": 0.006}
    on = ref.chat(USER, "diffusion", 20, thinking=True, block_size=8, threshold=0.006)
    off = ref.chat(USER, "diffusion", 20, thinking=False, block_size=8, threshold=0.006)
    assert on.prompt_text.endswith("<think>\n") and off.prompt_text.endswith("<think>\n\n</think>\n\n")
    r_on = client.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=20, temperature=0,
                                          extra_body={**opts, "return_token_ids": True,
                                                      "chat_template_kwargs": {"enable_thinking": True}})
    r_default = client.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=20, temperature=0,
                                               extra_body=opts)
    r_off = client.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=20, temperature=0,
                                           extra_body={**opts, "return_token_ids": True, **THINK_OFF})
    assert _token_ids(r_on) == (on.prompt_ids, on.tokens)
    assert _token_ids(r_off) == (off.prompt_ids, off.tokens)
    # thinking on: the model is inside <think>; without a </think> everything it wrote is reasoning
    assert on.parsed.reasoning and r_on.choices[0].message.model_extra["reasoning_content"] == on.parsed.reasoning
    assert r_on.choices[0].message.content == on.parsed.content
    assert r_default.choices[0].message.model_extra["reasoning_content"] == on.parsed.reasoning  # the default
    assert r_off.choices[0].message.model_extra.get("reasoning_content") is None
    assert r_off.choices[0].message.content == off.parsed.content
    # streamed reasoning arrives as delta.reasoning_content and reassembles
    chunks = list(client.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=20, temperature=0,
                                                 stream=True, extra_body=opts))
    streamed = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices)
    assert streamed == on.parsed.reasoning
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_tool_call_round_trip(client: Any, ref: Reference) -> None:
    """tools, an assistant message with tool_calls and the tool's result go through the template: the
    server's prompt equals the reference rendering token for token, and so does the answer."""
    args = json.dumps({"city": "Paris"})
    convo = [{"role": "user", "content": "What is the weather in Paris?"},
             {"role": "assistant", "content": "",
              "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                                 "arguments": args}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\": 21, \"sky\": \"clear\"}"}]
    want = ref.chat(convo, "ar", 16, thinking=False, tools=TOOLS, parse_tools=True)
    assert "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>" \
        in want.prompt_text
    assert "<tool_response>\n{\"temp_c\": 21" in want.prompt_text and "\"name\": \"get_weather\"" in want.prompt_text
    resp = client.chat.completions.create(model=MODEL_ID, messages=convo, tools=TOOLS, tool_choice="auto",
                                          max_tokens=16, temperature=0,
                                          extra_body={"mode": "ar", "return_token_ids": True, **THINK_OFF})
    assert _token_ids(resp) == (want.prompt_ids, want.tokens)
    assert resp.choices[0].message.content == want.parsed.content
    assert (resp.choices[0].message.tool_calls or []) == []  # random weights write no <tool_call>
    # content given as text parts renders the same prompt
    parts = [dict(m) for m in convo]
    parts[0]["content"] = [{"type": "text", "text": "What is the weather in Paris?"}]
    again = client.chat.completions.create(model=MODEL_ID, messages=parts, tools=TOOLS, max_tokens=16,
                                           temperature=0, extra_body={"mode": "ar", "return_token_ids": True,
                                                                      **THINK_OFF})
    assert _token_ids(again) == (want.prompt_ids, want.tokens)


def test_completions_echo_and_stop(client: Any, ref: Reference) -> None:
    prompt = "def fibonacci(n):\n    if n < 2:\n"
    want = ref.completion(prompt, "diffusion", 24, block_size=8, threshold=0.006)
    extra = {"mode": "diffusion", "block_size": 8, "threshold": 0.006, "return_token_ids": True}
    resp = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=24, temperature=0, extra_body=extra)
    assert resp.choices[0].text == want.text
    assert resp.choices[0].model_extra["token_ids"] == want.tokens
    assert resp.usage.completion_tokens == len(want.tokens)
    _check_stats(resp.usage.model_extra["clover"], want.stats, "diffusion")
    echo = client.completions.create(model=MODEL_ID, prompt=want.prompt_ids, max_tokens=24, temperature=0,
                                     echo=True, extra_body=extra)
    assert echo.choices[0].text == prompt + want.text
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


def test_eight_concurrent_clients(client: Any, ref: Reference, server: str) -> None:
    """Eight threads at once, mixed modes and streaming: each answer equals the reference's."""
    before = _get(server + "/health")
    cases = []
    for i in range(8):
        mode = ("ar", "diffusion", "spec")[i % 3]
        opts = {"diffusion": {"block_size": 8, "threshold": 0.006}, "spec": {"block_size": 8}}.get(mode, {})
        messages = [{"role": "user", "content": f"Client {i}: write a loop that counts to {3 + i}."}]
        cases.append((messages, mode, opts, i % 2 == 1))

    def run(i: int) -> tuple[str | None, list[int]]:
        messages, mode, opts, stream = cases[i]
        extra = {"mode": mode, "return_token_ids": True, **opts, **THINK_OFF}
        if stream:
            chunks = list(client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=20,
                                                         temperature=0, stream=True, extra_body=extra))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            last = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
            return text, last.choices[0].model_extra["token_ids"]
        resp = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=20,
                                              temperature=0, extra_body=extra)
        return resp.choices[0].message.content, _token_ids(resp)[1]

    results = run_concurrently(run, 8)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors
    for i, (messages, mode, opts, _) in enumerate(cases):
        want = ref.chat(messages, mode, 20, thinking=False, **opts)
        text, tokens = results[i]
        assert tokens == want.tokens, f"client {i} ({mode})"
        assert text == want.parsed.content, f"client {i} ({mode})"
    after = _get(server + "/health")
    assert after["completed"] - before["completed"] == 8 and after["failed"] == 0


def test_parallel_slots_serve_concurrent_clients(tiny_gguf: Path, ref: Reference) -> None:
    """`--parallel 3`: six clients at once, mixed modes and streaming; each answer equals the reference's, the
    slots' passes were batched (/health), and -c is divided among the slots as in llama-server."""
    from openai import OpenAI

    with _serve(tiny_gguf, tiny_gguf.parent, "--parallel", "3", "-c", "6144", "--max-block-size", "32") as (url, _, _):
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        assert client.models.list().data[0].model_extra["clover"]["n_ctx"] == 2048
        cases = [([{"role": "user", "content": f"Client {i}: write a loop that counts to {3 + i}."}],
                  ("ar", "ar", "spec", "diffusion", "auto", "ar")[i]) for i in range(6)]
        opts = {"diffusion": {"block_size": 8, "threshold": 0.006}, "spec": {"block_size": 8}}

        def run(i: int) -> tuple[str | None, list[int]]:
            messages, mode = cases[i]
            resp = client.chat.completions.create(
                model=MODEL_ID, messages=messages, max_tokens=20, temperature=0,
                extra_body={"mode": mode, "return_token_ids": True, **opts.get(mode, {}), **THINK_OFF})
            return resp.choices[0].message.content, _token_ids(resp)[1]

        results = run_concurrently(run, len(cases))
        health = _get(url + "/health")
    for i, (messages, mode) in enumerate(cases):
        assert not isinstance(results[i], BaseException), f"client {i} ({mode}): {results[i]!r}"
        want = ref.chat(messages, "ar" if mode == "auto" else mode, 20, thinking=False, **opts.get(mode, {}))
        assert results[i][1] == want.tokens, f"client {i} ({mode})"
        assert results[i][0] == want.parsed.content, f"client {i} ({mode})"
    assert health["slots"] == 3 and health["completed"] == 6 and health["failed"] == 0, health
    assert health["batched_passes"] > health["batch_rounds"] > 0, health
    assert sorted({r["slot"] for r in health["recent"]}) == [0, 1, 2], health["recent"]


def _answer(client: Any, messages: list[dict[str, Any]], mode: str, thinking: bool,
            cache: bool) -> tuple[list[int], list[int], int, Any]:
    resp = client.chat.completions.create(
        model=MODEL_ID, messages=messages, max_tokens=16, temperature=0,
        extra_body={"mode": mode, "return_token_ids": True, "cache_prompt": cache,
                    "chat_template_kwargs": {"enable_thinking": thinking}})
    prompt_ids, tokens = _token_ids(resp)
    return prompt_ids, tokens, resp.usage.prompt_tokens_details.cached_tokens, resp


@pytest.mark.parametrize("mode", ["ar", "auto"])
@pytest.mark.parametrize("thinking", [False, True])
def test_multi_turn_chat_reuses_the_prefix_and_answers_as_without(client: Any, tiny_model: Any, mode: str,
                                                                  thinking: bool) -> None:
    """Turns 2 and 3 reuse the previous turns' prompt (usage.prompt_tokens_details.cached_tokens), a rollback
    (turn 2 asked differently) and a cancelled request in between change nothing: every answer equals the
    same request on a fresh history (cache_prompt false), or diverges first at a near-tie of the reference."""
    from tests.support.engine import Ledger

    ledger = Ledger()
    messages = list(USER)
    for turn, question in enumerate(["And now subtract them.", "Multiply them too.", "Divide them instead."]):
        if turn == 2:  # rollback: turn 2 asked differently, then a request that is cancelled mid-stream
            messages = messages[:-2]
            stream = client.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=400, temperature=0,
                                                    stream=True, extra_body={"mode": mode, "ignore_eos": True})
            next(iter(stream))
            stream.close()
        prompt_ids, tokens, cached, resp = _answer(client, messages, mode, thinking, cache=True)
        if turn == 0:
            first_prompt = prompt_ids
        else:  # all but the generation prompt of turn 0 (11 tokens with thinking off) came from the history
            assert len(first_prompt) - 12 <= cached < len(prompt_ids), (cached, len(first_prompt))
        want_prompt, want, fresh, _ = _answer(client, messages, mode, thinking, cache=False)
        assert fresh == 0 and prompt_ids == want_prompt
        ledger.check(f"serve/turn{turn}/{mode}/think={thinking}", tokens, want, tiny_model, prompt_ids)
        messages = messages + [{"role": "assistant", "content": resp.choices[0].message.content or "ok"},
                               {"role": "user", "content": question}]
    assert len(ledger.near_ties) <= 1, ledger.near_ties


def test_disconnect_mid_stream_frees_the_engine(client: Any, ref: Reference, server: str) -> None:
    """A long streamed generation (about a minute on one core) is dropped after its first chunks: the engine
    stops it, and the next request is answered at once and correctly."""
    before = _get(server + "/health")
    long = {"mode": "diffusion", "block_size": 16, "threshold": 1.0, "ignore_eos": True, **THINK_OFF}
    stream = client.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=4000, temperature=0,
                                            stream=True, extra_body=long)
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
                                          extra_body={"mode": "ar", "return_token_ids": True, **THINK_OFF})
    waited = time.monotonic() - start
    assert _token_ids(resp)[1] == want.tokens
    assert waited < 15, f"the next request waited {waited:.1f} s: the dropped generation kept the engine"
    after = _get(server + "/health")
    assert after["cancelled"] == before["cancelled"] + 1
    dropped = [j for j in after["recent"] if j["stop_reason"] == "cancelled"][-1]
    assert dropped["mode"] == "diffusion" and dropped["generated_tokens"] < 1000, dropped


def test_disconnect_while_waiting_for_a_full_answer(client: Any, server: str) -> None:
    from openai import APITimeoutError, OpenAI

    before = _get(server + "/health")
    impatient = OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=1.5)
    with pytest.raises(APITimeoutError):
        impatient.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=4000, temperature=0,
                                          extra_body={"mode": "diffusion", "block_size": 16, "threshold": 1.0,
                                                      "ignore_eos": True, **THINK_OFF})
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        health = _get(server + "/health")
        if health["cancelled"] > before["cancelled"] and not health["running"]:
            break
        time.sleep(0.1)
    assert health["cancelled"] == before["cancelled"] + 1 and not health["running"], health


# ============================================================================ bad requests
def _chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


BAD_CHAT = [
    ("unknown model", _chat_body(model="gpt-4o"), 404, "model", "model_not_found"),
    ("no messages", {"model": MODEL_ID}, 400, "messages", "missing_required_parameter"),
    ("empty messages", _chat_body(messages=[]), 400, "messages", None),
    ("bad role", _chat_body(messages=[{"role": "robot", "content": "x"}]), 400, "messages.0.role", None),
    ("user without content", _chat_body(messages=[{"role": "user"}]), 400, "messages.0.content", None),
    ("image part", _chat_body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     400, "messages.0.content", None),
    ("temperature", _chat_body(temperature=-1), 400, "temperature", None),
    ("top_p", _chat_body(top_p=0), 400, "top_p", None),
    ("max_tokens 0", _chat_body(max_tokens=0), 400, "max_tokens", None),
    ("max_tokens too big", _chat_body(max_tokens=5000), 400, "max_tokens", "context_length_exceeded"),
    ("prompt too long", _chat_body(messages=[{"role": "user", "content": "word " * 5000}]), 400, "messages",
     "context_length_exceeded"),
    ("n beyond the slots", _chat_body(n=2), 400, "n", None),
    ("mode", _chat_body(mode="beam"), 400, "mode", None),
    ("block_size 0", _chat_body(block_size=0), 400, "block_size", None),
    ("block_size too big", _chat_body(block_size=64), 400, "block_size", None),
    ("threshold", _chat_body(threshold=1.5), 400, "threshold", None),
    ("tool_choice required without tools", _chat_body(tool_choice="required"), 400, "tool_choice", None),
    ("tool_choice unknown function", _chat_body(tools=TOOLS, tool_choice={"type": "function",
                                                                          "function": {"name": "nope"}}),
     400, "tool_choice.function.name", None),
    ("bad tool", _chat_body(tools=[{"type": "function", "function": {"description": "no name"}}]), 400,
     "tools.0.function.name", None),
    ("top_logprobs without logprobs", _chat_body(top_logprobs=2), 400, "top_logprobs", None),
    ("top_logprobs too many", _chat_body(logprobs=True, top_logprobs=21), 400, "top_logprobs", None),
    ("response_format unknown", _chat_body(response_format={"type": "xml"}), 400, "response_format.type", None),
    ("five stops", _chat_body(stop=["a", "b", "c", "d", "e"]), 400, "stop", None),
    ("enable_thinking type", _chat_body(chat_template_kwargs={"enable_thinking": "yes"}), 400,
     "chat_template_kwargs.enable_thinking", None),
    ("logit_bias out of range", _chat_body(logit_bias={"5": 300}), 400, "logit_bias", None),
    ("logit_bias just above 100", _chat_body(logit_bias={"5": 101}), 400, "logit_bias", None),
    ("logit_bias token outside the vocabulary", _chat_body(logit_bias={"999999": 1}), 400, "logit_bias", None),
    # the distribution stage (tests/surfaces/test_serve_structured.py): schemas, grammars and penalties
    ("schema with a dangling $ref", _chat_body(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}), 400,
     "response_format.json_schema.schema", None),
    ("schema not an object", _chat_body(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": ["not", "a", "schema"]}}), 400, "response_format.json_schema.schema", None),
    # left recursion: llama.cpp's parser refuses it
    ("left-recursive grammar", _chat_body(grammar='root ::= root "a"'), 400, "grammar", None),
    # a token id outside the vocabulary
    ("grammar token outside the vocabulary", _chat_body(grammar="root ::= <[999999]>"), 400, "grammar", None),
    # two constraints at once
    ("grammar and json_schema", _chat_body(grammar='root ::= "a"', json_schema={"type": "object"}), 400,
     "json_schema", None),
    # the penalties take any finite value, as llama-server's and the CLI's do (GenParams' table)
    ("presence_penalty string", _chat_body(presence_penalty="2"), 400, "presence_penalty", "invalid_type"),
    ("frequency_penalty string", _chat_body(frequency_penalty="-3"), 400, "frequency_penalty", "invalid_type"),
    ("repeat_penalty 0", _chat_body(repeat_penalty=0), 400, "repeat_penalty", None),
    ("stream type", _chat_body(stream="maybe"), 400, "stream", None),
    # strict types: pydantic's lax mode read these as true, 8, 1 and 0.5
    ("stream string yes", _chat_body(stream="yes"), 400, "stream", "invalid_type"),
    ("max_tokens string", _chat_body(max_tokens="8"), 400, "max_tokens", "invalid_type"),
    ("n string", _chat_body(n="1"), 400, "n", "invalid_type"),
    ("temperature string", _chat_body(temperature="0.5"), 400, "temperature", "invalid_type"),
    ("ignore_eos number", _chat_body(ignore_eos=1), 400, "ignore_eos", "invalid_type"),
    ("include_usage string", _chat_body(stream=True, stream_options={"include_usage": "true"}), 400,
     "stream_options.include_usage", "invalid_type"),
    ("stream_options without stream", _chat_body(stream_options={"include_usage": True}), 400, "stream_options",
     None),
    ("lone surrogate", _chat_body(messages=[{"role": "user", "content": "a\ud800b"}]), 400, "messages.0.content",
     None),
    ("lone surrogate in the model", _chat_body(model="x\udfff"), 400, "model", None),
    ("too many messages", _chat_body(messages=[{"role": "user", "content": "hi"}] * 1025), 400, "messages",
     "too_many_messages"),
    ("prompt characters", _chat_body(messages=[{"role": "user", "content": "x" * 300_000}]), 400, "messages",
     "context_length_exceeded"),
]


@pytest.mark.parametrize("name,body,status,param,code", BAD_CHAT, ids=[c[0] for c in BAD_CHAT])
def test_bad_chat_requests(server: str, name: str, body: dict[str, Any], status: int, param: str | None,
                           code: str | None) -> None:
    got, err = _post_raw(server + "/v1/chat/completions", json.dumps(body).encode())
    assert got == status, (name, err)
    assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}, err
    assert err["error"]["type"] == "invalid_request_error" and err["error"]["message"]
    assert err["error"]["param"] == param, err
    if code:
        assert err["error"]["code"] == code, err


BAD_COMPLETION = [
    ("batched prompts", {"prompt": ["a", "b"]}, "prompt"),
    ("token outside the vocabulary", {"prompt": [1, 2, 999999]}, "prompt"),
    ("empty prompt", {"prompt": ""}, "prompt"),
    ("suffix", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("logprobs too many", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("prompt type", {"prompt": {"text": "x"}}, "prompt"),
    ("max_tokens string", {"prompt": "x", "max_tokens": "8"}, "max_tokens"),
    ("echo string", {"prompt": "x", "echo": "yes"}, "echo"),
    ("token id string", {"prompt": ["1", "2"]}, "prompt"),
    ("lone surrogate", {"prompt": "\udc80"}, "prompt"),
    ("stream_options without stream", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("prompt characters", {"prompt": "x" * 300_000}, "prompt"),
]


# docs/serve.md, "Request fields": llama-server's ranges, within the engine's 32-bit fields, not OpenAI's documented
# ones (temperature 0..2, the penalties -2..2)
SAMPLING_RANGES = [
    ({"temperature": 3.5, "presence_penalty": -5, "frequency_penalty": 7.5, "repeat_penalty": 20}, None),
    ({"temperature": 0, "presence_penalty": 3.4e38, "frequency_penalty": -3.4e38, "repeat_penalty": 1e-3}, None),
    ({"temperature": -0.1}, "temperature"), ({"temperature": 1e308}, "temperature"),
    ({"presence_penalty": 1e39}, "presence_penalty"), ({"frequency_penalty": -1e39}, "frequency_penalty"),
    ({"repeat_penalty": 0}, "repeat_penalty"), ({"repeat_penalty": 1e39}, "repeat_penalty"),
    ({"top_k": 2**31}, "top_k"), ({"top_k": 2**63}, "top_k"), ({"block_size": 2**31}, "block_size"),
]


@pytest.mark.parametrize("fields,param", SAMPLING_RANGES)
def test_sampling_ranges_are_llama_servers(server: str, fields: dict[str, Any], param: str | None) -> None:
    got, body = _post_raw(server + "/v1/completions", json.dumps({"model": MODEL_ID, "prompt": "x", "max_tokens": 1,
                                                                 "mode": "ar", **fields}).encode())
    if param is None:
        assert got == 200 and body["usage"]["completion_tokens"] <= 1, body
    else:
        assert got == 400 and body["error"]["param"] == param and "\n" not in body["error"]["message"], body


@pytest.mark.parametrize("name,fields,param", BAD_COMPLETION, ids=[c[0] for c in BAD_COMPLETION])
def test_bad_completion_requests(server: str, name: str, fields: dict[str, Any], param: str) -> None:
    got, err = _post_raw(server + "/v1/completions", json.dumps({"model": MODEL_ID, **fields}).encode())
    assert got == 400, (name, err)
    assert err["error"]["param"] == param, err


def test_bad_http(server: str, client: Any) -> None:
    from openai import BadRequestError, NotFoundError

    status, err = _post_raw(server + "/v1/chat/completions", b'{"model": "tiny", "messages": [')
    assert status == 400 and err["error"]["code"] == "invalid_json"
    status, err = _post_raw(server + "/v1/chat/completions", b"[1, 2]")
    assert status == 400 and err["error"]["type"] == "invalid_request_error"
    status, err = _post_raw(server + "/v1/chat/completions", b"\xff\xfe garbage")
    assert status == 400
    status, err = _post_raw(server + "/v1/nothing", b"{}")
    assert status == 404 and err["error"]["code"] == "not_found"
    status, err = _post_raw(server + "/v1/chat/completions", b"", method="GET")
    assert status == 405 and err["error"]["code"] == "method_not_allowed"
    with pytest.raises(NotFoundError) as nf:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert nf.value.code == "model_not_found"
    with pytest.raises(BadRequestError) as br:
        client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "x"}], n=3)
    assert br.value.param == "n"
    # after all that the server still answers
    assert _get(server + "/health")["status"] == "ok"
    ok = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                        extra_body={"mode": "ar"})
    assert ok.usage.completion_tokens <= 3


# ============================================================================ hardening: limits, keys, hostile input
def test_logit_bias_that_bans_every_token(server: str, client: Any) -> None:
    n_vocab = client.models.retrieve(MODEL_ID).model_extra["clover"]["n_vocab"]
    everything = {str(t): -100 for t in range(n_vocab)}
    got, err = _post_raw(server + "/v1/chat/completions", json.dumps(_chat_body(logit_bias=everything)).encode())
    assert got == 400 and err["error"]["param"] == "logit_bias" and "every token" in err["error"]["message"], err
    mask = client.models.retrieve(MODEL_ID).model_extra["clover"]["mask_token_id"]
    all_but_mask = {k: v for k, v in everything.items() if int(k) != mask}  # the mask token is always banned
    got, err = _post_raw(server + "/v1/completions",
                         json.dumps({"model": MODEL_ID, "prompt": "x", "logit_bias": all_but_mask}).encode())
    assert got == 400 and err["error"]["param"] == "logit_bias", err


def test_body_size_limit(server: str) -> None:
    """--max-body-bytes (8 MiB by default): a larger Content-Length is answered before the body is read; a
    chunked body is counted while it arrives."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(server)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(9 * 2**20))
    conn.endheaders()  # and no body: the answer comes without it
    resp = conn.getresponse()
    err = json.loads(resp.read())
    assert resp.status == 413 and err["error"]["code"] == "request_too_large", err
    assert "--max-body-bytes" in err["error"]["message"] and str(8 * 2**20) in err["error"]["message"]
    conn.close()
    big = json.dumps(_chat_body(messages=[{"role": "user", "content": "x" * (8 * 2**20)}])).encode()
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=iter([big[i:i + 2**20] for i in range(0, len(big), 2**20)]),
                 headers={"Content-Type": "application/json"}, encode_chunked=True)
    resp = conn.getresponse()
    assert resp.status == 413 and json.loads(resp.read())["error"]["code"] == "request_too_large"
    conn.close()
    assert _get(server + "/health")["status"] == "ok"


def test_host_header_is_checked_on_loopback(server: str) -> None:
    """DNS rebinding: a page of evil.example whose name now resolves to 127.0.0.1 sends Host: evil.example."""
    port = server.rsplit(":", 1)[1]
    for path in ("/health", "/v1/models"):
        got, err = _post_raw(server + path, b"", method="GET", headers={"Host": f"evil.example:{port}"})
        assert got == 403 and err["error"]["code"] == "forbidden_host", err
    got, _ = _post_raw(server + "/v1/models", b"", method="GET", headers={"Host": "127.0.0.1:1"})
    assert got == 403
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"LOCALHOST:{port}"):
        got, body = _post_raw(server + "/v1/models", b"", method="GET", headers={"Host": host})
        assert got == 200 and body["data"][0]["id"] == MODEL_ID


HOSTILE_TEMPLATE = """{%- macro deeper(n) -%}{{ deeper(n + 1) }}{%- endmacro -%}
{%- set c = messages[-1]['content'] -%}
{%- if c == 'loop' -%}{%- for i in range(100000) -%}{%- for j in range(100000) -%}{%- endfor -%}{%- endfor -%}
{%- elif c == 'overflow' -%}{{ range(10 ** 30) | list | length }}
{%- elif c == 'recurse' -%}{{ deeper(0) }}
{%- else -%}<|im_start|>user
{{ c }}<|im_end|>
<|im_start|>assistant
{% endif -%}"""


@pytest.fixture(scope="module")
def hardened(tiny_gguf: Path) -> Iterator[dict[str, Any]]:
    """A second server: -c 64, API keys (flag and file), a hostile chat template, a 2 s template limit."""
    folder = tiny_gguf.parent
    (folder / "hostile.jinja").write_text(HOSTILE_TEMPLATE)
    (folder / "keys.txt").write_text("\nfile-key-1\n  file-key-2  \n\n")
    with _serve(tiny_gguf, folder, "-c", "64", "--api-key", "flag-key", "--api-key-file", str(folder / "keys.txt"),
                "--chat-template", str(folder / "hostile.jinja"), "--template-timeout", "2",
                "--max-messages", "50000", "--max-body-bytes", str(32 * 2**20)) as (url, proc, log):
        yield {"url": url, "proc": proc, "log": log}


def test_api_keys(hardened: dict[str, Any]) -> None:
    from openai import AuthenticationError, OpenAI

    url = hardened["url"]
    body = json.dumps({"model": MODEL_ID, "prompt": "x", "max_tokens": 2}).encode()
    for headers in ({}, _auth("wrong"), _auth("flag-keyx"), {"Authorization": "Basic flag-key"},
                    _auth("file-key-1x")):
        got, err = _post_raw(url + "/v1/completions", body, headers=headers)
        assert got == 401, (headers, err)
        assert set(err["error"]) == {"message", "type", "param", "code"}
        assert err["error"]["code"] == "invalid_api_key" and err["error"]["type"] == "invalid_request_error"
    for path in ("/v1/models", f"/v1/models/{MODEL_ID}", "/v1/nothing"):
        got, err = _post_raw(url + path, b"", method="GET")
        assert got == 401 and err["error"]["code"] == "invalid_api_key", (path, err)
    for path in ("/tokenize", "/detokenize", "/apply-template"):
        got, err = _post_raw(url + path, b"{}")
        assert got == 401 and err["error"]["code"] == "invalid_api_key", (path, err)
    assert _get(url + "/health")["status"] == "ok"  # open without a key
    for key in ("flag-key", "file-key-1", "file-key-2"):
        got, ok = _post_raw(url + "/v1/completions", body, headers=_auth(key))
        assert got == 200 and ok["usage"]["completion_tokens"] <= 2, (key, ok)
    got, _ = _post_raw(url + "/v1/completions", body, headers={"X-Api-Key": "file-key-2"})
    assert got == 200
    with pytest.raises(AuthenticationError) as denied:
        OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
    assert denied.value.code == "invalid_api_key"
    assert OpenAI(base_url=url + "/v1", api_key="flag-key", max_retries=0).models.list().data[0].id == MODEL_ID


def test_small_context_is_reported_and_enforced(hardened: dict[str, Any]) -> None:
    """-c 64: llama.cpp allocates at least n_batch (512), but the engine's context is 64, and so is the card's."""
    url, key = hardened["url"], _auth("flag-key")
    got, card = _post_raw(url + f"/v1/models/{MODEL_ID}", b"", method="GET", headers=key)
    assert got == 200 and card["clover"]["n_ctx"] == 64

    def complete(prompt: Any, **fields: Any) -> tuple[int, dict[str, Any]]:
        return _post_raw(url + "/v1/completions", json.dumps({"model": MODEL_ID, "prompt": prompt, **fields}).encode(),
                         headers=key)

    for prompt, fields in (([5] * 64, {"max_tokens": 1}), ([5] * 80, {}), ([5] * 60, {"max_tokens": 5}),
                           ("word " * 200, {"max_tokens": 1})):
        got, err = complete(prompt, **fields)
        assert got == 400 and err["error"]["code"] == "context_length_exceeded", (len(prompt), err)
        assert "64" in err["error"]["message"]
    got, ok = complete([5] * 60, max_tokens=4, ignore_eos=True)
    assert got == 200 and ok["usage"]["completion_tokens"] == 4 and ok["usage"]["prompt_tokens"] == 60, ok
    got, ok = complete([5] * 60, ignore_eos=True, max_tokens=None)  # left out: the room the context leaves
    assert got == 200 and ok["usage"]["completion_tokens"] == 4 and ok["choices"][0]["finish_reason"] == "length"


def _health_time(url: str) -> float:
    start = time.monotonic()
    assert _get(url + "/health")["status"] == "ok"
    return time.monotonic() - start


@pytest.mark.parametrize("content,fragment", [("loop", "--template-timeout"), ("overflow", "OverflowError"),
                                              ("recurse", "recursed")])
def test_hostile_template_is_a_400_and_health_answers(hardened: dict[str, Any], content: str, fragment: str) -> None:
    url = hardened["url"]
    result: dict[str, Any] = {}

    def send() -> None:
        result["answer"] = _post_raw(url + "/v1/chat/completions", json.dumps(_chat_body(
            messages=[{"role": "user", "content": content}])).encode(), headers=_auth("flag-key"))

    thread = threading.Thread(target=send)
    start = time.monotonic()
    thread.start()
    slowest = 0.0
    while thread.is_alive():
        slowest = max(slowest, _health_time(url))
        time.sleep(0.1)
    thread.join()
    got, err = result["answer"]
    assert got == 400 and fragment in err["error"]["message"], err
    assert slowest < 1.0, f"/health took {slowest:.2f} s while the template ran"
    assert time.monotonic() - start < 8
    got, ok = _post_raw(url + "/v1/chat/completions", json.dumps(_chat_body(max_tokens=2)).encode(),
                        headers=_auth("flag-key"))
    assert got == 200, ok  # and the server still answers


def test_forty_thousand_messages_do_not_freeze_the_server(hardened: dict[str, Any]) -> None:
    url = hardened["url"]
    body = json.dumps(_chat_body(messages=[{"role": "user", "content": "hello there"}] * 40_000)).encode()
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(answer=_post_raw(
        url + "/v1/chat/completions", body, headers=_auth("flag-key"))))
    thread.start()
    slowest = 0.0
    while thread.is_alive():
        slowest = max(slowest, _health_time(url))
        time.sleep(0.05)
    got, err = result["answer"]
    assert got == 400 and err["error"]["code"] == "context_length_exceeded", err
    assert slowest < 1.0, f"/health took {slowest:.2f} s"


def test_sigterm_stops_the_server_quickly(tiny_gguf: Path) -> None:
    """SIGTERM while one long generation streams and another waits: the server exits within 5 s. --max-queue 1
    answers a third request with a 429 meanwhile."""
    with _serve(tiny_gguf, tiny_gguf.parent, "--max-queue", "1", alive_at_end=False) as (url, proc, log):
        long = {"model": MODEL_ID, "prompt": "x", "max_tokens": 4000, "stream": True, "ignore_eos": True,
                "mode": "diffusion", "block_size": 16, "threshold": 1.0}
        streams = []
        for _ in range(2):
            req = urllib.request.Request(url + "/v1/completions", data=json.dumps(long).encode(),
                                         headers={"Content-Type": "application/json"})
            streams.append(urllib.request.urlopen(req, timeout=60))  # the headers: the job is queued
        deadline = time.monotonic() + 10
        while _get(url + "/health")["waiting"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        got, err = _post_raw(url + "/v1/completions", json.dumps({"model": MODEL_ID, "prompt": "x"}).encode())
        assert got == 429 and err["error"]["code"] == "queue_full" and "--max-queue" in err["error"]["message"]
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        took = time.monotonic() - start
        for s in streams:
            s.close()
        assert took < 5, f"the server took {took:.1f} s to stop:\n{log.read_text()[-2000:]}"
