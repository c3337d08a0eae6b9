"""Bad requests to `clover-cpp serve` (llama-server) get a 4xx with llama-server's error body, never a 5xx or a crash
(docs/serve.md, "Bad requests"): a seeded fuzz of every field of a valid body of each API (tests/support/
fuzz_bodies.py), bodies that are no JSON object, bodies nested from below the cap to a million levels, and HTTP
requests changed byte by byte. Before patches 0029 and 0030 this fuzz killed the server four times (a body
some 100,000 levels deep overflowed a handler thread's stack) and got 166 answers of 500 for malformed messages,
tools and token ids.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.support import fuzz_bodies
from tests.support.fuzz_bodies import MESSAGES, TOOLS, WHOLE, Raw, mutated_requests, raw_answer
from tests.support.serve import address, clover_serve, get, http

pytestmark = pytest.mark.native

SEED = 45
MODEL = "demo"
MAX_DEPTH = 512  # the patch's SERVER_JSON_MAX_DEPTH
SAMPLING = {"model": MODEL, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 7, "stream": False,
            "stop": ["\n\n"], "presence_penalty": 0.1, "frequency_penalty": 0.1, "logit_bias": {"5": 1.0},
            "mode": "ar", "block_size": 8, "threshold": 0.9, "coreset_top_p": 1.0}
BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {**SAMPLING, "messages": MESSAGES, "max_tokens": 1, "tools": TOOLS,
                             "tool_choice": "auto", "parallel_tool_calls": True, "logprobs": True, "top_logprobs": 2,
                             "response_format": {"type": "text"},
                             "chat_template_kwargs": {"enable_thinking": False}},
    "/v1/completions": {**SAMPLING, "prompt": "def add(a, b):", "max_tokens": 1, "logprobs": 2},
    "/v1/messages": {"model": MODEL, "max_tokens": 1, "system": "Be brief.", "temperature": 0.5,
                     "messages": [{"role": "user", "content": [{"type": "text", "text": "What is 2 + 3?"}]}],
                     "tools": [{"name": "add", "description": "adds", "input_schema": TOOLS[0]["function"][
                         "parameters"]}], "tool_choice": {"type": "auto"}, "stop_sequences": ["\n\n"]},
    "/v1/responses": {"model": MODEL, "input": [{"role": "user", "content": "What is 2 + 3?"}],
                      "max_output_tokens": 1, "instructions": "Be brief.", "temperature": 0.5,
                      "tools": [{"type": "function", **TOOLS[0]["function"]}], "tool_choice": "auto"},
    "/tokenize": {"content": "hello <|im_start|>", "add_special": True, "parse_special": True, "with_pieces": True},
    "/detokenize": {"tokens": [1, 2, 3]},
}


@pytest.fixture(scope="module")
def server(demo_gguf: Path) -> Iterator[str]:
    """-n 2: a request whose length field the fuzz nulls answers in 2 tokens at most."""
    with clover_serve(demo_gguf, "-c", "2048", "-np", "2", "-t", "2", "--no-warmup", "-n", "2", "--alias", MODEL,
                      "--props", "--metrics") as (url, _, _):
        yield url


def check_answer(status: int, answer: bytes, endpoint: str = "") -> str | None:
    """Why an answer breaks the contract, or None: a 2xx, or a 4xx whose body is llama-server's error object (in
    Anthropic's shape on its routes: tagged "type": "error")."""
    if status >= 500 or status < 200:
        return f"{status}: {answer[:300]!r}"
    if status < 400:
        return None
    try:
        error = json.loads(answer)["error"]
    except (ValueError, KeyError, TypeError):
        return f"{status} without an error body: {answer[:300]!r}"
    if error.get("code") != status or not isinstance(error.get("message"), str) or not error.get("type"):
        return f"{status} error body: {error}"
    if endpoint.startswith("/v1/messages") and json.loads(answer).get("type") != "error":
        return f"{status} error body without Anthropic's type: {answer[:300]!r}"
    return None


def test_fuzzed_bodies_get_a_2xx_or_a_4xx_with_an_error_body(server: str) -> None:
    """Sent four at a time (the server's HTTP threads parse and render while its two slots decode)."""
    rng = random.Random(SEED)
    requests = []
    for endpoint, body in BODIES.items():
        requests += [(endpoint, what, data) for what, data in fuzz_bodies.cases(body, rng)]
        requests += [(endpoint, f"whole body {data[:40]!r}", data) for data in WHOLE]

    def send(request: tuple[str, str, bytes]) -> str | None:
        endpoint, what, data = request
        status, _, answer = http(server + endpoint, data, timeout=120)
        why = check_answer(status, answer, endpoint)
        return f"{endpoint} {what}: {why}" if why else None

    with ThreadPoolExecutor(4) as pool:
        failures = [why for why in pool.map(send, requests) if why]
    assert not failures, f"{len(failures)} of {len(requests)} answers broke the contract:\n" + "\n".join(failures[:20])
    assert get(server + "/health")["status"] == "ok"
    status, _, answer = http(server + "/v1/chat/completions", BODIES["/v1/chat/completions"], timeout=60)
    assert status == 200, answer[:300]


def _nested(depth: int) -> Raw:
    return Raw("[" * depth + "]" * depth)


@pytest.mark.parametrize("endpoint, field", [("/v1/chat/completions", "tools"), ("/v1/messages", "system"),
                                             ("/tokenize", "content")])
def test_nesting_from_below_the_cap_to_a_million_deep(server: str, endpoint: str, field: str) -> None:
    """Up to the cap a body is read (whatever the answer); past it, a 400 that says so, before it is parsed."""
    for depth in (10, MAX_DEPTH - 2, MAX_DEPTH, MAX_DEPTH + 1, 100_000, 1_000_000):
        data = fuzz_bodies.encode({**BODIES[endpoint], field: _nested(depth)})
        status, _, answer = http(server + endpoint, data, timeout=120)
        assert check_answer(status, answer, endpoint) is None, (depth, status, answer[:300])
        nests = f"nests arrays and objects deeper than {MAX_DEPTH} levels"
        assert (status == 400 and nests in json.loads(answer)["error"]["message"]) == (depth + 1 > MAX_DEPTH), \
            (depth, status, answer[:300])
    assert get(server + "/health")["status"] == "ok"


def test_malformed_http_gets_a_4xx_with_an_error_body(server: str) -> None:
    """Requests changed byte by byte: never a 5xx, and a 4xx carries the error body, cpp-httplib's own answers
    included (patch server-http-errors-have-a-body; they had an empty body). Some get the 400 of a head
    cpp-httplib cannot read."""
    where = address(server)
    failures, unreadable = [], 0
    for request in mutated_requests(where, random.Random(SEED), MODEL):
        answer = raw_answer(where, request)
        if not answer:
            continue  # cut before the head ended: the end of input closes it
        head, _, body = answer.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        why = check_answer(status, body)
        if why:
            failures.append(f"{request[:80]!r}: {why}")
        unreadable += b'"message":"Bad Request"' in body
    assert not failures, "\n".join(failures[:10])
    assert unreadable >= 10, f"only {unreadable} of the mutated requests got cpp-httplib's 400"
    assert get(server + "/health")["status"] == "ok"



@pytest.mark.parametrize("kwargs", [[0] * 1000, {f"k{i}": i for i in range(257)}, "on"])
def test_template_kwargs_are_an_object_of_a_few_keys(server: str, kwargs: Any) -> None:
    body = {**BODIES["/v1/chat/completions"], "chat_template_kwargs": kwargs}
    status, _, answer = http(server + "/v1/chat/completions", body, timeout=60)
    assert status == 400 and "'chat_template_kwargs' must be an object of at most 256 keys" in \
        json.loads(answer)["error"]["message"], answer[:300]


def test_a_request_lists_at_most_512_tools(server: str) -> None:
    """Every tool is rendered into the prompt and the call grammar: 100,000 of them took the machine's memory."""
    tool = {"type": "function", "function": {"name": "t", "parameters": {"type": "object"}}}
    body = {**BODIES["/v1/chat/completions"], "tools": [tool] * 513, "tool_choice": "required"}
    status, _, answer = http(server + "/v1/chat/completions", body, timeout=60)
    assert status == 400 and "513 tools, more than the 512" in json.loads(answer)["error"]["message"], answer[:300]
    anthropic = {**BODIES["/v1/messages"], "tools": [0] * 100_000}
    status, _, answer = http(server + "/v1/messages", anthropic, timeout=60)
    assert status == 400 and "must be an object" in json.loads(answer)["error"]["message"], answer[:300]


UNENFORCEABLE = [
    {"type": "object", "properties": {"a": {"type": "nosuchtype"}, "b": {"type": "nothing"}}},
    {"type": "string", "pattern": "[unclosed"},
    {"type": "object", "properties": {"a": {"type": "string", "pattern": "^a(?=b)$"}}},
]


@pytest.mark.parametrize("schema", UNENFORCEABLE)
def test_a_schema_the_grammar_cannot_enforce_is_a_400_on_one_line(server: str, schema: dict[str, Any]) -> None:
    """A schema is refused, not relaxed to any string where the grammar cannot enforce it (patch
    server-json-schema-strict; the earlier server's guarantee that `json_schema` answers are never invalid): as
    `json_schema` and as the chat's `response_format`, with the converter's reasons on one line."""
    status, _, answer = http(server + "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                           "json_schema": schema}, timeout=60)
    message = json.loads(answer)["error"]["message"]
    assert status == 400 and "json_schema" in message and "\n" not in message, answer[:300]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    status, _, answer = http(server + "/v1/chat/completions", chat, timeout=60)
    message = json.loads(answer)["error"]["message"]
    assert status == 400 and "\n" not in message, answer[:300]


def test_tool_schemas_stay_lenient_and_strictness_can_be_turned_off(server: str, demo_gguf: Path) -> None:
    """Agents send tools whose parameters hold patterns the grammar cannot enforce: those are relaxed, as before, so
    that a request with them still runs; --no-json-schema-strict relaxes response schemas too."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "^a(?=b)$"}}, "required": ["a"]}}}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "tools": [tool],
            "tool_choice": "required"}
    status, _, answer = http(server + "/v1/chat/completions", chat, timeout=60)
    assert status == 200, answer[:300]
    with clover_serve(demo_gguf, "-c", "512", "-np", "1", "-t", "2", "--no-warmup", "--alias", MODEL,
                      "--no-json-schema-strict") as (url, _, _):
        status, _, answer = http(url + "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                          "json_schema": UNENFORCEABLE[2]}, timeout=60)
        assert status == 200, answer[:300]
