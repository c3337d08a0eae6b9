"""A fuzz of the server's request bodies (docs/serve.md, "Errors"), seeded and bounded.

For each endpoint that reads a body, every field of a valid request (and every field its schema knows that the
request leaves out) gets, one at a time, a value of each kind below; then bodies with a few fields changed at once,
and bodies that are no JSON object at all. Kinds: null, a wrong type, an edge number (spliced into the JSON text as
is, so NaN and Infinity too, which JSON has not: 1e308, 1e39, 2^31, 2^63, 10^5000 digits, -0), a hostile string (a
lone surrogate, NUL, 300,000 characters), bytes that are no UTF-8, a deep nesting, a huge list or object.

Every answer must be a 2xx, or a 4xx with the OpenAI error body and a one-line message, never a 5xx; a stream's
events must not carry a server error; the server answers /health and a valid request afterwards.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import fuzz_bodies
from tests.support.fuzz_bodies import MESSAGES, TOOLS, WHOLE, Raw, deep, mutated_requests, raw_answer
from tests.support.serve import MODEL_ID, address, check_error_body, get, http, serve

pytestmark = pytest.mark.native

SEED = 44
TOP_LEVEL_ONLY = {"/apply-template"}  # its messages and tools are a chat request's, whose nested fields are fuzzed


SAMPLING = {"model": MODEL_ID, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 7, "n": 1, "stream": False,
            "stop": ["\n\n"], "presence_penalty": 0.1, "frequency_penalty": 0.1, "repeat_penalty": 1.1,
            "logit_bias": {"5": 1.0}, "user": "fuzz", "mode": "ar", "block_size": 8, "threshold": 0.9,
            "coreset_top_p": 1.0, "ignore_eos": False, "return_token_ids": True, "cache_prompt": True}
# a valid body of each endpoint, with most of its fields
BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {**SAMPLING, "messages": MESSAGES, "max_tokens": 1, "max_completion_tokens": 1,
                             "tools": TOOLS, "tool_choice": "auto", "parallel_tool_calls": True, "logprobs": True,
                             "top_logprobs": 2, "response_format": {"type": "text"}, "reasoning_effort": "low",
                             "chat_template_kwargs": {"enable_thinking": False}, "clover_canvas": False},
    "/v1/completions": {**SAMPLING, "prompt": "def add(a, b):", "max_tokens": 1, "echo": True, "logprobs": 2},
    "/tokenize": {"content": "hello <|im_start|>", "add_special": True, "parse_special": True, "with_pieces": True},
    "/detokenize": {"tokens": [1, 2, 3]},
    "/apply-template": {"messages": MESSAGES, "tools": TOOLS, "chat_template_kwargs": {"enable_thinking": True}},
}


def _schema_fields(endpoint: str) -> set[str]:
    """The top-level fields the server's request model knows (its implementation; the fuzz sends each)."""
    from clover_cpp.serve import schema

    model = {"/v1/chat/completions": schema.ChatCompletionRequest, "/v1/completions": schema.CompletionRequest,
             "/tokenize": schema.TokenizeRequest, "/detokenize": schema.DetokenizeRequest,
             "/apply-template": schema.ApplyTemplateRequest}[endpoint]
    return {f.alias or name for name, f in model.model_fields.items()}


def cases(endpoint: str, rng: random.Random) -> Iterator[tuple[str, bytes]]:
    """(what it is, body) for one endpoint: its valid body's fields, and those its request model knows."""
    return fuzz_bodies.cases(BODIES[endpoint], rng, _schema_fields(endpoint), endpoint in TOP_LEVEL_ONLY)


def check_answer(status: int, headers: dict[str, str], answer: bytes, what: str) -> str | None:
    """Why an answer breaks the contract, or None."""
    if status >= 500 or status < 200:
        return f"{status}: {answer[:300]!r}"
    if status >= 400:
        try:
            check_error_body(status, answer, what)
        except AssertionError as exc:  # pytest.fail's Failed is no AssertionError: a non-JSON body fails at once
            return f"{status} body: {exc}"
        return None
    if headers.get("content-type", "").startswith("text/event-stream"):
        for line in answer.decode("utf-8", "replace").splitlines():
            data = line.removeprefix("data: ")
            if line.startswith("data: ") and data != "[DONE]":
                event = json.loads(data)
                if "error" in event and event["error"].get("type") == "server_error":
                    return f"a stream's error event: {data[:300]}"
        return None
    json.loads(answer)
    return None


@pytest.fixture(scope="module")
def server(tiny_gguf: Path) -> Iterator[str]:
    """-n 2: a request whose length field the fuzz nulls answers in 2 tokens at most."""
    with serve(tiny_gguf, tiny_gguf.parent, "--max-block-size", "32", "-n", "2", "--props") as (url, _, _):
        yield url


def test_fuzzed_bodies_get_a_2xx_or_a_4xx_with_an_error_body(server: str) -> None:
    rng = random.Random(SEED)
    failures: list[str] = []
    sent = 0
    start = time.monotonic()
    for endpoint in BODIES:
        for what, body in cases(endpoint, rng):
            status, headers, answer = http(server + endpoint, body, timeout=60)
            sent += 1
            why = check_answer(status, headers, answer, what)
            if why:
                failures.append(f"{endpoint} {what}: {why}")
        for body in WHOLE:
            for content_type in ("application/json", "text/plain"):
                status, headers, answer = http(server + endpoint, body, {"Content-Type": content_type}, timeout=60)
                sent += 1
                why = check_answer(status, headers, answer, "whole body")
                if why:
                    failures.append(f"{endpoint} whole body {body[:40]!r} ({content_type}): {why}")
    seconds = time.monotonic() - start
    assert not failures, f"{len(failures)} of {sent} answers broke the contract:\n" + "\n".join(failures[:20])
    assert get(server + "/health")["status"] == "ok"
    status, _, answer = http(server + "/v1/chat/completions", BODIES["/v1/chat/completions"], timeout=60)
    assert status == 200, answer[:300]
    print(f"{sent} fuzzed requests in {seconds:.1f} s")


def _completion(url: str, **fields: Any) -> tuple[int, bytes]:
    status, _, answer = http(url + "/v1/completions", {"model": MODEL_ID, "prompt": "x", "max_tokens": 1, **fields},
                             timeout=60)
    return status, answer


def _array_schema(depth: int) -> Raw:
    """A schema ``depth`` levels deep (past 100,000, nested arrays: the body stays within --max-body-bytes)."""
    if depth > 100_000:
        return deep(depth, "[")
    return Raw('{"type":"array","items":' * depth + "{}" + "}" * depth)


def test_nesting_from_below_the_caps_to_a_milliondeep(server: str) -> None:
    """GBNF groups (llama.cpp's parser refuses more than 1000 levels, docs/serve.md "Limits"), a JSON schema (the
    converter's limit, then Python's JSON parser's) and the body itself, from 10 to 1,000,000 levels: below the
    caps an answer, above them a 400 naming the field (or the body), never a crash."""
    for depth in (10, 1000, 1001, 20_000, 1_000_000):
        grammar = "root ::= " + "(" * depth + '"a"' + ")" * depth
        status, answer = _completion(server, grammar=grammar)
        if depth <= 1000:
            assert status == 200 and json.loads(answer)["choices"][0]["text"] == "a", (depth, answer[:300])
        else:
            err = check_error_body(status, answer, depth)
            assert status == 400 and err["param"] == "grammar" and "1000" in err["message"], (depth, err)
    for depth in (10, 100, 300, 1000, 20_000, 1_000_000):
        body = b'{"model": "' + MODEL_ID.encode() + b'", "prompt": "x", "max_tokens": 1, "json_schema": ' + \
            _array_schema(depth).data + b"}"
        status, _, answer = http(server + "/v1/completions", body, timeout=60)
        if depth <= 100:
            assert status == 200, (depth, answer[:300])
            continue
        err = check_error_body(status, answer, depth)
        assert status == 400 and (err["param"] == "json_schema" or err["code"] == "invalid_json"), (depth, err)
        assert depth < 1000 or err["code"] == "invalid_json", (depth, err)  # past what the body parser reads
    assert get(server + "/health")["status"] == "ok"


@pytest.mark.parametrize(("fields", "param", "fragment"), [
    ({"json_schema": {"type": "string", "pattern": "[unclosed"}}, "json_schema", "pattern"),
    ({"json_schema": {"type": "object", "properties": {"a": {"type": "string", "pattern": "^a(?=b)$"}}}},
     "json_schema", "pattern"),
    ({"json_schema": {"type": "object", "properties": {"a": {"type": "nosuchtype"}, "b": {"type": "nothing"}}}},
     "json_schema", "nosuchtype"),
])
def test_a_schema_the_converter_cannot_enforce_is_a_400_on_one_line(server: str, fields: dict[str, Any], param: str,
                                                                   fragment: str) -> None:
    """A pattern the grammar cannot enforce is refused, not relaxed to any string; the converter's reasons, a line
    each, arrive as one line."""
    status, answer = _completion(server, **fields)
    err = check_error_body(status, answer, fields)
    assert status == 400 and err["param"] == param and fragment in err["message"], err


def test_malformed_http_gets_a_400_with_an_error_body(server: str) -> None:
    """Requests h11 cannot read are answered with a 400 and the OpenAI error body, never a 5xx; the server lives."""
    where = address(server)
    failures, unreadable = [], 0
    for request in mutated_requests(where, random.Random(SEED), MODEL_ID):
        answer = raw_answer(where, request)
        if not answer:
            continue  # cut before the head ended: the end of input closes it
        head, _, body = answer.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        why = check_answer(status, {"content-type": "application/json"}, body, request[:80])
        if why:
            failures.append(f"{request[:80]!r}: {why}")
        unreadable += status == 400 and b'"invalid_http"' in body
    assert not failures, "\n".join(failures[:10])
    assert unreadable >= 10, f"only {unreadable} of the mutated requests got the 400 invalid_http"
    assert get(server + "/health")["status"] == "ok"
