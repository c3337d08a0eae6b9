"""What the routes run on: the model, its job queue and the request preparer (``CloverService``), preparation off
the event loop within a time limit, and a queued job's course to the end of a whole (non-streamed) answer."""

from __future__ import annotations

import asyncio
import ctypes
import os
import threading
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, Callable, TypeVar

from fastapi import Request

from ..chat_template import ChatTemplate
from ..model import Model
from ..output_parser import Event, OutputParser
from ..text_stream import TextPipeline
from .metrics import Meter
from .prepare import Defaults, Prepared, Preparer
from .schema import APIError
from .security import Endpoints, Limits
from .worker import Canvas, EngineWorker, Job

DISCONNECT_POLL_S = 0.25
T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before a non-streaming answer was ready."""


class CloverService:
    """The model, its queue and the request preparer behind the routes."""

    def __init__(self, model: Model, template: ChatTemplate | None, model_id: str, max_block_size: int,
                 defaults: Defaults, limits: Limits | None = None, endpoints: Endpoints | None = None) -> None:
        """``endpoints``: llama-server's switches for /slots, /metrics and POST /props (monitor.py)."""
        self.model = model
        self.model_id = model_id
        self.limits = limits or Limits()
        self.worker = EngineWorker(model)
        self.meter = Meter(self.worker)  # counts each finished job (/metrics, /slots)
        self.endpoints = endpoints or Endpoints()
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
            try:
                return await run_with_timeout(fn, self.limits.template_timeout_s)
            except RecursionError:  # a field the JSON parser read, nested deeper than the thread's Python can walk
                raise APIError(400, "The request nests too deeply to process.", code="invalid_value") from None

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
        except BaseException as exc:
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


async def _watch_disconnect(job: Job, request: Request) -> bool:
    """Poll the connection while the job runs; cancel the job and return True when the client has left."""
    while not job.finished:
        if await request.is_disconnected():
            job.cancel()
            return True
        await asyncio.sleep(DISCONNECT_POLL_S)
    return False


async def event_batches(job: Job, pipeline: TextPipeline, tokens: list[int]
                        ) -> AsyncIterator[list[Event] | list[Canvas]]:
    """The pipeline's events for each commit, then its final flush. Appends every generated token to ``tokens``;
    once the pipeline has stopped (a stop sequence), cancels the job and waits for it. A job submitted with
    ``canvas=True`` also gives its step canvases, each alone in a batch, outside the pipeline."""
    while (chunk := await job.next_chunk()) is not None:
        if isinstance(chunk, Canvas):
            yield [chunk]
            continue
        tokens += chunk
        yield pipeline.feed(chunk)
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
        async with aclosing(event_batches(job, pipeline, tokens)) as batches:
            async for batch in batches:
                events += batch
    finally:
        job.cancel()
        if not watcher.done():
            watcher.cancel()
    if not watcher.cancelled() and watcher.done() and watcher.result():
        raise ClientGone
    return events, tokens


async def run_to_end(svc: CloverService, prep: Prepared, request: Request, chat: bool
                      ) -> tuple[Job, TextPipeline, list[Event], list[int]] | None:
    """Queue a non-streaming request and wait for it; None when the client disconnected (job cancelled)."""
    job = svc.worker.submit(prep.prompt_ids, prep.params, prep.checkpoint_hint, prep.cache_prompt)
    pipeline = svc.pipeline(prep, chat=chat)
    try:
        events, tokens = await _collect(job, pipeline, request)
    except ClientGone:
        return None
    raise_job_error(job)
    return job, pipeline, events, tokens


def raise_job_error(job: Job) -> None:
    if job.error is not None:
        exc = job.error
        if isinstance(exc, ValueError):
            raise APIError(400, str(exc))
        raise APIError(500, f"generation failed: {exc}", type="server_error", code="engine_error")
