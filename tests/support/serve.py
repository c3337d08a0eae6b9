"""Helpers for the server tests: a live `clover-cpp serve` (the patched llama-server: ``clover_serve``) on a GGUF,
plain HTTP calls, and the checks of an error body."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit


from clover_dev.process import cli_command, free_port, serving
from tests.support.chat import child_env

MODEL_ID = "tiny"  # the tiny checkpoint's GGUF, served under its file name (tests/surfaces/conftest.py)
THINK_OFF = {"chat_template_kwargs": {"enable_thinking": False}}


@contextmanager
def clover_serve(gguf: Path, *args: str, env: dict[str, str] | None = None, ready_s: float = 120,
                 alive_at_end: bool = True) -> Iterator[tuple[str, subprocess.Popen[bytes], Path]]:
    """A live `clover-cpp serve` (llama-server) on ``gguf``, on 127.0.0.1 and a free port, its log a new file
    beside the GGUF: (url, process, log path); SIGTERM at the end."""
    port = free_port()
    log_path = gguf.parent / f"clover-serve-{time.monotonic_ns()}.log"
    argv = cli_command("serve", "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), *args)
    with serving(argv, port, log_path=log_path, ready_s=ready_s, env=child_env() | (env or {}),
                 alive_at_end=alive_at_end) as (url, proc):
        yield url, proc, log_path


def no_end_of_thinking() -> tuple[str, str]:
    """llama-server arguments that keep a model from closing its reasoning: the shipped tokenizer's `</think>` at
    -inf. The chat-trained demo closes it at once when thinking is on; tests of reasoning output want some."""
    from clover_common.tokenizer import TOKENIZER_DIR, load_tokenizer

    think_close = load_tokenizer(TOKENIZER_DIR).token_to_id("</think>")
    assert think_close is not None, "the shipped tokenizer has no </think> token"
    return ("--logit-bias", f"{think_close}-inf")


def address(url: str) -> tuple[str, int]:
    """The (host, port) a server's URL names, for raw sockets."""
    parts = urlsplit(url)
    assert parts.hostname and parts.port, url
    return parts.hostname, parts.port


def get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def http(url: str, body: bytes | dict[str, Any] | None = None, headers: dict[str, str] | None = None,
         method: str | None = None, timeout: float = 30) -> tuple[int, dict[str, str], bytes]:
    """(status, headers by lower-case name, body) of any answer, an error's included. A dict ``body`` is sent as
    JSON; ``method`` is POST with a body and GET without unless given; Content-Type is JSON unless ``headers`` say
    otherwise."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, err.read()


def post_raw(url: str, body: bytes, content_type: str = "application/json",
             method: str = "POST", headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    status, _, answer = http(url, body if method == "POST" else None, {"Content-Type": content_type, **(headers or {})},
                             method, timeout=60)
    return status, json.loads(answer)


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    return post_raw(url, json.dumps(body).encode())


def sse_chunks(raw: bytes) -> list[Any]:
    """The JSON objects of a server-sent event stream's data lines (an end marker such as [DONE] is not one)."""
    return [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]


def emitted_tokens(answer: dict[str, Any]) -> list[int]:
    """llama-server's returned tokens less the end-of-generation token it stopped at, which the engine does not emit
    (spec 4.2, "Emit")."""
    return answer["tokens"][:-1] if answer["stop_type"] == "eos" else answer["tokens"]


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
