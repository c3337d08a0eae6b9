"""The Anthropic Messages API of `clover-cpp serve` (llama-server's `/v1/messages`) through the official `anthropic`
SDK, on the demo model (tool use is tests/native/test_serve_tools.py):

- `messages.create` answers what Chat Completions answers for the same request, in `ar`, `auto`, `spec` and
  `diffusion`, with the matching stop reason; the lossless modes give `ar`'s answer;
- `messages.stream` gives every event in order (`message_start`, then per block `content_block_start`, its deltas
  and `content_block_stop`, then `message_delta` and `message_stop`), and its final message is `create`'s;
- with thinking on (the demo template's default; the server keeps the model from closing it, which the chat-trained
  demo does at once), the reasoning is a `thinking` block, streamed as thinking deltas, equal to Chat Completions'
  `reasoning_content`;
- `count_tokens` counts the prompt's tokens as Chat Completions does.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.serve import clover_serve, no_end_of_thinking

pytestmark = pytest.mark.native

MODEL = "demo"
MODES = ("ar", "auto", "spec", "diffusion")
THINK_OFF = {"chat_template_kwargs": {"enable_thinking": False}}
SYSTEM = "You are a careful Python programmer."
ASK = [{"role": "user", "content": "Write a function that reverses a string."}]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def server(demo_gguf: Path) -> Iterator[str]:
    # thinking on, and the demo kept from closing it: with thinking on, all it writes is reasoning
    with clover_serve(demo_gguf, "-c", "2048", "-np", "1", "-t", "2", "--no-warmup", "--alias", MODEL,
                      "--think", "on", *no_end_of_thinking()) as (url, _, _):
        yield url


def _anthropic(url: str) -> Any:
    import anthropic

    return anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120)


def _chat(url: str, **extra: Any) -> Any:
    """The Chat Completions answer to the same request."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": SYSTEM}, *ASK],
                                          max_tokens=MAX_TOKENS, temperature=0.0, extra_body=extra)


def _create(url: str, **extra: Any) -> Any:
    return _anthropic(url).messages.create(model=MODEL, system=SYSTEM, messages=ASK, max_tokens=MAX_TOKENS,
                                           extra_body={"temperature": 0.0, **extra})  # the SDK takes no temperature


def _blocks(msg: Any) -> list[tuple[str, str]]:
    return [(b.type, b.thinking if b.type == "thinking" else b.text) for b in msg.content]


@pytest.mark.parametrize("mode", MODES)
def test_messages_create_answers_as_chat_completions(server: str, mode: str) -> None:
    extra = {"mode": mode, **THINK_OFF}
    want = _chat(server, **extra).choices[0]
    msg = _create(server, **extra)
    assert _blocks(msg) == [("text", want.message.content)] and want.message.content
    assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[want.finish_reason], msg.stop_reason
    assert msg.role == "assistant" and msg.model and msg.usage.output_tokens > 0
    if mode != "diffusion":  # lossless: ar's answer
        assert _blocks(msg) == _blocks(_create(server, mode="ar", **THINK_OFF))


def _check_order(kinds: list[str]) -> None:
    """message_start, then per block its start, deltas and stop, then message_delta and message_stop."""
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    body = kinds[1:-2]
    while body:
        assert body[0] == "content_block_start", kinds
        end = body.index("content_block_stop")
        assert end > 1 and set(body[1:end]) <= {"content_block_delta", "text", "thinking", "signature"}, kinds
        body = body[end + 1:]


@pytest.mark.parametrize(("mode", "thinking"), [(mode, False) for mode in MODES] + [("auto", True)])
def test_messages_stream_gives_every_event_in_order(server: str, mode: str, thinking: bool) -> None:
    """In every mode, the stream's events in order, and its message the same as create's."""
    extra = {"mode": mode} if thinking else {"mode": mode, **THINK_OFF}
    with _anthropic(server).messages.stream(model=MODEL, system=SYSTEM, messages=ASK, max_tokens=MAX_TOKENS,
                                            extra_body={"temperature": 0.0, **extra}) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    _check_order(kinds)
    assert ("thinking" in kinds) == thinking and ("text" in kinds) == (not thinking), kinds
    assert _blocks(final) == _blocks(_create(server, **extra))


def test_thinking_is_a_thinking_block(server: str) -> None:
    """Thinking on: the server keeps the demo from writing the end of thinking, so all it wrote is reasoning."""
    want = _chat(server, mode="ar").choices[0].message
    reasoning = want.model_extra.get("reasoning_content")
    assert reasoning and not want.content
    assert _blocks(_create(server, mode="ar")) == [("thinking", reasoning)]


def test_count_tokens_counts_the_prompt(server: str) -> None:
    for extra in ({}, THINK_OFF):
        counted = _anthropic(server).messages.count_tokens(model=MODEL, system=SYSTEM, messages=ASK,
                                                          extra_body=extra)
        assert counted.input_tokens == _chat(server, mode="ar", **extra).usage.prompt_tokens


def test_thinking_field_switches_the_templates_thinking(server: str) -> None:
    """Anthropic's `thinking` switches the template's thinking on a server whose default is on: `disabled` answers
    as chat_template_kwargs.enable_thinking false does (text, no thinking block), `enabled` as true does (patch
    server-anthropic-thinking-switch: `disabled` was ignored); chat_template_kwargs wins when both are given."""
    client = _anthropic(server)

    def create(**fields: Any) -> Any:
        return client.messages.create(model=MODEL, system=SYSTEM, messages=ASK, max_tokens=MAX_TOKENS,
                                      extra_body={"temperature": 0.0}, **fields)

    off = create(thinking={"type": "disabled"})
    assert _blocks(off) == _blocks(_create(server, **THINK_OFF)) and off.content[0].type == "text", off
    on = create(thinking={"type": "enabled", "budget_tokens": 1024})
    assert on.content[0].type == "thinking", on
    both = client.messages.create(model=MODEL, system=SYSTEM, messages=ASK, max_tokens=MAX_TOKENS,
                                  thinking={"type": "disabled"},
                                  extra_body={"temperature": 0.0, "chat_template_kwargs": {"enable_thinking": True}})
    assert both.content[0].type == "thinking", both
