"""`clover-cpp serve` through the distribution stage (shared/clover-spec.md section 4; docs/serve.md, "Structured
output" and "Logprobs"), with the official `openai` client on a live server (tiny f32 GGUF, two slots):
schema-valid JSON in every mode at temperature 0.8, forced tool calls, logprobs equal across the lossless modes,
penalties and logit_bias that reach the engine, n answers on n slots, and 400s that give llama.cpp's reason for a
grammar it does not parse (the other bad schemas, grammars, penalties and biases: test_serve_live.py's BAD_CHAT)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai  # a test dependency (pyproject [test]): missing, the suite fails instead of skipping
import pytest

from tests.support.schema import validate
from tests.support.serve import MODEL_ID, THINK_OFF, get, post, serve

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


@pytest.fixture(scope="module")
def server(tiny_gguf: Path) -> Iterator[str]:
    with serve(tiny_gguf, tiny_gguf.parent, "-np", "2") as (url, _, _):
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> Any:
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def _chat(client: Any, content: str, **kw: Any) -> Any:
    extra = {**THINK_OFF, **kw.pop("extra_body", {})}
    return client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": content}],
                                          extra_body=extra, **kw)


def _json_answer(choice: Any, schema: dict[str, Any]) -> None:
    """Schema-valid JSON, unless the answer was cut by max_tokens (spec: never invalid otherwise)."""
    if choice.finish_reason == "length":
        return
    assert choice.finish_reason == "stop", choice
    errors = validate(json.loads(choice.message.content), schema)
    assert not errors, (choice.message.content, errors)


# ------------------------------------------------------------------------------------------ structured output
@pytest.mark.parametrize("mode", MODES)
def test_json_schema_at_temperature(client: Any, mode: str) -> None:
    """20 distinct prompt/seed pairs at temperature 0.8: every answer valid or cut by length (diffusion runs as
    auto when constrained)."""
    finished = 0
    for i in range(20):
        schema = TICKET if i % 2 == 0 else EDIT
        fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
        r = _chat(client, f"request {i}: file a ticket", response_format=fmt, temperature=0.8, seed=100 + i,
                  max_tokens=160, extra_body={"mode": mode})
        _json_answer(r.choices[0], schema)
        finished += r.choices[0].finish_reason == "stop"
        ran = (r.usage.model_extra or {})["clover"]["mode"]
        assert ran == ("auto" if mode == "diffusion" else mode), "usage names the mode the answer ran in"
    assert finished >= 10, f"only {finished} of 20 answers finished within 160 tokens: the test checks too little"


def test_json_object_and_llama_server_fields(client: Any, server: str) -> None:
    """json_object gives a JSON object; llama-server's json_schema and grammar fields constrain /v1/completions. The
    json_schema answer must stop within 200 tokens and validate: the tiny model's answers to it took at most 108 tokens
    over 100 seeds. The completions run in ar, where a seed gives one answer (auto's drafts follow its measured
    costs)."""
    r = _chat(client, "an object", response_format={"type": "json_object"}, temperature=0.8, seed=3, max_tokens=120)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    for body in ({"json_schema": EDIT}, {"grammar": 'root ::= "yes" | "no"'}):
        status, out = post(server + "/v1/completions", {"model": MODEL_ID, "prompt": "answer:", "max_tokens": 200,
                                                        "temperature": 0.8, "seed": 5, "mode": "ar", **body})
        assert status == 200, out
        text = out["choices"][0]["text"]
        if "grammar" in body:
            assert text in ("yes", "no")
        else:
            assert out["choices"][0]["finish_reason"] == "stop", out
            assert not validate(json.loads(text), EDIT)


def test_grammar_applies_after_think(server: str) -> None:
    """With thinking on, the reasoning is free and the answer after </think> matches the schema. Unbiased, the tiny
    model reasons past max_tokens (its reasoning is no JSON); a bias on </think> makes it close the reasoning at
    once, and the answer after it is the schema's JSON (the grammar allows </think>'s text inside a string)."""
    think_close = post(server + "/tokenize", {"content": "</think>"})[1]["tokens"]
    assert len(think_close) == 1
    request = {"model": MODEL_ID, "messages": [{"role": "user", "content": "a ticket"}], "return_token_ids": True,
               "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": TICKET}},
               "chat_template_kwargs": {"enable_thinking": True}}
    status, free = post(server + "/v1/chat/completions", {**request, "max_tokens": 12})
    assert status == 200 and free["choices"][0]["finish_reason"] == "length", free
    assert free["choices"][0]["message"]["reasoning_content"][:1] != "{"
    status, body = post(server + "/v1/chat/completions", {**request, "max_tokens": 200,
                                                          "logit_bias": {str(think_close[0]): 60}})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["token_ids"][0] == think_close[0] and choice["finish_reason"] == "stop", choice
    assert not validate(json.loads(choice["message"]["content"]), TICKET)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_call(client: Any, tool_choice: Any) -> None:
    r = _chat(client, "what is the weather in Paris?", tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=tool_choice,
              max_tokens=160, temperature=0.8, seed=7)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_time"
    tool = WEATHER_TOOL if call.function.name == "get_weather" else TIME_TOOL
    assert not validate(json.loads(call.function.arguments), tool["function"]["parameters"])


# ------------------------------------------------------------------------------------------ logprobs
def _greedy_logprobs(client: Any, mode: str, **kw: Any) -> tuple[list[str], list[float], list[list[Any]]]:
    r = _chat(client, "count to ten", logprobs=True, top_logprobs=3, max_tokens=24, extra_body={"mode": mode}, **kw)
    content = r.choices[0].logprobs.content
    return ([c.token for c in content], [c.logprob for c in content], [c.top_logprobs for c in content])


def test_logprobs_match_across_lossless_modes(client: Any) -> None:
    """Greedy ar, auto and spec emit the same tokens with the same log P. The engine-level test
    (tests/engine/test_distribution.py) holds the exact parity bound; here 1e-2 covers batched vs one-token
    kernels on an f32 model whose logits are O(1)."""
    tokens, lps, tops = _greedy_logprobs(client, "ar", presence_penalty=0.5, frequency_penalty=0.3)
    assert tokens and all(lp <= 0 for lp in lps)
    for top, tok, lp in zip(tops, tokens, lps):
        assert len(top) == 3 and top[0].token == tok and top[0].logprob == pytest.approx(lp)
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
    for mode in ("auto", "spec"):
        m_tokens, m_lps, _ = _greedy_logprobs(client, mode, presence_penalty=0.5, frequency_penalty=0.3)
        assert m_tokens == tokens, mode
        assert max(abs(a - b) for a, b in zip(lps, m_lps)) < 1e-2, mode


def test_logprobs_streamed_and_completions(client: Any) -> None:
    stream = _chat(client, "hello", logprobs=True, top_logprobs=1, max_tokens=12, stream=True,
                   stream_options={"include_usage": True}, extra_body={"mode": "spec"})
    n_lp, usage = 0, None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            n_lp += len(c.logprobs.content) if c.logprobs else 0
    assert usage is not None and n_lp == usage.completion_tokens
    r = client.completions.create(model=MODEL_ID, prompt="def f(x):", logprobs=2, max_tokens=6, echo=True)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert lp.text_offset[0] == len("def f(x):") and all(len(t) <= 2 for t in lp.top_logprobs)


# ------------------------------------------------------------------------------------------ penalties, bias, n
def test_penalties_and_bias_reach_the_engine(client: Any) -> None:
    plain = _chat(client, "repeat after me", max_tokens=32, extra_body={"mode": "ar"}).choices[0].message.content
    # negative presence and frequency favour the answer's own tokens: the random tiny model rarely repeats one,
    # so positive penalties alone might change nothing in 32 tokens
    kw = dict(presence_penalty=-2.0, frequency_penalty=-0.5, extra_body={"repeat_penalty": 1.3})
    for mode in ("ar", "auto", "spec"):
        body = {**kw, "extra_body": {**kw["extra_body"], "mode": mode}}
        text = _chat(client, "repeat after me", max_tokens=32, **body).choices[0].message.content
        if mode == "ar":
            penalised = text
            assert penalised != plain, "the penalties changed nothing"
        else:
            assert text == penalised, mode  # greedy spec and auto keep ar's distribution (spec 4)


def _ids(server: str, content: str = "anything", **fields: Any) -> list[list[int]]:
    """Each choice's token ids of a chat answer (return_token_ids; greedy unless fields say otherwise)."""
    status, body = post(server + "/v1/chat/completions", {"model": MODEL_ID, "max_tokens": 8, **THINK_OFF,
                                                          "return_token_ids": True, **fields,
                                                          "messages": [{"role": "user", "content": content}]})
    assert status == 200, body
    return [c["token_ids"] for c in body["choices"]]


def test_logit_bias(server: str) -> None:
    """-100 bans (OpenAI), a large positive bias forces: both on the greedy answer's first token."""
    (first, *_), = _ids(server)
    (banned,) = _ids(server, logit_bias={str(first): -100})
    assert first not in banned
    (forced,) = _ids(server, logit_bias={"65": 100})
    assert forced[0] == 65


def test_n_answers_on_slots(server: str) -> None:
    """n = 2 runs on the two slots; answer i samples with seed + i, so answer 1 equals a lone request with seed + 1."""
    # ar: a sampled auto answer depends on its timed draft decisions, so only ar's is fixed by the seed
    status, body = post(server + "/v1/chat/completions", {"model": MODEL_ID, "n": 2, "temperature": 1.0, "seed": 11,
                                                          "mode": "ar",
                                                          "max_tokens": 16, "return_token_ids": True, **THINK_OFF,
                                                          "messages": [{"role": "user", "content": "two answers"}]})
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in body["choices"])
    (alone,) = _ids(server, "two answers", temperature=1.0, seed=12, max_tokens=16, mode="ar")
    assert body["choices"][1]["token_ids"] == alone
    status, body = post(server + "/v1/chat/completions", {"model": MODEL_ID, "n": 3, "max_tokens": 4,
                                                          "messages": [{"role": "user", "content": "x"}]})
    assert status == 400 and body["error"]["param"] == "n"


def test_n_answers_streamed(client: Any, server: str) -> None:
    """Streamed, the two answers' chunks interleave under one id, each choice with its index, and each answer's
    text equals the whole (non-streamed) answer of the same request. In ar: a sampled auto answer depends on its
    draft decisions, which follow the passes' measured times, so only ar's is fixed by the seed."""
    request = dict(n=2, temperature=1.0, seed=21, max_tokens=12, extra_body={"mode": "ar"})
    whole = _chat(client, "two streams", **request)
    texts, finished, ids = ["", ""], [None, None], set()
    for chunk in _chat(client, "two streams", stream=True, stream_options={"include_usage": True}, **request):
        ids.add(chunk.id)
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finished[c.index] = c.finish_reason or finished[c.index]
        if chunk.usage:
            assert chunk.usage.completion_tokens == whole.usage.completion_tokens
    assert len(ids) == 1 and all(finished)
    assert texts == [c.message.content for c in whole.choices]


# ------------------------------------------------------------------------------------------ bad input
# (bad schemas, grammars, penalties and biases: test_serve_live.py's BAD_CHAT)
@pytest.mark.parametrize(("grammar", "reason"), [
    ("root ::= undefined-rule", "Undefined rule identifier 'undefined-rule'"),
    ('root ::= "a', "unexpected end of input"),
    ("root ::= [a-", "unexpected end of input"),
])
def test_a_grammar_error_gives_llama_cpps_reason(server: str, grammar: str, reason: str) -> None:
    """The 400 tells the client why its GBNF does not parse, in llama.cpp's words."""
    status, body = post(server + "/v1/chat/completions", {"model": MODEL_ID, "max_tokens": 4, **THINK_OFF,
                                                          "grammar": grammar,
                                                          "messages": [{"role": "user", "content": "x"}]})
    assert status == 400 and body["error"]["param"] == "grammar", body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert f"llama.cpp's GBNF parser rejected it: {reason}" in body["error"]["message"], body


def test_grammar_that_allows_nothing(server: str) -> None:
    """A grammar whose only token is the mask token (always banned) is refused before anything runs; one that
    dead-ends after its first token ends the answer with a 400, never a hang."""
    mask_id = get(server + "/v1/models")["data"][0]["clover"]["mask_token_id"]
    for grammar in (f"root ::= <[{mask_id}]>", f'root ::= "a" <[{mask_id}]>'):
        status, body = post(server + "/v1/chat/completions", {"model": MODEL_ID, "max_tokens": 8, **THINK_OFF,
                                                              "grammar": grammar,
                                                              "messages": [{"role": "user", "content": "x"}]})
        assert status == 400, body
        assert "grammar" in body["error"]["message"]
