"""Tool calls through `clover-cpp serve` (llama-server's common/chat), with the official SDKs, on the demo model under
two templates: its own, the Qwen3.5 family's (XML `<function=...>` calls, models/templates/Qwen3.5-4B.jinja in the
pinned tree), and Qwen3's (Hermes JSON in `<tool_call>`, models/templates/Qwen-Qwen3-0.6B.jinja):

- `tool_choice` `required` or a named function yields exactly one call to a listed (the named) function, with its
  required arguments, even from the demo model, which writes code whatever it is asked: the grammar leaves no room
  for text before the call (docs/serve.md, "Tool calls");
- through the Chat Completions, Responses and Anthropic Messages APIs, streamed and not, the stream rebuilding the
  answer; in every lossless mode and in diffusion (a request with tools decodes as auto), with the same call;
- a named function that `tools` does not list, or a malformed `tool_choice`, is a 400 with the API's error body.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.serve import clover_serve, http
from tests.support.tools import ASK, TOOLS, pinned_template

pytestmark = pytest.mark.native

MODEL = "demo"
REQUIRED = {t["function"]["name"]: t["function"]["parameters"]["required"] for t in TOOLS}
CHOICES = {"required": "required", "named": {"type": "function", "function": {"name": "add"}}}
GREEDY = {"temperature": 0.0, "parallel_tool_calls": False}


@pytest.fixture(scope="module", params=["hermes", "qwen3.5"])
def server(request: pytest.FixtureRequest, demo_gguf: Path) -> Iterator[str]:
    template = [] if request.param == "qwen3.5" else ["--chat-template-file", str(pinned_template(request.param))]
    with clover_serve(demo_gguf, "-c", "4096", "-np", "1", "-t", "2", "--no-warmup", "--think", "off",
                      "--alias", MODEL, *template) as (url, _, _):
        yield url


def _openai(url: str) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def _check_call(name: str, arguments: str | dict[str, Any], choice: Any) -> tuple[str, dict[str, Any]]:
    """A call to a listed function (the named one) with its required arguments; (name, arguments)."""
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    assert name in REQUIRED, name
    if isinstance(choice, dict):
        assert name == choice.get("function", choice).get("name", choice.get("name")), (name, choice)
    assert set(REQUIRED[name]) <= set(args), (name, args)
    return name, args


def _chat_call(url: str, choice: Any, stream: bool, **extra: Any) -> tuple[str, dict[str, Any]]:
    client = _openai(url)
    kwargs = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": choice, "max_tokens": 256,
              "extra_body": extra, **GREEDY}
    if not stream:
        resp = client.chat.completions.create(**kwargs)
        choice0 = resp.choices[0]
        assert choice0.finish_reason == "tool_calls" and not choice0.message.content, choice0
        calls = choice0.message.tool_calls
        assert len(calls) == 1, calls
        return _check_call(calls[0].function.name, calls[0].function.arguments, choice)
    name, arguments, finish, content = "", "", None, ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            assert call.index == 0, "one call"
            name += call.function.name or ""
            arguments += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and not content, (finish, content)
    return _check_call(name, arguments, choice)


@pytest.mark.parametrize("choice", CHOICES)
def test_chat_completions_required_and_named_yield_one_call(server: str, choice: str) -> None:
    calls = {stream: _chat_call(server, CHOICES[choice], stream) for stream in (False, True)}
    assert calls[False] == calls[True]
    for mode in ("ar", "spec", "diffusion"):  # lossless modes give the same call; diffusion decodes tools as auto
        assert _chat_call(server, CHOICES[choice], False, mode=mode) == calls[False], mode


def _responses_call(client: Any, choice: Any, **kwargs: Any) -> tuple[str, dict[str, Any]]:
    resp = client.responses.create(**kwargs)
    calls = [item for item in resp.output if item.type == "function_call"]
    assert len(calls) == 1, resp.output
    return _check_call(calls[0].name, calls[0].arguments, choice)


@pytest.mark.parametrize("mode", ["ar", "auto", "spec", "diffusion"])
def test_responses_api_function_calls(server: str, mode: str) -> None:
    """One call, streamed and not, in every lossless mode and in diffusion (a request with tools decodes as auto):
    the same call in each."""
    client = _openai(server)
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    for choice in ("required", {"type": "function", "name": "add"}):
        kwargs = {"model": MODEL, "input": ASK[0]["content"], "tools": tools, "tool_choice": choice,
                  "max_output_tokens": 256, "temperature": 0.0, "parallel_tool_calls": False,
                  "extra_body": {"mode": mode}}
        want = _responses_call(client, choice, **kwargs)
        if mode != "ar":
            assert want == _responses_call(client, choice, **{**kwargs, "extra_body": {"mode": "ar"}}), mode
        events = list(client.responses.create(stream=True, **kwargs))
        kinds = [e.type for e in events]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
        assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
        done = [e for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
        assert len(done) == 1 and (done[0].item.name, json.loads(done[0].item.arguments)) == want


def _anthropic_tool_use(client: Any, choice: dict[str, Any], **kwargs: Any) -> tuple[str, dict[str, Any]]:
    msg = client.messages.create(**kwargs)
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and len(uses) == 1, msg
    return _check_call(uses[0].name, uses[0].input, {"name": choice.get("name")} if "name" in choice else None)


@pytest.mark.parametrize("mode", ["ar", "auto", "spec", "diffusion"])
def test_anthropic_messages_tool_use(server: str, mode: str) -> None:
    """One tool_use, streamed (input_json_delta) and not, in every lossless mode and in diffusion: the same call in
    each."""
    import anthropic

    client = anthropic.Anthropic(base_url=server, api_key="none", max_retries=0, timeout=120)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    for choice in ({"type": "any", "disable_parallel_tool_use": True},
                   {"type": "tool", "name": "add", "disable_parallel_tool_use": True}):
        kwargs = {"model": MODEL, "max_tokens": 256, "messages": ASK, "tools": tools, "tool_choice": choice,
                  "extra_body": {"temperature": 0.0, "mode": mode}}  # this SDK has no temperature argument
        want = _anthropic_tool_use(client, choice, **kwargs)
        if mode != "ar":
            assert want == _anthropic_tool_use(client, choice, **{**kwargs, "extra_body": {"temperature": 0.0,
                                                                                         "mode": "ar"}}), mode
        with client.messages.stream(**kwargs) as stream:
            kinds = [e.type for e in stream]
            final = stream.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
        assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(kinds)
        assert "input_json" in kinds  # the SDK's event for each input_json_delta
        streamed = [b for b in final.content if b.type == "tool_use"]
        assert len(streamed) == 1 and (streamed[0].name, streamed[0].input) == want


@pytest.mark.parametrize("choice, fragment", [
    ({"type": "function", "function": {"name": "nope"}}, "'nope', which 'tools' does not list"),
    ({"type": "function", "function": {}}, "names no function"),
    ({"type": "other"}, "'tool_choice' must be"),
    ("sometimes", "Invalid tool_choice"),
])
def test_bad_tool_choice_is_a_400(server: str, choice: Any, fragment: str) -> None:
    status, _, body = http(server + "/v1/chat/completions", {"model": MODEL, "messages": ASK, "tools": TOOLS,
                                                             "tool_choice": choice, "max_tokens": 8})
    assert status == 400, body
    error = json.loads(body)["error"]
    assert fragment in error["message"] and error["type"] == "invalid_request_error", error


def test_anthropic_named_tool_that_is_not_listed_is_a_400(server: str) -> None:
    """A 400 in Anthropic's error shape, {"type": "error", "error": {"type", "message"}} (patch
    server-anthropic-error-body; llama-server's body had no "type": "error"), on create and count_tokens."""
    import anthropic

    client = anthropic.Anthropic(base_url=server, api_key="none", max_retries=0, timeout=60)
    with pytest.raises(anthropic.BadRequestError, match="'nope', which 'tools' does not list") as raised:
        client.messages.create(model=MODEL, max_tokens=8, messages=ASK, tool_choice={"type": "tool", "name": "nope"},
                               tools=[{"name": "add", "input_schema": {"type": "object"}}])
    body = raised.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        status, _, answer = http(server + path, {"model": MODEL, "max_tokens": 8}, timeout=60)
        body = json.loads(answer)
        assert status == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        assert "messages" in body["error"]["message"], body
