"""`clover-cpp serve` (llama-server) through its distribution stage (docs/serve.md, "Logprobs and metrics", "Block
diffusion in llama-server"), with the official `openai` client on a live server (tiny f32 GGUF, two slots):
schema-valid JSON in every mode at temperature 0.8 (diffusion decodes a constrained request as auto: no block
pass), json_object and llama-server's json_schema and grammar fields, a grammar that applies after the reasoning,
forced tool calls, logprobs equal across the lossless modes, streamed and on /v1/completions, penalties and
logit_bias that reach the engine, n answers on n slots, and llama-server's 400 for a grammar it does not parse.

llama-server's logprobs are the model's distribution before the sampler chain (penalties, bias, grammar), as its
README says of ``n_probs``; its error body is ``{"error": {"code", "message", "type"}}``. What the earlier server did
and llama-server did not is in the patch now, each held by a strict xfail until it was: strings under a grammar are
UTF-8 (patch grammar-utf8-well-formed), a grammar that allows nothing is a 400 (sampling-no-candidate-is-a-bad-request),
a grammar that does not parse is a 400 with llama.cpp's reason (grammar-error-reaches-the-caller), n answers share
one usage, every token has a logprobs entry, and /v1/completions does echo and OpenAI's logprobs form."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai  # a test dependency (pyproject [test]): missing, the suite fails instead of skipping
import pytest
from transformers.convert_slow_tokenizer import bytes_to_unicode

from tests.support.chat import Reference
from tests.support.schema import validate
from tests.support.serve import MODEL_ID, THINK_OFF, clover_serve, http, post, sse_chunks
from tests.support.tools import pinned_template

pytestmark = pytest.mark.native

MODES = ("ar", "auto", "spec", "diffusion")

# what agents send: nested objects, enums, arrays of objects, required fields, bounded strings
TICKET = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 24},
        "priority": {"enum": ["low", "medium", "high"]},
        "labels": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "assignee": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                      "id": {"type": "integer"}},
                     "required": ["name", "id"], "additionalProperties": False},
        "done": {"type": "boolean"},
    },
    "required": ["title", "priority", "labels", "assignee"],
    "additionalProperties": False,
}
EDIT = {
    "type": "object",
    "properties": {
        "path": {"type": "string", "maxLength": 20},
        "edits": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {"line": {"type": "integer"}, "text": {"type": "string", "maxLength": 16}},
            "required": ["line", "text"], "additionalProperties": False}},
    },
    "required": ["path", "edits"],
    "additionalProperties": False,
}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                                       "required": ["zone"], "additionalProperties": False}}}
BAD_GRAMMARS = [
    ("root ::= undefined-rule", "Undefined rule identifier 'undefined-rule'"),
    ('root ::= "a', "unexpected end of input"),
    ("root ::= [a-", "unexpected end of input"),
]


@pytest.fixture(scope="module")
def server(tiny_gguf: Path) -> Iterator[str]:
    with clover_serve(tiny_gguf, "-np", "2", "-c", "2048", "-t", "1", "--no-warmup") as (url, _, _):
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> Any:
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hermes_client(tiny_gguf: Path) -> Iterator[Any]:
    """The tiny model behind the Hermes (JSON) tool-call format: its grammar bounds every argument by the tool's
    schema. The shipped (Qwen3.5, XML) format leaves a string argument free until `</parameter>`, which a random
    model need not write within max_tokens."""
    with clover_serve(tiny_gguf, "-np", "1", "-c", "1024", "-t", "1", "--no-warmup",
                      "--chat-template-file", str(pinned_template("hermes"))) as (url, _, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client: Any, content: str, **kw: Any) -> Any:
    extra = {**THINK_OFF, **kw.pop("extra_body", {})}
    return client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": content}],
                                          extra_body=extra, **kw)


def _post_chat(server: str, content: str, **fields: Any) -> tuple[int, dict[str, Any]]:
    return post(server + "/v1/chat/completions", {"model": MODEL_ID, "max_tokens": 8, **THINK_OFF, **fields,
                                                  "messages": [{"role": "user", "content": content}]})


def _json_answer(choice: Any, schema: dict[str, Any]) -> bool:
    """Whether the answer stopped: then it is schema-valid JSON whose strings are UTF-8 (the grammar refuses bytes
    that are not: patch grammar-utf8-well-formed); an answer cut by max_tokens is not checked."""
    if choice.finish_reason == "length":
        return False
    assert choice.finish_reason == "stop", choice
    assert "\ufffd" not in choice.message.content, choice.message.content
    errors = validate(json.loads(choice.message.content), schema)
    assert not errors, (choice.message.content, errors)
    return True


# ------------------------------------------------------------------------------------------ structured output
@pytest.mark.parametrize("mode", MODES)
def test_json_schema_at_temperature(client: Any, mode: str) -> None:
    """20 distinct prompt/seed pairs at temperature 0.8: every answer valid UTF-8 JSON for its schema, or cut by
    length. No answer has a block pass: diffusion decodes a constrained request as auto, and a drafter's own passes
    are not counted."""
    finished = 0
    for i in range(20):
        schema = TICKET if i % 2 == 0 else EDIT
        fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
        r = _chat(client, f"request {i}: file a ticket", response_format=fmt, temperature=0.8, seed=100 + i,
                  max_tokens=160, extra_body={"mode": mode})
        finished += _json_answer(r.choices[0], schema)
        timings = r.model_extra["timings"]
        assert timings["block_passes"] == 0 and timings["causal_passes"] > 0, timings
        assert mode != "ar" or "draft_n" not in timings, timings  # ar never drafts
    assert finished >= 10, f"only {finished} of 20 answers finished within 160 tokens: the test checks too little"


def _bounded_string(server: str, ref: Reference, biased: str) -> tuple[int, dict[str, Any]]:
    """A greedy answer to a schema of one string of at most 2 characters, biased towards the byte tokens of
    ``biased`` (byte-level BPE letters), the first the most."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 2}}, "required": ["a"],
              "additionalProperties": False}
    bias = {str(ref.tokenizer.token_to_id(letter)): 100 - 10 * i for i, letter in enumerate(biased)}
    return _post_chat(server, "x", max_tokens=40, temperature=0, mode="ar", logit_bias=bias,
                      response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})


# Bytes that begin no UTF-8 character (f5; c0, an overlong lead), and well-led sequences that are not UTF-8: overlong
# (e0 96, f0 8f), a surrogate (ed a0), above U+10FFFF (f4 90). Byte-level BPE writes each byte as a letter of
# GPT-2's byte-to-unicode map.
_BYTE_TO_LETTER = bytes_to_unicode()
NOT_UTF8 = {"f5": (0xF5,), "c0": (0xC0,), "overlong e0 96": (0xE0, 0x96), "overlong f0 8f": (0xF0, 0x8F),
            "surrogate ed a0": (0xED, 0xA0), "above U+10FFFF f4 90": (0xF4, 0x90)}


@pytest.mark.parametrize("data", NOT_UTF8.values(), ids=NOT_UTF8.keys())
def test_a_json_schema_string_is_utf8(server: str, ref: Reference, data: tuple[int, ...]) -> None:
    """Biased towards bytes that make no UTF-8, the grammar refuses them (patch grammar-utf8-well-formed): they
    passed as a character of the string (f5 and three continuation bytes as one; the answer had 4 or 5 U+FFFD)."""
    status, body = _bounded_string(server, ref, "".join(_BYTE_TO_LETTER[b] for b in data))
    assert status == 200 and body["choices"][0]["finish_reason"] == "stop", body
    content = body["choices"][0]["message"]["content"]
    assert "\ufffd" not in content and len(json.loads(content)["a"]) <= 2, content


def test_a_json_schema_answer_is_parsed(server: str, ref: Reference) -> None:
    """A byte f8 .. ff was the lead of a 4-byte character in a string; the chat parser then refused the answer with a
    500 ('does not match the expected peg-native format')."""
    status, body = _bounded_string(server, ref, _BYTE_TO_LETTER[0xFD])
    assert status == 200, body


def test_json_object_and_llama_server_fields(client: Any, server: str, ref: Reference) -> None:
    """json_object gives a JSON object; llama-server's json_schema and grammar fields constrain /v1/completions. In
    ar, where a seed gives one answer (auto's drafts follow its measured costs), so the answers must stop within
    max_tokens: at these seeds the tiny model's do, the json_schema one in about 50 tokens."""
    r = _chat(client, "an object", response_format={"type": "json_object"}, temperature=0.8, seed=1, max_tokens=120,
              extra_body={"mode": "ar"})
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    for body in ({"json_schema": EDIT}, {"grammar": 'root ::= "yes" | "no"'}):
        status, out = post(server + "/v1/completions", {"model": MODEL_ID, "prompt": "answer:", "max_tokens": 200,
                                                        "temperature": 0.8, "seed": 5, "mode": "ar",
                                                        **body})
        assert status == 200, out
        choice = out["choices"][0]
        assert choice["finish_reason"] == "stop", out
        if "grammar" in body:
            assert choice["text"] in ("yes", "no")
        else:
            assert not validate(json.loads(choice["text"]), EDIT)


def test_grammar_applies_after_think(server: str, ref: Reference) -> None:
    """With thinking on, the reasoning is free and the answer after </think> matches the schema. Unbiased, the tiny
    model reasons past max_tokens (its reasoning is no JSON); a bias on </think> makes it close the reasoning at
    once, and the answer after it is the schema's JSON (the grammar allows </think>'s text inside a string)."""
    status, tokenized = post(server + "/tokenize", {"content": "</think>"})
    assert status == 200 and len(tokenized["tokens"]) == 1, tokenized
    think_close = tokenized["tokens"][0]
    request = {"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": TICKET}},
               "chat_template_kwargs": {"enable_thinking": True}, "logprobs": True, "temperature": 0.8, "seed": 1,
               "mode": "ar"}
    status, free = _post_chat(server, "a ticket", **request, max_tokens=12)
    assert status == 200 and free["choices"][0]["finish_reason"] == "length", free
    message = free["choices"][0]["message"]
    assert message["content"] == "" and message["reasoning_content"][:1] not in ("", "{"), message
    status, body = _post_chat(server, "a ticket", **request, max_tokens=200,
                              logit_bias={str(think_close): 60})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["logprobs"]["content"][0]["id"] == think_close and choice["finish_reason"] == "stop", choice
    assert not choice["message"].get("reasoning_content"), choice
    assert not validate(json.loads(choice["message"]["content"]), TICKET)


def _check_call(call: Any) -> None:
    tool = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[call.function.name]
    assert not validate(json.loads(call.function.arguments), tool["function"]["parameters"]), \
        call


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_call(hermes_client: Any, tool_choice: Any) -> None:
    """A sampled answer is one call (parallel_tool_calls false: llama-server's default, as OpenAI's, allows several),
    its arguments valid for the tool's schema (as in test_json_schema_at_temperature), to the named function if one
    is. In ar, where a seed gives one answer; in the Hermes format, whose grammar bounds the arguments."""
    choice = _chat(hermes_client, "what is the weather in Paris?", tools=[WEATHER_TOOL, TIME_TOOL],
                   tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=160, temperature=0.8, seed=7,
                   extra_body={"mode": "ar"}).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content, choice
    (call,) = choice.message.tool_calls
    _check_call(call)
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_time"


# ------------------------------------------------------------------------------------------ logprobs
def _greedy_logprobs(client: Any, mode: str, **kw: Any) -> tuple[Any, list[Any]]:
    r = _chat(client, "count to ten", logprobs=True, top_logprobs=3, max_tokens=24, temperature=0,
              extra_body={"mode": mode}, **kw)
    return r, r.choices[0].logprobs.content


def test_logprobs_match_across_lossless_modes(client: Any) -> None:
    """Greedy ar, auto and spec, with penalties, emit the same tokens with the same log P and top tokens (with drafts
    accepted on the demo model: tests/native/test_serve_api.py). The logprobs are the model's before the penalties,
    so the top token need not be the one chosen; each is in order, and the chosen one's agrees with its own entry
    in the top list."""
    penalties = dict(presence_penalty=0.5, frequency_penalty=0.3)
    runs = {mode: _greedy_logprobs(client, mode, **penalties) for mode in ("ar", "auto", "spec")}
    ar = runs["ar"][1]
    assert ar and runs["ar"][0].choices[0].finish_reason == "length"
    for entry in ar:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3, entry
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True), entry
        assert all(t.logprob == pytest.approx(entry.logprob) for t in entry.top_logprobs if t.token == entry.token)
    for mode in ("auto", "spec"):
        response, content = runs[mode]
        assert response.usage.completion_tokens == runs["ar"][0].usage.completion_tokens, mode
        assert [c.token for c in content] == [c.token for c in ar], mode
        assert max(abs(a.logprob - b.logprob) for a, b in zip(content, ar)) < 1e-3, mode
        assert [[t.token for t in c.top_logprobs] for c in content] == [[t.token for t in c.top_logprobs] for c in ar]


def test_logprobs_streamed_and_completions(client: Any) -> None:
    """The streamed logprobs are the answer's, in order; /v1/completions gives llama-server's logprobs (``content``,
    as the chat's) with at most ``logprobs`` top tokens, whose texts rebuild the answer."""
    ask = dict(logprobs=True, top_logprobs=1, max_tokens=12, temperature=0, extra_body={"mode": "spec"})
    whole = _chat(client, "hi", **ask)
    want = [(c.token, c.logprob) for c in whole.choices[0].logprobs.content]
    streamed, usage = [], None
    for chunk in _chat(client, "hi", stream=True, stream_options={"include_usage": True}, **ask):
        usage = chunk.usage or usage
        for c in chunk.choices:
            streamed += [(t.token, t.logprob) for t in (c.logprobs.content or [])] if c.logprobs else []
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens == 12
    assert [t for t, _ in streamed] == [t for t, _ in want] and len(want) == 12  # whole characters: see below
    assert [lp for _, lp in streamed] == pytest.approx([lp for _, lp in want], abs=1e-4)  # the prompt cached or not

    r = client.completions.create(model=MODEL_ID, prompt="def f(x):", logprobs=2, max_tokens=6, temperature=0)
    content = r.choices[0].logprobs.model_extra["content"]
    assert len(content) == r.usage.completion_tokens == 6
    assert "".join(c["token"] for c in content) == r.choices[0].text
    for c in content:
        assert len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["logprob"] >= c["top_logprobs"][1]["logprob"]


def test_every_token_has_a_logprobs_entry(client: Any) -> None:
    """A token whose text ends inside a character has its entry too, streamed or not (patch
    server-logprobs-of-split-characters: greedy ar 'hello' emits 12 tokens, the second a lone byte, and got 11)."""
    ask = dict(logprobs=True, top_logprobs=1, max_tokens=12, temperature=0, extra_body={"mode": "ar"})
    whole = _chat(client, "hello", **ask)
    streamed = [e for chunk in _chat(client, "hello", stream=True, **ask)
                for c in chunk.choices if c.logprobs for e in c.logprobs.content or []]
    entries = whole.choices[0].logprobs.content
    assert len(entries) == len(streamed) == whole.usage.completion_tokens == 12
    assert [e.bytes for e in entries] == [e.bytes for e in streamed]
    assert "".join(e.token for e in entries) == whole.choices[0].message.content


def test_completions_echo_with_logprobs_is_refused(server: str) -> None:
    """OpenAI gives the prompt's tokens logprobs too; llama-server computes none, so it says so (a 400)."""
    status, body = post(server + "/v1/completions", {"model": MODEL_ID, "prompt": "def f(x):", "echo": True,
                                                     "logprobs": 1, "max_tokens": 0})
    assert status == 400 and "'echo' with 'logprobs'" in body["error"]["message"], body


def test_completions_logprobs_in_openais_form(client: Any) -> None:
    """/v1/completions' logprobs in OpenAI's completions form (tokens, token_logprobs, top_logprobs, text_offset),
    llama-server's own beside it under content; streamed, the offsets go on from chunk to chunk (patch
    server-completions-echo-and-openai-logprobs: only llama-server's form, the SDK's fields were None)."""
    ask = dict(model=MODEL_ID, prompt="def f(x):", logprobs=2, max_tokens=6, temperature=0)
    r = client.completions.create(**ask)
    lp = r.choices[0].logprobs
    assert lp.tokens is not None and len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(t) <= 2 for t in lp.top_logprobs) and len(lp.model_extra["content"]) == len(lp.tokens)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and (token not in top or top[token] == pytest.approx(logprob))
    tokens, offsets = [], []
    for chunk in client.completions.create(**ask, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            offsets += chunk.choices[0].logprobs.text_offset
    assert tokens == lp.tokens and offsets == lp.text_offset


# ------------------------------------------------------------------------------------------ penalties, bias, n
def test_penalties_and_bias_reach_the_engine(client: Any) -> None:
    plain = _chat(client, "repeat after me", max_tokens=32, temperature=0,
                  extra_body={"mode": "ar"}).choices[0].message.content
    # negative presence and frequency favour the answer's own tokens: the random tiny model rarely repeats one,
    # so positive penalties alone might change nothing in 32 tokens
    kw = dict(presence_penalty=-2.0, frequency_penalty=-0.5, extra_body={"repeat_penalty": 1.3})
    for mode in ("ar", "auto", "spec"):
        body = {**kw, "extra_body": {**kw["extra_body"], "mode": mode}}
        text = _chat(client, "repeat after me", max_tokens=32, temperature=0, **body).choices[0].message.content
        if mode == "ar":
            penalised = text
            assert penalised != plain, "the penalties changed nothing"
        else:
            assert text == penalised, mode  # greedy auto and spec keep ar's distribution


def _ids(server: str, **fields: Any) -> list[int]:
    """The token ids of a greedy chat answer, from its logprobs (llama-server's entries carry each token's id)."""
    status, body = _post_chat(server, "anything", temperature=0, logprobs=True, **fields)
    assert status == 200, body
    return [c["id"] for c in body["choices"][0]["logprobs"]["content"]]


def test_logit_bias(server: str) -> None:
    """-100 bans (OpenAI), a large positive bias forces: both on the greedy answer's first token."""
    first, *_ = _ids(server)
    assert first not in _ids(server, logit_bias={str(first): -100})
    assert _ids(server, logit_bias={"65": 100}) == [65] * 8


def test_n_answers_on_slots(server: str) -> None:
    """n = 2 runs on the two slots; answer i samples with seed + i, so each equals a lone request with that seed (ar:
    a sampled auto answer depends on its timed draft decisions, so only ar's is fixed by the seed). n above the
    slots is llama-server's 400."""
    ask = dict(temperature=1.0, mode="ar", max_tokens=16)
    status, body = _post_chat(server, "two answers", n=2, seed=11, **ask)
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for i, choice in enumerate(body["choices"]):
        status, alone = _post_chat(server, "two answers", seed=11 + i, **ask)
        assert choice["message"]["content"] == alone["choices"][0]["message"]["content"], i
    assert body["choices"][0]["message"]["content"] != body["choices"][1]["message"]["content"]
    status, body = _post_chat(server, "x", n=3, max_tokens=4)
    message = "Field 'n': Value must be between 1 <= value <= 2, but got 3"
    assert (status, body) == (400, {"error": {"code": 400, "type": "invalid_request_error", "message": message}})


def test_n_answers_usage_counts_every_answer(server: str) -> None:
    """One usage for n answers, as OpenAI's: every answer's completion tokens, the prompt once; streamed, one usage
    chunk (patch server-n-answers-share-one-usage: each answer reported its own 16 tokens)."""
    ask = dict(n=2, temperature=1.0, seed=11, mode="ar", max_tokens=16, ignore_eos=True)
    status, body = _post_chat(server, "two answers", **ask)
    assert status == 200 and all(c["finish_reason"] == "length" for c in body["choices"]), body
    assert body["usage"]["completion_tokens"] == 32, body["usage"]
    status, _, raw = http(server + "/v1/chat/completions", {
        "model": MODEL_ID, **THINK_OFF, **ask, "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "two answers"}]}, timeout=120)
    chunks = sse_chunks(raw)
    assert [c["usage"]["completion_tokens"] for c in chunks if c.get("usage")] == [32]
    assert chunks[-1]["usage"]["total_tokens"] == 32 + body["usage"]["prompt_tokens"], chunks[-1]
    completion = {"model": MODEL_ID, "prompt": "two answers", **ask}
    status, body = post(server + "/v1/completions", completion)
    assert status == 200 and len(body["choices"]) == 2 and body["usage"]["completion_tokens"] == 32, body
    status, _, raw = http(server + "/v1/completions", {**completion, "stream": True}, timeout=120)
    assert [c["usage"]["completion_tokens"] for c in sse_chunks(raw) if c.get("usage")] == [32]


def test_n_answers_streamed(client: Any) -> None:
    """Streamed, the two answers' chunks interleave under one id, each choice with its index, and each answer's
    text equals the whole (non-streamed) answer of the same request. In ar (see test_n_answers_on_slots)."""
    request = dict(n=2, temperature=1.0, seed=21, max_tokens=12, extra_body={"mode": "ar"})
    whole = _chat(client, "two streams", **request)
    texts, finished, ids = ["", ""], [None, None], set()
    for chunk in _chat(client, "two streams", stream=True, **request):
        ids.add(chunk.id)
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finished[c.index] = c.finish_reason or finished[c.index]
    assert len(ids) == 1 and finished == [c.finish_reason for c in whole.choices] and all(finished)
    assert texts == [c.message.content for c in whole.choices] and texts[0] != texts[1]


# ------------------------------------------------------------------------------------------ bad grammars
@pytest.mark.parametrize(("grammar", "reason"), BAD_GRAMMARS)
def test_a_grammar_error_is_a_400_with_llama_cpps_reason(server: str, grammar: str, reason: str) -> None:
    """llama-server's 400 for a GBNF it does not parse (README: "Failed to parse grammar"), before anything runs,
    with llama.cpp's reason after it (patch grammar-error-reaches-the-caller; it went to the server's log only)."""
    status, body = _post_chat(server, "x", max_tokens=4, grammar=grammar)
    message = f"Failed to initialize samplers: failed to parse grammar: {reason}"
    assert (status, body) == (400, {"error": {"code": 400, "type": "invalid_request_error", "message": message}})


def test_grammar_that_allows_nothing(server: str, ref: Reference) -> None:
    """A grammar whose only token is the mask token (always banned), or that dead-ends on it after its first token,
    is a 400 that names the grammar, never a 500 or a hang."""
    mask_id = ref.model.config.mask_token_id
    for grammar in (f"root ::= <[{mask_id}]>", f'root ::= "a" <[{mask_id}]>'):
        status, body = _post_chat(server, "x", grammar=grammar, temperature=0)
        assert status == 400 and "grammar" in body["error"]["message"], (grammar, status, body)
