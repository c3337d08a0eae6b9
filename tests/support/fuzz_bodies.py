"""A fuzz of JSON request bodies and of HTTP requests, seeded and bounded, for the server tests
(tests/surfaces/test_serve_fuzz.py, tests/native/test_serve_robust.py).

For a valid body, every field (and every extra field named) gets, one at a time, a value of each kind below; then
bodies with a few fields changed at once. Kinds: null, a wrong type, an edge number (spliced into the JSON text as
is, so NaN and Infinity too, which JSON has not: 1e308, 1e39, 2^31, 2^63, 10^5000 digits, -0), a hostile string (a
lone surrogate, NUL, 300,000 characters), bytes that are no UTF-8, a deep nesting, a huge list or object. WHOLE
holds bodies that are no JSON object at all; mutated_requests, a valid HTTP request changed byte by byte.
"""

from __future__ import annotations

import copy
import json
import random
import socket
from collections.abc import Callable, Iterator
from typing import Any

COMBINED = 25  # bodies per endpoint with 2 to 4 fields changed at once
# a chat with every role and part a valid body may hold, and one tool: what the chat bodies start from
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "What is 2 + 3?"}]},
            {"role": "assistant", "content": None, "reasoning_content": "add them",
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 2}"}}]},
            {"role": "tool", "content": "5", "tool_call_id": "c1", "name": "add"},
            {"role": "user", "content": "thanks"}]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "adds", "strict": False, "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
LENGTH_FIELDS = {"max_tokens", "max_completion_tokens", "max_output_tokens"}  # combined changes leave them alone


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


def deep(depth: int, opener: str) -> Raw:
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
    "deep": lambda r: deep(r.choice([50, 900, 5000, 100_000]), r.choice("[{")),
    "big": lambda r: r.choice([Raw("[" + ",".join(["0"] * 100_000) + "]"),
                               Raw("{" + ",".join(f'"k{i}":{i}' for i in range(20_000)) + "}")]),
}
# bodies that are no JSON object, or not one json.loads reads
WHOLE = (b"", b"null", b"[]", b"1", b'"x"', b"{", b'{"model": ', b"\xff\xfe{}", b"\xef\xbb\xbf{}", b"{}" * 2, b"NaN",
         b"[" * 1_000_000, b'{"a":' * 200_000, b"1" + b"0" * 5000, b'{"model": "x"} trailing', b"\x00" * 100)

def paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every field of a body, nested ones included (a list by its items)."""
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return
    for key, item in items:
        yield prefix + (key,)
        yield from paths(item, prefix + (key,))


def at(body: dict[str, Any], path: tuple[Any, ...]) -> Any:
    node: Any = body
    for key in path:
        if not isinstance(node, (dict, list)) or (isinstance(node, dict) and key not in node):
            return None
        node = node[key]
    return node


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def changed(body: dict[str, Any], changes: dict[tuple[Any, ...], Any]) -> dict[str, Any]:
    out = copy.deepcopy(body)
    for path, value in changes.items():
        node = out
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return out


def cases(body: dict[str, Any], rng: random.Random, extra_fields: set[str] = frozenset(),
          top_level_only: bool = False) -> Iterator[tuple[str, bytes]]:
    """(what it is, encoded body) for one valid ``body``: each field (only the top-level ones with
    ``top_level_only``; and each of ``extra_fields`` the body leaves out) with each kind, then COMBINED bodies
    changed at once (LENGTH_FIELDS left alone, so that answers stay short)."""
    fields = [p for p in paths(body) if len(p) == 1 or not top_level_only]
    fields += [(name,) for name in sorted(set(extra_fields) - set(body))]
    for path in fields:
        name = ".".join(map(str, path))
        for kind, make in KINDS.items():
            values = [make(rng)]
            if kind == "number" and is_number(at(body, path)):  # a number field gets every edge number
                values = [Raw(n) for n in NUMBERS]
            for value in values:
                yield f"{name} = {kind} {value!r:.60}", encode(changed(body, {path: value}))
    free = [p for p in fields if p[0] not in LENGTH_FIELDS]
    for _ in range(COMBINED):
        changes: dict[tuple[Any, ...], Any] = {}
        for path in rng.sample(free, min(len(free), rng.randint(2, 4))):
            if not any(path[:len(p)] == p or p[:len(path)] == path for p in changes):  # not inside another
                changes[path] = KINDS[rng.choice(list(KINDS))](rng)
        yield f"combined {changes!r:.200}", encode(changed(body, changes))


HTTP_MUTATIONS = 60


def mutated_requests(where: tuple[str, int], rng: random.Random, model: str) -> Iterator[bytes]:
    """A valid /v1/completions request for ``model`` with one byte-level change each: bytes replaced or inserted
    (CR, LF, NUL, 0xff, a space, a colon), cut short, a header repeated or made 20,000 bytes long, a method or
    version made up."""
    body = encode({"model": model, "prompt": "hi", "max_tokens": 1})
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


def raw_answer(where: tuple[str, int], request: bytes) -> bytes:
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


