"""OpenAI request bodies (pydantic), the OpenAI error body, and the response/chunk builders.

Fields the engine cannot honour either get a 400 (``n`` above the server's slots, ``suffix``, ``best_of`` > 1)
or are accepted and ignored when OpenAI clients send them by default (``user``, ``parallel_tool_calls``,
``store``...). The penalties, ``logit_bias``, ``logprobs``, ``response_format`` and a forcing ``tool_choice``
are honoured (spec 4's distribution stage). llama-server's extras: ``top_k``, ``repeat_penalty``, ``grammar``,
``json_schema``, ``ignore_eos``, ``cache_prompt``, ``return_token_ids``. Clover's: ``mode``, ``block_size``,
``threshold``, ``coreset_top_p``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from clover_common.cli_runner import one_line

from ..gen_params import MODES, PARAMS
from ..model import Stats
from ..output_parser import ToolCall


def _bounded(name: str) -> Any:
    """An optional request field with its GenParams bound (gen_params.PARAMS, the one home of the ranges)."""
    bound = PARAMS[name].bound
    return Field(default=None, **(bound.pydantic() if bound else {}))


# ------------------------------------------------------------------------------------------ errors
class APIError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The OpenAI error body; the message on one line (a converter's or a template's reason may span several, and a
    request's own text may hold line breaks)."""
    def clean(text: str | None) -> str | None:  # a lone surrogate from the request must not break the answer
        return None if text is None else text.encode("utf-8", "replace").decode("utf-8")

    return {"error": {"message": clean(one_line(message)), "type": type, "param": clean(param), "code": code}}


def invalid(message: str, param: str | None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


# ------------------------------------------------------------------------------------------ requests
class _Lenient(BaseModel):
    """Unknown fields are ignored (clients add new ones), but the known ones are strict: ``"stream": "yes"``
    or ``"max_tokens": "8"`` is a 400, not read as true or 8 (an int is still a valid float)."""

    model_config = ConfigDict(extra="ignore", strict=True)


class FunctionCall(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDef(_Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Lenient):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(_Lenient):
    include_usage: bool = False


class ResponseFormat(_Lenient):
    type: str
    json_schema: dict[str, Any] | None = None  # type json_schema: {"name": ..., "schema": {...}, "strict": ...}
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # type json_object: llama-server's extra


class CloverFields(_Lenient):
    """Sampling, stopping and the clover extras shared by both endpoints."""

    model: str
    temperature: float | None = _bounded("temperature")
    top_p: float | None = _bounded("top_p")
    top_k: int | None = _bounded("top_k")
    seed: int | None = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = _bounded("presence_penalty")
    frequency_penalty: float | None = _bounded("frequency_penalty")
    repeat_penalty: float | None = _bounded("repeat_penalty")  # llama-server's; 1 = off
    logit_bias: dict[str, float] | None = None  # token id -> bias in [-100, 100]; -100 bans (OpenAI)
    grammar: str | None = None  # llama-server's: GBNF the answer must match
    json_schema: dict[str, Any] | None = None  # llama-server's: a JSON schema the answer must match
    user: str | None = None
    # clover extras
    mode: Literal[MODES] | None = None  # type: ignore[valid-type]
    block_size: int | None = _bounded("block_size")
    threshold: float | None = _bounded("threshold")
    coreset_top_p: float | None = _bounded("coreset_top_p")
    ignore_eos: bool = False
    return_token_ids: bool = False
    cache_prompt: bool = True  # llama-server's field: reuse the engine's history prefix (docs/serve.md)


class ChatCompletionRequest(CloverFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    # clover extension (docs/serve.md, "Web chat"): a streamed answer also carries each LowConfidence step's canvas
    clover_canvas: bool = False


class CompletionRequest(CloverFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    suffix: str | None = None
    best_of: int | None = None


# llama-server's utility endpoints (tools/server/README.md of the pinned llama.cpp: "POST /tokenize",
# "POST /detokenize", "POST /apply-template"), with its field names and defaults
class TokenizeRequest(_Lenient):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(_Lenient):
    tokens: list[int]


class ApplyTemplateRequest(_Lenient):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# ------------------------------------------------------------------------------------------ responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


FINISH_REASONS = {"eos": "stop", "length": "length", "context": "length", "cancelled": "stop"}


def finish_reason(stats: Stats | None, stopped_by_string: bool, has_tool_calls: bool) -> str:
    if has_tool_calls:
        return "tool_calls"
    if stopped_by_string or stats is None:
        return "stop"
    return FINISH_REASONS.get(stats.stop_reason, "stop")


def usage(prompt_tokens: int, stats: Stats | None, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI usage (``prompt_tokens_details.cached_tokens``: prompt tokens reused from the engine's history)
    plus ``clover``: the engine's statistics (mode, B, threshold, passes, TPF, timings)."""
    completion = stats.generated_tokens if stats is not None else 0
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
            "clover": stats.to_dict() if stats is not None else None}


def merged_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """The usage of n answers to one prompt: the prompt counted once (as OpenAI does), the completions summed, and
    ``clover`` the list of each answer's statistics (one answer: its usage unchanged)."""
    if len(usages) == 1:
        return usages[0]
    out = dict(usages[0])
    out["completion_tokens"] = sum(u["completion_tokens"] for u in usages)
    out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    out["clover"] = [u["clover"] for u in usages]
    return out


def tool_call_dict(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": call.id, "type": "function",
                           "function": {"name": call.name, "arguments": call.arguments}}
    if index is not None:
        out = {"index": index, **out}
    return out


def _stream_chunk(obj: str, cid: str, created: int, model: str, content: dict[str, Any] | None,
                  finish: str | None, extra_choice: dict[str, Any] | None,
                  usage_block: dict[str, Any] | None) -> dict[str, Any]:
    """One streamed chunk; ``content=None`` makes the usage-only chunk (empty choices)."""
    choices = [] if content is None else [{"index": 0, **content, "logprobs": None, "finish_reason": finish,
                                           **(extra_choice or {})}]
    out: dict[str, Any] = {"id": cid, "object": obj, "created": created, "model": model, "choices": choices}
    if usage_block is not None:
        out["usage"] = usage_block
    return out


def chat_chunk(cid: str, created: int, model: str, delta: dict[str, Any] | None,
               finish: str | None = None, extra_choice: dict[str, Any] | None = None,
               usage_block: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``chat.completion.chunk``; ``delta=None`` makes the usage-only chunk (empty choices)."""
    content = None if delta is None else {"delta": delta}
    return _stream_chunk("chat.completion.chunk", cid, created, model, content, finish, extra_choice, usage_block)


def completion_chunk(cid: str, created: int, model: str, text: str | None, finish: str | None = None,
                     extra_choice: dict[str, Any] | None = None,
                     usage_block: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``text_completion`` chunk; ``text=None`` makes the usage-only chunk (empty choices)."""
    content = None if text is None else {"text": text}
    return _stream_chunk("text_completion", cid, created, model, content, finish, extra_choice, usage_block)
