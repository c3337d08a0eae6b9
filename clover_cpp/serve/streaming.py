"""Streamed answers (server-sent events): the chunks of a chat completion (content, reasoning and tool-call deltas)
and of a text completion, a job's events as they come, and the finish, usage and [DONE] chunks."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, Callable

from ..model import TokenLogprob
from ..output_parser import Event, TextEvent, ToolCallEvent
from ..text_stream import TextPipeline
from .logprobs import chat_logprobs, completion_logprobs
from .prepare import Prepared, answers
from .schema import (APIError, ChatCompletionRequest, CompletionRequest, chat_chunk, completion_chunk, error_body,
                     finish_reason, merged_usage, new_id, now, tool_call_dict, usage)
from .service import CloverService, event_batches, raise_job_error
from .worker import Canvas, Job


def _sse(payload: dict[str, Any] | str) -> dict[str, str]:
    return {"data": payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}


def _job_error_body(job: Job) -> dict[str, Any]:
    try:
        raise_job_error(job)
    except APIError as err:
        return err.body()
    return error_body("generation failed", "server_error")


class _AnswerChunks:
    """What the chunks of one streamed answer share: the response's id and time, the choice's index (n > 1), and
    the logprobs of tokens whose text no chunk has carried yet."""

    def __init__(self, svc: CloverService, prep: Prepared, id_prefix: str) -> None:
        self.cid, self.created, self.model = new_id(id_prefix), now(), svc.model_id
        self.svc, self.prep = svc, prep
        self.index = 0
        self.pending: list[TokenLogprob] = []

    def _choice_extra(self, extra: dict[str, Any] | None) -> dict[str, Any] | None:
        """A choice's extra fields, with its index when it is not the first answer's."""
        return {**(extra or {}), "index": self.index} if self.index else extra

    def _take_pending(self) -> list[TokenLogprob]:
        entries, self.pending = self.pending, []
        return entries


class ChatChunks(_AnswerChunks):
    """The chunks of a streamed chat completion (chat.completion.chunk): deltas of content, reasoning and
    tool calls."""

    def __init__(self, svc: CloverService, req: ChatCompletionRequest, prep: Prepared) -> None:
        super().__init__(svc, prep, "chatcmpl")
        self.req, self.n_calls = req, 0

    def chunk(self, delta: dict[str, Any] | None, finish: str | None = None, extra: dict[str, Any] | None = None,
              usage_block: dict[str, Any] | None = None) -> dict[str, str]:
        return _sse(chat_chunk(self.cid, self.created, self.model, delta, finish, self._choice_extra(extra),
                               usage_block))

    def opening(self) -> list[dict[str, str]]:
        first = {"prompt_token_ids": self.prep.prompt_ids} if self.req.return_token_ids else None
        return [self.chunk({"role": "assistant", "content": ""}, extra=first)]

    def events(self, events: list[Event] | list[Canvas], lps: list[TokenLogprob] | None = None
               ) -> list[dict[str, str]]:
        """The batch's chunks; ``lps``: the logprobs of its tokens, carried by its first delta (or the next
        batch's, or the finish chunk, when it has none: a stop string may hold text back)."""
        self.pending += lps or []
        out = []
        for ev in events:
            if isinstance(ev, Canvas):
                out.append(self.canvas(ev))
                continue
            extra = self._take_logprobs()
            if isinstance(ev, ToolCallEvent):
                out.append(self.chunk({"tool_calls": [tool_call_dict(ev.call, self.n_calls)]}, extra=extra))
                self.n_calls += 1
            elif ev.channel == "reasoning":
                out.append(self.chunk({"reasoning_content": ev.text}, extra=extra))
            else:
                out.append(self.chunk({"content": ev.text}, extra=extra))
        return out

    def _take_logprobs(self) -> dict[str, Any] | None:
        """The choice's ``logprobs`` for the pending tokens (taken), or None when there are none."""
        if not self.pending:
            return None
        return {"logprobs": chat_logprobs(self.svc.model, self._take_pending())}

    def canvas(self, canvas: Canvas) -> dict[str, str]:
        """``clover_canvas`` requests only: a chunk with no choices whose ``clover_canvas`` is the block's cells,
        each token's text (special tokens rendered), or null where the cell is still masked."""
        mask, model = self.svc.model.info.mask_token_id, self.svc.model
        cells = [None if t == mask else model.detokenize([t], special=True) for t in canvas.ids]
        body = chat_chunk(self.cid, self.created, self.model, None)
        body["clover_canvas"] = cells
        return _sse(body)

    def finish(self, job: Job, pipeline: TextPipeline, tokens: list[int]) -> dict[str, str]:
        extra = ({"token_ids": tokens} if self.req.return_token_ids else {}) | (self._take_logprobs() or {})
        return self.chunk({}, finish_reason(job.stats, pipeline.stopped, self.n_calls > 0), extra or None)

    def usage(self, block: dict[str, Any]) -> dict[str, str]:
        return self.chunk(None, usage_block=block)


class CompletionChunks(_AnswerChunks):
    """The chunks of a streamed text completion (text_completion)."""

    def __init__(self, svc: CloverService, req: CompletionRequest, prep: Prepared) -> None:
        super().__init__(svc, prep, "cmpl")
        self.req = req
        self.offset = len(prep.echo_text)  # text_offset of the next token

    def chunk(self, text: str | None, finish: str | None = None, extra: dict[str, Any] | None = None,
              usage_block: dict[str, Any] | None = None) -> dict[str, str]:
        return _sse(completion_chunk(self.cid, self.created, self.model, text, finish, self._choice_extra(extra),
                                     usage_block))

    def opening(self) -> list[dict[str, str]]:
        return [self.chunk(self.prep.echo_text)] if self.prep.echo_text else []

    def events(self, events: list[Event] | list[Canvas], lps: list[TokenLogprob] | None = None
               ) -> list[dict[str, str]]:
        """The batch's chunks; ``lps`` as for chat, in the text completion's shape."""
        self.pending += lps or []
        return [self.chunk(ev.text, extra=self._take_logprobs()) for ev in events if isinstance(ev, TextEvent)]

    def _take_logprobs(self) -> dict[str, Any] | None:
        if not self.pending:
            return None
        lps = completion_logprobs(self.svc.model, self._take_pending(), self.offset)
        self.offset += sum(len(t) for t in lps["tokens"])
        return {"logprobs": lps}

    def finish(self, job: Job, pipeline: TextPipeline, tokens: list[int]) -> dict[str, str]:
        extra = ({"token_ids": tokens, "prompt_token_ids": self.prep.prompt_ids} if self.req.return_token_ids
                 else {}) | (self._take_logprobs() or {})
        return self.chunk("", finish_reason(job.stats, pipeline.stopped, False), extra or None)

    def usage(self, block: dict[str, Any]) -> dict[str, str]:
        return self.chunk(None, usage_block=block)


async def _answer(svc: CloverService, prep: Prepared, chat: bool, chunks: ChatChunks | CompletionChunks,
                  canvas: bool, jobs: list[Job]) -> AsyncIterator[dict[str, str]]:
    """One streamed answer's chunks: queued when the stream starts (not before), events as they come, then the
    finish chunk, or an error body when the engine failed. ``canvas``: the step canvases too (``clover_canvas``).
    Its job goes to ``jobs``."""
    job = svc.worker.submit(prep.prompt_ids, prep.params, prep.checkpoint_hint, prep.cache_prompt, canvas=canvas)
    jobs.append(job)
    pipeline = svc.pipeline(prep, chat=chat)
    tokens: list[int] = []
    try:
        for c in chunks.opening():
            yield c
        sent = 0  # tokens whose logprobs went to the chunks
        async with aclosing(event_batches(job, pipeline, tokens)) as batches:
            async for batch in batches:
                lps = None
                if prep.params.logprobs is not None:  # each token's entry arrives before the token
                    lps, sent = job.logprobs[sent:len(tokens)], len(tokens)
                for c in chunks.events(batch, lps):
                    yield c
        if job.error is not None:
            yield _sse(_job_error_body(job))
            return
        yield chunks.finish(job, pipeline, tokens)
    finally:
        job.cancel()  # a disconnect lands here (the task is cancelled): stop the engine


_END = object()


async def _interleave(streams: list[AsyncIterator[dict[str, str]]]) -> AsyncIterator[dict[str, str]]:
    """The chunks of several answers as they come (n > 1: each answer on its own slot)."""
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def pump(stream: AsyncIterator[dict[str, str]]) -> None:
        try:
            async with aclosing(stream) as items:
                async for item in items:
                    await queue.put(item)
        finally:
            queue.put_nowait(_END)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        ended = 0
        while ended < len(tasks):
            item = await queue.get()
            if item is _END:
                ended += 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


async def _stream(svc: CloverService, preps: list[Prepared], chat: bool, include_usage: bool,
                  chunks: list[ChatChunks | CompletionChunks], canvas: bool = False) -> AsyncIterator[dict[str, str]]:
    """A streamed response: each answer's chunks (interleaved when n > 1, each choice with its index), then the
    usage chunk when asked for (the answers' usage merged) and [DONE]; an engine error ends the stream with an
    error body."""
    jobs: list[Job] = []
    answers = [_answer(svc, p, chat, c, canvas, jobs) for p, c in zip(preps, chunks)]
    async with aclosing(answers[0] if len(answers) == 1 else _interleave(answers)) as items:
        async for item in items:
            yield item
    if any(job.error is not None for job in jobs):
        return
    if include_usage:
        prep = preps[0]
        yield chunks[0].usage(merged_usage([usage(len(prep.prompt_ids), j.stats, j.cached_tokens) for j in jobs]))
    yield _sse("[DONE]")


def streamer(svc: CloverService, req: Any, chat: bool, chunks: Callable[..., ChatChunks | CompletionChunks]
              ) -> Callable[[Prepared], AsyncIterator[dict[str, str]]]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    canvas = bool(getattr(req, "clover_canvas", False))  # a chat request's extension (docs/serve.md, "Web chat")

    def stream(prep: Prepared) -> AsyncIterator[dict[str, str]]:
        preps, per_answer = _per_answer(prep, lambda p: chunks(svc, req, p))
        return _stream(svc, preps, chat, include_usage, per_answer, canvas)

    return stream


def _per_answer(prep: Prepared, make: Callable[[Prepared], ChatChunks | CompletionChunks]
                ) -> tuple[list[Prepared], list[ChatChunks | CompletionChunks]]:
    """n answers: answer i samples with seed + i; their chunks share the response's id and carry their index."""
    preps = answers(prep)
    chunks = [make(p) for p in preps]
    for i, c in enumerate(chunks):
        c.cid, c.created, c.index = chunks[0].cid, chunks[0].created, i
    return preps, chunks
