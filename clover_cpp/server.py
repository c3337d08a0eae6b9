"""`clover-cpp serve`: an OpenAI-compatible HTTP server on the native engine (FastAPI + uvicorn + SSE).

Endpoints: ``GET /health``, ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (streaming with sse-starlette, or not). Requests queue on the one engine
(``worker.EngineWorker``); a client that disconnects cancels its generation, queued or running. Every
error is an OpenAI error body; nothing a client sends stops the server. See docs/serve.md.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import hmac
import ipaddress
import json
import logging
import os
import socket
import sys
import threading
from dataclasses import dataclass
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any, Callable, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from clover_common.errors import BadInput

from .chat_template import ChatTemplate, load_template
from .model import EngineError, Model
from .openai_schema import (APIError, ChatCompletionRequest, CompletionRequest, chat_chunk, completion_chunk,
                            error_body, finish_reason, new_id, now, tool_call_dict, usage)
from .output_parser import Event, OutputParser, TextEvent, ToolCallEvent, collect
from .prepare import Defaults, Prepared, Preparer
from .text_stream import TextPipeline
from .worker import EngineWorker, Job

log = logging.getLogger("clover_cpp.server")
DISCONNECT_POLL_S = 0.25
T = TypeVar("T")


@dataclass(frozen=True)
class Limits:
    """What one request may cost before the engine sees it (docs/serve.md, "Limits"); 0 = no limit."""

    max_body_bytes: int = 8 * 2**20      # --max-body-bytes: 413
    max_messages: int = 1024             # --max-messages: 400
    max_prompt_chars: int = 0            # --max-prompt-chars (0: 64 x n_ctx): 400, checked before tokenizing
    max_queue: int = 64                  # --max-queue: waiting jobs; 429 beyond
    template_timeout_s: float = 10.0     # --template-timeout: rendering + tokenizing one request
    prepare_threads: int = 2             # requests rendered/tokenized at once (more wait for a turn)


@dataclass(frozen=True)
class Security:
    """--api-key/--api-key-file, and the Host names a loopback-bound server answers (DNS rebinding)."""

    api_keys: tuple[str, ...] = ()
    allowed_hosts: frozenset[str] | None = None  # None: any Host header (not bound to loopback)


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def loopback_hosts(host: str, port: int) -> frozenset[str] | None:
    """The Host headers a server bound to loopback answers: its names with the port (and without it on port
    80). A page on another site that rebinds its DNS name to 127.0.0.1 still sends its own name, and gets a 403.
    None (any Host) when the server is not bound to loopback."""
    if not is_loopback(host):
        return None
    names = set(LOOPBACK_NAMES) | {host.lower() if ":" not in host else f"[{host.strip('[]')}]"}
    return frozenset({f"{n}:{port}" for n in names} | (names if port == 80 else set()))


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


async def _send_error(send: Callable[..., Any], status: int, body: dict[str, Any],
                      headers: list[tuple[bytes, bytes]] | None = None) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": data})


class Guard:
    """ASGI middleware in front of every route: the Host check (loopback binds), the API keys (every path
    but /health), and the body size limit (413), before FastAPI reads or parses anything."""

    def __init__(self, app: Any, security: Security, max_body_bytes: int) -> None:
        self.app = app
        self.security = security
        self.max_body_bytes = max_body_bytes
        self._keys = [k.encode() for k in security.api_keys]

    def _key_ok(self, scope: dict[str, Any]) -> bool:
        auth = _header(scope, b"authorization") or ""
        scheme, _, token = auth.partition(" ")
        given = token.strip() if scheme.lower() == "bearer" else (_header(scope, b"x-api-key") or "")
        given_b = given.encode("latin-1", "replace")
        ok = False
        for key in self._keys:  # every key is compared, in constant time
            ok |= hmac.compare_digest(given_b, key)
        return ok

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        allowed = self.security.allowed_hosts
        host = _header(scope, b"host")
        if allowed is not None and host is not None and host.lower() not in allowed:
            await _send_error(send, 403, error_body(
                f"Host '{host}' is not this server's: a server bound to loopback answers only "
                f"{', '.join(sorted(h for h in allowed if ':' in h))} (a DNS rebinding guard; bind another "
                "--host to serve other names)", "invalid_request_error", None, "forbidden_host"))
            return
        path = scope.get("path", "")
        if self._keys and path != "/health" and not self._key_ok(scope):  # /v1/... and any other path
            await _send_error(send, 401, error_body(
                "Invalid or missing API key: send 'Authorization: Bearer KEY' with one of the server's "
                "--api-key keys.", "invalid_request_error", None, "invalid_api_key"),
                [(b"www-authenticate", b'Bearer realm="clover-cpp"')])
            return
        limit = self.max_body_bytes
        if limit and scope.get("method") in ("POST", "PUT", "PATCH"):
            too_large = error_body(f"The request body exceeds {limit} bytes (the limit; start the server with "
                                   "--max-body-bytes to change it).", "invalid_request_error", None,
                                   "request_too_large")
            length = _header(scope, b"content-length")
            if length is not None and length.strip().isdigit() and int(length) > limit:
                await _send_error(send, 413, too_large)
                return
            chunks, size = [], 0
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    break
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                if size > limit:
                    await _send_error(send, 413, too_large)
                    return
                if not message.get("more_body", False):
                    break
            body = b"".join(chunks)
            replayed = False

            async def replay() -> dict[str, Any]:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            await self.app(scope, replay, send)
            return
        await self.app(scope, receive, send)


class ClientGone(Exception):
    """The client disconnected before a non-streaming answer was ready."""


class CloverService:
    """The model, its queue and the request preparer behind the routes."""

    def __init__(self, model: Model, template: ChatTemplate | None, model_id: str, max_block_size: int,
                 defaults: Defaults, limits: Limits | None = None) -> None:
        self.model = model
        self.model_id = model_id
        self.limits = limits or Limits()
        self.worker = EngineWorker(model)
        prompt_chars = self.limits.max_prompt_chars or 64 * model.n_ctx
        self.prepare = Preparer(model, template, model_id, max_block_size, defaults,
                                max_messages=self.limits.max_messages, max_prompt_chars=prompt_chars)
        self._prepare_slots: asyncio.Semaphore | None = None
        self.max_block_size = max_block_size
        self.created = int(os.path.getmtime(model.path)) if os.path.exists(model.path) else 0

    def model_card(self) -> dict[str, Any]:
        info = self.model.info
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "clover-cpp",
                "clover": {"n_ctx": self.model.n_ctx, "max_block_size": self.max_block_size,
                           "block_size": info.block_size, "threshold": info.threshold,
                           "calibrated_block_sizes": list(info.calibrated_block_sizes),
                           "calibrated_thresholds": list(info.calibrated_thresholds),
                           "mask_token_id": info.mask_token_id, "n_vocab": info.n_vocab}}

    def check_queue(self) -> None:
        """429 when --max-queue jobs already wait for the engine."""
        limit = self.limits.max_queue
        if limit and self.worker.waiting >= limit:
            raise APIError(429, f"The server is busy: {self.worker.waiting} requests are already waiting for the "
                           f"engine (the limit is {limit}; start the server with --max-queue to change it). "
                           "Retry later.", type="rate_limit_error", code="queue_full")

    async def run_prepare(self, fn: Callable[[], T]) -> T:
        """Render and tokenize off the event loop (``/health`` and other requests stay answered), at most
        ``prepare_threads`` at once, each within --template-timeout."""
        if self._prepare_slots is None:
            self._prepare_slots = asyncio.Semaphore(self.limits.prepare_threads)
        async with self._prepare_slots:
            return await run_with_timeout(fn, self.limits.template_timeout_s)

    def pipeline(self, prep: Prepared, chat: bool) -> TextPipeline:
        parser = OutputParser(prep.start_in_reasoning, prep.parse_tools) if chat else None
        return TextPipeline(lambda ids: self.model.detokenize(ids, special=False), prep.stops, parser)


class _Abandoned(BaseException):
    """Raised inside a preparation thread that ran past its time limit (see run_with_timeout)."""


async def run_with_timeout(fn: Callable[[], T], timeout_s: float) -> T:
    """``fn()`` on a fresh daemon thread; past ``timeout_s`` a 400 ``timeout`` is raised here, and the thread is
    stopped by an asynchronous exception at its next Python instruction (a template's loop is Python code). A
    thread stuck in native code finishes on its own; being a daemon, it never holds up the exit."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()
    lock = threading.Lock()
    state = {"done": False}

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            (future.set_result if ok else future.set_exception)(value)

    def run() -> None:
        try:
            try:
                result = fn()
            finally:
                with lock:
                    state["done"] = True
            outcome: tuple[bool, Any] = (True, result)
        except _Abandoned:
            return
        except BaseException as exc:  # noqa: BLE001 - handed to the request
            outcome = (False, exc)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop is closed (shutdown)
            pass

    thread = threading.Thread(target=run, name="clover-prepare", daemon=True)
    thread.start()
    try:
        return await asyncio.wait_for(asyncio.shield(future), timeout_s) if timeout_s > 0 else await future
    except (TimeoutError, asyncio.TimeoutError):
        with lock:
            if not state["done"] and thread.ident is not None:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(_Abandoned))
        raise APIError(400, f"Preparing this request (chat template and tokenization) took longer than {timeout_s:g} s "
                       "(the limit; start the server with --template-timeout to change it).", code="timeout") from None


# ---------------------------------------------------------------------------------------------- running jobs
async def _watch_disconnect(job: Job, request: Request) -> bool:
    """Poll the connection while the job runs; cancel the job and return True when the client has left."""
    while not job.finished:
        if await request.is_disconnected():
            job.cancel()
            return True
        await asyncio.sleep(DISCONNECT_POLL_S)
    return False


async def _event_batches(job: Job, pipeline: TextPipeline, tokens: list[int]) -> AsyncIterator[list[Event]]:
    """The pipeline's events for each generated block, then its final flush. Appends every generated token
    to ``tokens``; once the pipeline has stopped (a stop sequence), cancels the job and waits for it."""
    while (block := await job.next_block()) is not None:
        tokens += block
        yield pipeline.feed(block)
        if pipeline.stopped:
            job.cancel()
            await job.wait()
            break
    yield pipeline.finish()


async def _collect(job: Job, pipeline: TextPipeline, request: Request) -> tuple[list[Event], list[int]]:
    """Run a job to its end for a non-streaming answer: all events and all generated tokens. Raises
    ClientGone when the client disconnected meanwhile (the job is cancelled then)."""
    events: list[Event] = []
    tokens: list[int] = []
    watcher = asyncio.ensure_future(_watch_disconnect(job, request))
    try:
        async with aclosing(_event_batches(job, pipeline, tokens)) as batches:
            async for batch in batches:
                events += batch
    finally:
        job.cancel()
        if not watcher.done():
            watcher.cancel()
    if not watcher.cancelled() and watcher.done() and watcher.result():
        raise ClientGone
    return events, tokens


async def _run_to_end(svc: CloverService, prep: Prepared, request: Request, chat: bool
                      ) -> tuple[Job, TextPipeline, list[Event], list[int]] | None:
    """Queue a non-streaming request and wait for it; None when the client disconnected (job cancelled)."""
    job = svc.worker.submit(prep.prompt_ids, prep.params, prep.checkpoint_hint)
    pipeline = svc.pipeline(prep, chat=chat)
    try:
        events, tokens = await _collect(job, pipeline, request)
    except ClientGone:
        return None
    _raise_job_error(job)
    return job, pipeline, events, tokens


def _raise_job_error(job: Job) -> None:
    if job.error is not None:
        exc = job.error
        if isinstance(exc, ValueError):
            raise APIError(400, str(exc))
        raise APIError(500, f"generation failed: {exc}", type="server_error", code="engine_error")


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
    done = await _run_to_end(svc, prep, request, chat=chat)
    if done is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return body(prep, done)


def _sse(payload: dict[str, Any] | str) -> dict[str, str]:
    return {"data": payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}


def _job_error_body(job: Job) -> dict[str, Any]:
    try:
        _raise_job_error(job)
    except APIError as err:
        return err.body()
    return error_body("generation failed", "server_error")


# ---------------------------------------------------------------------------------------------- streams
class _ChatChunks:
    """The chunks of a streamed chat completion (chat.completion.chunk): deltas of content, reasoning and
    tool calls."""

    def __init__(self, svc: CloverService, req: ChatCompletionRequest, prep: Prepared) -> None:
        self.cid, self.created, self.model = new_id("chatcmpl"), now(), svc.model_id
        self.req, self.prep, self.n_calls = req, prep, 0

    def chunk(self, delta: dict[str, Any] | None, finish: str | None = None, extra: dict[str, Any] | None = None,
              usage_block: dict[str, Any] | None = None) -> dict[str, str]:
        return _sse(chat_chunk(self.cid, self.created, self.model, delta, finish, extra, usage_block))

    def opening(self) -> list[dict[str, str]]:
        first = {"prompt_token_ids": self.prep.prompt_ids} if self.req.return_token_ids else None
        return [self.chunk({"role": "assistant", "content": ""}, extra=first)]

    def events(self, events: list[Event]) -> list[dict[str, str]]:
        out = []
        for ev in events:
            if isinstance(ev, ToolCallEvent):
                out.append(self.chunk({"tool_calls": [tool_call_dict(ev.call, self.n_calls)]}))
                self.n_calls += 1
            elif ev.channel == "reasoning":
                out.append(self.chunk({"reasoning_content": ev.text}))
            else:
                out.append(self.chunk({"content": ev.text}))
        return out

    def finish(self, job: Job, pipeline: TextPipeline, tokens: list[int]) -> dict[str, str]:
        extra = {"token_ids": tokens} if self.req.return_token_ids else None
        return self.chunk({}, finish_reason(job.stats, pipeline.stopped, self.n_calls > 0), extra)

    def usage(self, block: dict[str, Any]) -> dict[str, str]:
        return self.chunk(None, usage_block=block)


class _CompletionChunks:
    """The chunks of a streamed text completion (text_completion)."""

    def __init__(self, svc: CloverService, req: CompletionRequest, prep: Prepared) -> None:
        self.cid, self.created, self.model = new_id("cmpl"), now(), svc.model_id
        self.req, self.prep = req, prep

    def chunk(self, text: str | None, finish: str | None = None, extra: dict[str, Any] | None = None,
              usage_block: dict[str, Any] | None = None) -> dict[str, str]:
        return _sse(completion_chunk(self.cid, self.created, self.model, text, finish, extra, usage_block))

    def opening(self) -> list[dict[str, str]]:
        return [self.chunk(self.prep.echo_text)] if self.prep.echo_text else []

    def events(self, events: list[Event]) -> list[dict[str, str]]:
        return [self.chunk(ev.text) for ev in events if isinstance(ev, TextEvent)]

    def finish(self, job: Job, pipeline: TextPipeline, tokens: list[int]) -> dict[str, str]:
        extra = {"token_ids": tokens, "prompt_token_ids": self.prep.prompt_ids} if self.req.return_token_ids else None
        return self.chunk("", finish_reason(job.stats, pipeline.stopped, False), extra)

    def usage(self, block: dict[str, Any]) -> dict[str, str]:
        return self.chunk(None, usage_block=block)


async def _stream(svc: CloverService, prep: Prepared, chat: bool, include_usage: bool,
                  chunks: _ChatChunks | _CompletionChunks) -> AsyncIterator[dict[str, str]]:
    """A streamed answer: queued when the stream starts (not before), events as they come, then the finish
    chunk, the usage chunk when asked for, and [DONE]; an engine error ends the stream with an error body."""
    job = svc.worker.submit(prep.prompt_ids, prep.params, prep.checkpoint_hint)
    pipeline = svc.pipeline(prep, chat=chat)
    tokens: list[int] = []
    try:
        for c in chunks.opening():
            yield c
        async with aclosing(_event_batches(job, pipeline, tokens)) as batches:
            async for batch in batches:
                for c in chunks.events(batch):
                    yield c
        if job.error is not None:
            yield _sse(_job_error_body(job))
            return
        yield chunks.finish(job, pipeline, tokens)
        if include_usage:
            yield chunks.usage(usage(len(prep.prompt_ids), job.stats, job.cached_tokens))
        yield _sse("[DONE]")
    finally:
        job.cancel()  # a disconnect lands here (the task is cancelled): stop the engine


def _streamer(svc: CloverService, req: Any, chat: bool, chunks: Callable[..., _ChatChunks | _CompletionChunks]
              ) -> Callable[[Prepared], AsyncIterator[dict[str, str]]]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return lambda prep: _stream(svc, prep, chat, include_usage, chunks(svc, req, prep))


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


# ---------------------------------------------------------------------------------------------- endpoints
async def completion(svc: CloverService, req: ChatCompletionRequest | CompletionRequest, request: Request) -> Any:
    """/v1/chat/completions (a ChatCompletionRequest) and /v1/completions (a CompletionRequest)."""
    if isinstance(req, ChatCompletionRequest):
        return await _respond(svc, request, lambda: svc.prepare.chat(req), chat=True,
                              stream=_streamer(svc, req, True, _ChatChunks) if req.stream else None,
                              body=lambda prep, done: _chat_body(svc, req, prep, *done))
    return await _respond(svc, request, lambda: svc.prepare.completion(req), chat=False,
                          stream=_streamer(svc, req, False, _CompletionChunks) if req.stream else None,
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
    choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None,
                              "finish_reason": finish_reason(job.stats, pipeline.stopped, bool(parsed.tool_calls))}
    return _answer(svc, req, prep, job, tokens, "chat.completion", choice)


def _completion_body(svc: CloverService, req: CompletionRequest, prep: Prepared, job: Job, pipeline: TextPipeline,
                     events: list[Event], tokens: list[int]) -> dict[str, Any]:
    text = prep.echo_text + "".join(e.text for e in events if isinstance(e, TextEvent))
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None,
                              "finish_reason": finish_reason(job.stats, pipeline.stopped, False)}
    return _answer(svc, req, prep, job, tokens, "text_completion", choice)


# ---------------------------------------------------------------------------------------------- the app
def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    kind = first.get("type", "")
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if kind == "json_invalid":
        return APIError(400, f"We could not parse the JSON body of your request: {first.get('msg', '')}.",
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
    return APIError(400, f"Invalid value for '{param}': {first.get('msg', 'invalid')}{more}.", param=param,
                    code=code)


def create_app(svc: CloverService, security: Security | None = None) -> Any:
    """The FastAPI app behind the Guard middleware (Host check, API keys, body size)."""
    app = _routes(svc)
    return Guard(app, security or Security(), svc.limits.max_body_bytes)


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

    return app


# ---------------------------------------------------------------------------------------------- command line
def _bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise BadInput(f"--host {host}: {exc.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise BadInput(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .cli import model_kwargs

    # prefix reuse (docs/serve.md): Model shares the --cache-ram budget among the slots
    model = Model(args.model, **model_kwargs(args), n_parallel=args.parallel, cache_ram_mib=args.cache_ram,
                  checkpoint_every=args.checkpoint_every)
    try:
        template = load_template(model.llama_model, args.model, args.chat_template)
        max_block = model.max_block_size  # the engine's resolution of --max-block-size
        if args.block_size is not None and args.block_size > max_block:
            raise BadInput(f"--block-size {args.block_size} exceeds --max-block-size {max_block}")
        model_id = args.alias or Path(args.model).name.removesuffix(".gguf")
        defaults = Defaults(mode=args.mode, block_size=args.block_size, threshold=args.threshold,
                            coreset_top_p=args.coreset_top_p, temperature=args.temperature,
                            enable_thinking=args.think == "on",
                            max_tokens=args.max_tokens, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
        limits = Limits(max_body_bytes=args.max_body_bytes, max_messages=args.max_messages,
                        max_prompt_chars=args.max_prompt_chars, max_queue=args.max_queue,
                        template_timeout_s=args.template_timeout)
        svc = CloverService(model, template, model_id, max_block, defaults, limits)
        try:  # auto mode's cost table, now that the history is empty: measured by the first auto request
            model.measure_pass_costs()  # instead, it needs free positions a long prompt may not leave (a 500)
        except (ValueError, EngineError) as exc:
            print(f"clover-cpp serve: warning: auto mode's pass costs could not be measured ({exc})", file=sys.stderr,
                  flush=True)
        sock = _bind(args.host, args.port)
        host, port = sock.getsockname()[:2]
        security = Security(api_keys=tuple(args.api_key), allowed_hosts=loopback_hosts(args.host, port))
        shown = f"[{host}]" if ":" in host else host
        print(f"clover-cpp serve: {model_id} (n_ctx {model.n_ctx}, B {model.info.block_size}, mode {args.mode}) "
              f"listening on http://{shown}:{port}", file=sys.stderr, flush=True)
        if template is None:
            print("clover-cpp serve: warning: the model has no chat template; /v1/chat/completions answers 400",
                  file=sys.stderr, flush=True)
        if not args.api_key and security.allowed_hosts is None:
            print(f"clover-cpp serve: warning: listening on {args.host} without --api-key: anyone who can reach this "
                  "port can use the model (docs/serve.md, \"Security\")", file=sys.stderr, flush=True)
        config = uvicorn.Config(create_app(svc, security), log_level=args.log_level,
                                access_log=args.log_level in ("info", "debug"), timeout_graceful_shutdown=3)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        model.close()
    return 0
