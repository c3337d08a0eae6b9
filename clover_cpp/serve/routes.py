"""The HTTP routes: ``GET /health``, ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (streamed or whole), llama-server's ``POST /tokenize``, ``/detokenize`` and
``/apply-template``, its ``/props``, ``/slots`` and ``/metrics`` (monitor.py),
and every error as an OpenAI error body."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..output_parser import Event, TextEvent, collect
from ..text_stream import TextPipeline
from .prepare import Prepared, answers
from . import monitor, utility
from .logprobs import chat_logprobs, completion_logprobs
from .schema import (APIError, ApplyTemplateRequest, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                     TokenizeRequest, error_body, finish_reason, merged_usage, new_id, now, tool_call_dict, usage)
from .security import Guard, Security
from .service import CloverService, run_to_end
from .streaming import ChatChunks, CompletionChunks, streamer
from .worker import Job

log = logging.getLogger("clover_cpp.serve")


async def _respond(svc: CloverService, request: Request, prepare: Callable[[], Prepared], chat: bool,
                   stream: Callable[[Prepared], AsyncIterator[dict[str, str]]] | None,
                   body: Callable[[Prepared, tuple[Job, TextPipeline, list[Event], list[int]]], dict[str, Any]]
                   ) -> Any:
    """One request's course: the queue check (before and after preparing, which runs off the event loop), then a
    stream of events, or the whole answer as one body."""
    svc.check_queue()
    prep = await svc.run_prepare(prepare)
    svc.check_queue()
    if stream is not None:
        return EventSourceResponse(stream(prep), sep="\n", ping=15)
    preps = answers(prep)  # n answers at once, one per slot (llama-server's n, up to its slots)
    tasks = [asyncio.ensure_future(run_to_end(svc, p, request, chat=chat)) for p in preps]
    try:
        runs = await asyncio.gather(*tasks)
    except BaseException:  # one answer failed (a dead end, say): the others' jobs stop too, freeing their slots
        for task in tasks:
            task.cancel()
        raise
    if any(done is None for done in runs):
        return Response(status_code=499)  # the client is gone; nobody reads this
    return _merge([body(p, done) for p, done in zip(preps, runs) if done is not None])


def _merge(bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """The answers of n > 1 as one body: their choices, indexed in order, and their usage summed (the prompt
    counted once, as OpenAI does)."""
    first = bodies[0]
    first["choices"] = [dict(b["choices"][0], index=i) for i, b in enumerate(bodies)]
    first["usage"] = merged_usage([b["usage"] for b in bodies])
    return first


def _answer(svc: CloverService, req: Any, prep: Prepared, job: Job, tokens: list[int], kind: str,
            choice: dict[str, Any]) -> dict[str, Any]:
    """A whole (non-streamed) answer of ``kind`` (chat.completion, text_completion) around its one choice."""
    body: dict[str, Any] = {"id": new_id("chatcmpl" if kind == "chat.completion" else "cmpl"), "object": kind,
                            "created": now(), "model": svc.model_id, "choices": [choice],
                            "usage": usage(len(prep.prompt_ids), job.stats, job.cached_tokens)}
    if req.return_token_ids:
        choice["token_ids"] = tokens
        body["prompt_token_ids"] = prep.prompt_ids
    return body


async def completion(svc: CloverService, req: ChatCompletionRequest | CompletionRequest, request: Request) -> Any:
    """/v1/chat/completions (a ChatCompletionRequest) and /v1/completions (a CompletionRequest)."""
    if isinstance(req, ChatCompletionRequest):
        return await _respond(svc, request, lambda: svc.prepare.chat(req), chat=True,
                              stream=streamer(svc, req, True, ChatChunks) if req.stream else None,
                              body=lambda prep, done: _chat_body(svc, req, prep, *done))
    return await _respond(svc, request, lambda: svc.prepare.completion(req), chat=False,
                          stream=streamer(svc, req, False, CompletionChunks) if req.stream else None,
                          body=lambda prep, done: _completion_body(svc, req, prep, *done))


def _chat_body(svc: CloverService, req: ChatCompletionRequest, prep: Prepared, job: Job, pipeline: TextPipeline,
               events: list[Event], tokens: list[int]) -> dict[str, Any]:
    parsed = collect(events)
    message: dict[str, Any] = {"role": "assistant",
                               "content": parsed.content if parsed.content or not parsed.tool_calls else None}
    if parsed.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = [tool_call_dict(c) for c in parsed.tool_calls]
    lps = chat_logprobs(svc.model, job.logprobs[:len(tokens)]) if prep.params.logprobs is not None else None
    choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": lps,
                              "finish_reason": finish_reason(job.stats, pipeline.stopped, bool(parsed.tool_calls))}
    return _answer(svc, req, prep, job, tokens, "chat.completion", choice)


def _completion_body(svc: CloverService, req: CompletionRequest, prep: Prepared, job: Job, pipeline: TextPipeline,
                     events: list[Event], tokens: list[int]) -> dict[str, Any]:
    text = prep.echo_text + "".join(e.text for e in events if isinstance(e, TextEvent))
    lps = (completion_logprobs(svc.model, job.logprobs[:len(tokens)], len(prep.echo_text))
           if prep.params.logprobs is not None else None)
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": lps,
                              "finish_reason": finish_reason(job.stats, pipeline.stopped, False)}
    return _answer(svc, req, prep, job, tokens, "text_completion", choice)


def _unreadable_body(cause: BaseException) -> str:
    """Why json.loads refused a body other than for its syntax (that is a RequestValidationError): nesting deeper
    than Python's recursion limit, an integer longer than CPython converts, bytes that are no Unicode text."""
    if isinstance(cause, RecursionError):
        reason = "it nests too deeply (about 1,000 levels at most)"
    elif isinstance(cause, UnicodeDecodeError):
        reason = f"it is not UTF-8 text (byte {cause.start})"
    elif isinstance(cause, ValueError) and "digits" in str(cause):
        reason = f"it holds an integer of more than {sys.get_int_max_str_digits()} digits"
    else:
        reason = str(cause)
    return f"We could not parse the JSON body of your request: {reason}."


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    kind = first.get("type", "")
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if kind == "json_invalid":  # FastAPI's loc: ("body", the character where json.loads stopped)
        reason = str((first.get("ctx") or {}).get("error") or first.get("msg", "")).removesuffix(" at")
        where = f" at character {loc[0]}" if loc else ""
        return APIError(400, f"We could not parse the JSON body of your request: {reason}{where}.",
                        code="invalid_json")
    if not loc:
        return APIError(400, "The request body must be a JSON object (Content-Type: application/json).",
                        code="missing_body" if kind == "missing" else "invalid_type")
    common = loc
    for err in errors[1:]:  # a union reports one error per member, tagged by the member's type: cut the tags
        other = [str(x) for x in err.get("loc", ()) if x != "body"]
        n = 0
        while n < min(len(common), len(other)) and common[n] == other[n]:
            n += 1
        common = common[:n]
    param = ".".join(common or loc)
    code = "missing_required_parameter" if kind == "missing" else (
        "invalid_type" if kind.endswith("_type") or kind in ("model_attributes_type",) else "invalid_value")
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return APIError(400, f"Invalid value for '{param}': {_reason(first)}{more}.", param=param, code=code)


# pydantic's range errors, whose message writes a float bound in full (3.4e38 as 39 digits)
RANGE_WORDS = {"greater_than": ("gt", "greater than"), "greater_than_equal": ("ge", "greater than or equal to"),
               "less_than": ("lt", "less than"), "less_than_equal": ("le", "less than or equal to")}


def _reason(error: dict[str, Any]) -> str:
    kind, ctx = error.get("type", ""), error.get("ctx") or {}
    if kind in RANGE_WORDS and RANGE_WORDS[kind][0] in ctx:
        key, words = RANGE_WORDS[kind]
        limit = ctx[key]
        return f"Input should be {words} {limit if isinstance(limit, int) else format(limit, '.9g')}"
    return str(error.get("msg", "invalid"))


def create_app(svc: CloverService, security: Security | None = None) -> Any:
    """The FastAPI app behind the Guard middleware (Host check, API keys, body size). The web chat moved to
    `clover-cpp serve` (llama-server, clover_cpp/webui/)."""
    return Guard(_routes(svc), security or Security(), svc.limits.max_body_bytes)


def _routes(svc: CloverService) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        svc.worker.shutdown()

    app = FastAPI(title="clover-cpp", description="OpenAI-compatible server for Clover block-diffusion models",
                  lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def _api_error(_r: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_r: Request, exc: RequestValidationError) -> JSONResponse:
        err = _validation_error(exc)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            msg, code = f"Unknown endpoint: {request.method} {request.url.path}", "not_found"
        elif exc.status_code == 405:
            msg, code = f"Method {request.method} is not allowed on {request.url.path}", "method_not_allowed"
        elif exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI: json.loads failed, not as a syntax error
            msg, code = _unreadable_body(exc.__cause__), "invalid_json"
        else:
            msg, code = str(exc.detail), None
        return JSONResponse(error_body(msg, "invalid_request_error", None, code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(_r: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed")
        return JSONResponse(error_body(f"internal error: {exc}", "server_error", None, "internal_error"),
                            status_code=500)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": svc.model_id, **svc.worker.health()}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [svc.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        svc.prepare.check_model(model_id)
        return svc.model_card()

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request) -> Any:
        return await completion(svc, req, request)

    @app.post("/v1/completions")
    async def complete(req: CompletionRequest, request: Request) -> Any:
        return await completion(svc, req, request)

    # llama-server's utility endpoints: off the event loop, within --template-timeout, as a request's preparation
    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        return await svc.run_prepare(lambda: utility.tokenize(svc.model, svc.prepare, req))

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        return await svc.run_prepare(lambda: utility.detokenize(svc.model, req))

    @app.post("/apply-template")
    async def apply_template(req: ApplyTemplateRequest) -> dict[str, Any]:
        return await svc.run_prepare(lambda: utility.apply_template(svc.prepare, req))

    monitor.add_routes(app, svc)  # llama-server's GET/POST /props, GET /slots, GET /metrics
    return app
