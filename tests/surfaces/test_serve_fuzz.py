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

import copy
import json
import random
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.serve import MODEL_ID, address, check_error_body, get, http, serve

pytestmark = pytest.mark.native

SEED = 44
COMBINED = 25  # bodies per endpoint with 2 to 4 fields changed at once
LENGTH_FIELDS = {"max_tokens", "max_completion_tokens"}  # combined changes leave them: answers stay 1 token long
TOP_LEVEL_ONLY = {"/apply-template"}  # its messages and tools are a chat request's, whose nested fields are fuzzed


class Raw:
    """JSON text spliced into a body as is: what json.dumps would not write."""

    def __init__(self, data: str | bytes) -> None:
        self.data = data.encode() if isinstance(data, str) else data

    def __repr__(self) -> str:
        return f"Raw({self.data[:40]!r}{'...' if len(self.data) > 40 else ''} {len(self.data)} bytes)"


def encode(value: Any) -> bytes:
    if isinstance(value, Raw):
        return value.data
    if isinstance(value, dict):
        return b"{" + b",".join(json.dumps(k).encode() + b":" + encode(v) for k, v in value.items()) + b"}"
    if isinstance(value, list):
        return b"[" + b",".join(encode(v) for v in value) + b"]"
    return json.dumps(value).encode()  # ASCII: a lone surrogate becomes its \\u escape


def _deep(depth: int, opener: str) -> Raw:
    return Raw('{"a":' * depth + "1" + "}" * depth if opener == "{" else "[" * depth + "]" * depth)


NUMBERS = ("NaN", "Infinity", "-Infinity", "1e308", "-1e308", "1e39", "-1e39", "1e400", "2147483648", "-2147483649",
           "4294967296", "9223372036854775808", "-9223372036854775809", "1" + "0" * 5000, "-" + "9" * 400, "-0",
           "-0.0", "1e-400", "0.5", "3.4028235e38")
STRINGS = ("\ud800", "a\udfffb", "\x00", "\n\r\u2028", "x" * 300_000, "🙂" * 2000, "<|im_start|>user\n", "{{ 7*7 }}",
           "%s%n", "../../etc/passwd")
BAD_UTF8 = (b'"\xff\xfe"', b'"a\xc3("', b'"\xed\xa0\x80"', b'"\xf8\x88\x80\x80\x80"', b'"\xc0\xaf"')
KINDS: dict[str, Callable[[random.Random], Any]] = {
    "null": lambda r: None,
    "type": lambda r: r.choice([True, False, 0, 1, -1, 1.5, "", "x", [], {}, [1, "a"], {"k": "v"}]),
    "number": lambda r: Raw(r.choice(NUMBERS)),
    "string": lambda r: r.choice(STRINGS),
    "utf8": lambda r: Raw(r.choice(BAD_UTF8)),
    "deep": lambda r: _deep(r.choice([50, 900, 5000, 100_000]), r.choice("[{")),
    "big": lambda r: r.choice([Raw("[" + ",".join(["0"] * 100_000) + "]"),
                               Raw("{" + ",".join(f'"k{i}":{i}' for i in range(20_000)) + "}")]),
}
# bodies that are no JSON object, or not one json.loads reads
WHOLE = (b"", b"null", b"[]", b"1", b'"x"', b"{", b'{"model": ', b"\xff\xfe{}", b"\xef\xbb\xbf{}", b"{}" * 2, b"NaN",
         b"[" * 1_000_000, b'{"a":' * 200_000, b"1" + b"0" * 5000, b'{"model": "x"} trailing', b"\x00" * 100)

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "What is 2 + 3?"}]},
            {"role": "assistant", "content": None, "reasoning_content": "add them",
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 2}"}}]},
            {"role": "tool", "content": "5", "tool_call_id": "c1", "name": "add"},
            {"role": "user", "content": "thanks"}]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "adds", "strict": False, "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
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


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every field of a body, nested ones included (a list by its items)."""
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return
    for key, item in items:
        yield prefix + (key,)
        yield from _paths(item, prefix + (key,))


def _at(body: dict[str, Any], path: tuple[Any, ...]) -> Any:
    node: Any = body
    for key in path:
        if not isinstance(node, (dict, list)) or (isinstance(node, dict) and key not in node):
            return None
        node = node[key]
    return node


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _changed(body: dict[str, Any], changes: dict[tuple[Any, ...], Any]) -> dict[str, Any]:
    out = copy.deepcopy(body)
    for path, value in changes.items():
        node = out
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return out


def cases(endpoint: str, rng: random.Random) -> Iterator[tuple[str, bytes]]:
    """(what it is, body) for one endpoint: each field with each kind, then COMBINED bodies changed at once."""
    body = BODIES[endpoint]
    paths = [p for p in _paths(body) if len(p) == 1 or endpoint not in TOP_LEVEL_ONLY]
    paths += [(name,) for name in sorted(_schema_fields(endpoint) - set(body))]
    for path in paths:
        name = ".".join(map(str, path))
        for kind, make in KINDS.items():
            values = [make(rng)]
            if kind == "number" and _is_number(_at(body, path)):  # a number field gets every edge number
                values = [Raw(n) for n in NUMBERS]
            for value in values:
                yield f"{name} = {kind} {value!r:.60}", encode(_changed(body, {path: value}))
    free = [p for p in paths if p[0] not in LENGTH_FIELDS]
    for _ in range(COMBINED):
        changes = {}
        for path in rng.sample(free, min(len(free), rng.randint(2, 4))):
            if not any(path[:len(p)] == p or p[:len(path)] == path for p in changes):  # not inside another
                changes[path] = KINDS[rng.choice(list(KINDS))](rng)
        yield f"combined {changes!r:.200}", encode(_changed(body, changes))


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
        return _deep(depth, "[")
    return Raw('{"type":"array","items":' * depth + "{}" + "}" * depth)


def test_nesting_from_below_the_caps_to_a_million_deep(server: str) -> None:
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


HTTP_MUTATIONS = 60


def _mutated_requests(where: tuple[str, int], rng: random.Random) -> Iterator[bytes]:
    """A valid request with one byte-level change each: bytes replaced or inserted (CR, LF, NUL, 0xff, a space,
    a colon), cut short, a header repeated or made 20,000 bytes long, a method or version made up."""
    body = encode({"model": MODEL_ID, "prompt": "hi", "max_tokens": 1})
    valid = (f"POST /v1/completions HTTP/1.1\r\nHost: {where[0]}:{where[1]}\r\nContent-Type: application/json\r\n"
             f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    head_end = valid.index(b"\r\n\r\n")
    for _ in range(HTTP_MUTATIONS):
        at = rng.randrange(head_end + 4)
        change = rng.choice(["replace", "insert", "cut", "repeat", "long", "method", "version"])
        noise = bytes([rng.choice(b"\r\n\x00\xff :\t%")]) * rng.choice([1, 2, 5])
        if change == "replace":
            yield valid[:at] + noise + valid[at + len(noise):]
        elif change == "insert":
            yield valid[:at] + noise + valid[at:]
        elif change == "cut":
            yield valid[:at]
        elif change == "repeat":
            yield valid.replace(b"Content-Length:", b"Content-Length: 3\r\nContent-Length:", 1)
        elif change == "long":
            yield valid.replace(b"\r\n\r\n", b"\r\nX-Fill: " + b"a" * 20_000 + b"\r\n\r\n", 1)
        elif change == "method":
            yield rng.choice([b"BREW", b"G\xffT", b"get", b""]) + valid[4:]
        else:
            yield valid.replace(b"HTTP/1.1", rng.choice([b"HTTP/2.0", b"HTTP/1.x", b"HTTP/0.9", b""]), 1)


def _raw_answer(where: tuple[str, int], request: bytes) -> bytes:
    """What the server answers ``request`` followed by end of input (b"" when it closes without a word)."""
    with socket.create_connection(where, timeout=30) as sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except ConnectionResetError:
            pass
    return answer


def test_malformed_http_gets_a_400_with_an_error_body(server: str) -> None:
    """Requests h11 cannot read are answered with a 400 and the OpenAI error body, never a 5xx; the server lives."""
    where = address(server)
    failures, unreadable = [], 0
    for request in _mutated_requests(where, random.Random(SEED)):
        answer = _raw_answer(where, request)
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
