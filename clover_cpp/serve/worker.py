"""One engine, one queue: generation jobs run on the engine's slots, one worker thread per slot.

With one slot (the default) jobs run one at a time. With ``n_parallel`` slots up to that many run at once, each
on its own slot (history and scratch sequence), and the engine batches their passes (docs/serve.md, "Slots").
A job takes the free slot whose last conversation shares the longest prefix with its prompt (llama-server's
slot choice by prompt similarity), keeps the longest prefix of that slot's history that its prompt starts with
and that a checkpoint can restore (``Model.reuse_prefix``; docs/serve.md, "Prefix reuse"), and prefills the
rest, so two requests never interleave a history. ``cache_prompt=False`` starts from a fresh history.
Committed blocks travel to the asyncio side through an ``asyncio.Queue``. ``Job.cancel()`` makes the engine
stop at its next callback (a committed block, or a LowConfidence step in diffusion/spec); a job
cancelled while still waiting never starts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from ..gen_params import GenParams
from ..model import Model, Stats, TokenLogprob


_DONE = object()


@dataclasses.dataclass(frozen=True)
class Canvas:
    """A LowConfidence step's block canvas (``info.mask_token_id`` where still masked), queued between the committed
    blocks of a job submitted with ``canvas=True`` (the chat request's ``clover_canvas``, docs/serve.md)."""

    ids: list[int]


class Job:
    """A queued or running generation. Await ``next_chunk()`` until it returns None."""

    def __init__(self, prompt_ids: list[int], params: GenParams, loop: asyncio.AbstractEventLoop,
                 checkpoint_hint: int = 0, cache_prompt: bool = True, canvas: bool = False) -> None:
        """``checkpoint_hint``: where the chat template's generation prompt starts (0 = unknown).
        ``cache_prompt``: reuse the slot's history prefix (llama-server's request field of that name).
        ``canvas``: queue each LowConfidence step's canvas too (a ``Canvas``, from ``next_chunk``)."""
        self.prompt_ids = prompt_ids
        self.params = params
        self.checkpoint_hint = checkpoint_hint
        self.cache_prompt = cache_prompt
        self.canvas = canvas
        self.stats: Stats | None = None
        self.cached_tokens = 0  # prompt tokens taken from the engine's history instead of prefilled
        self.generated: list[int] = []
        self.logprobs: list[TokenLogprob] = []  # with params.logprobs: one per generated token, before the token
        self.slot = -1  # the engine slot that ran it
        self.error: BaseException | None = None
        self.started = False
        self.finished = False
        self._loop = loop
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._cancel = threading.Event()
        self._drained = False

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def cancel(self) -> None:
        """Stop the generation at the engine's next callback (safe to call from any thread, any time)."""
        self._cancel.set()

    def _put(self, item: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            self._cancel.set()

    # ---------------------------------------------------------------------- worker thread
    def _on_tokens(self, block: list[int]) -> bool:
        if self._cancel.is_set():
            return False
        self.generated.extend(block)
        self._put(list(block))
        return True

    def _on_step(self, canvas: list[int]) -> bool:
        if self._cancel.is_set():
            return False
        if self.canvas:
            self._put(Canvas(list(canvas)))
        return True

    def run(self, model: Model) -> None:
        self.started = True
        try:
            if self._cancel.is_set():
                return
            if not self.cache_prompt:
                model.reset()  # reuse_prefix then finds nothing to keep, and only sets the checkpoint hint
            self.cached_tokens = model.reuse_prefix(self.prompt_ids, checkpoint_at=[self.checkpoint_hint])
            result = model.run(self.prompt_ids[self.cached_tokens:], self.params, on_tokens=self._on_tokens,
                               on_step=None if self.params.mode == "ar" else self._on_step,
                               on_logprobs=self.logprobs.append)
            self.stats = result.stats
        except BaseException as exc:
            self.error = exc
        finally:
            self.finished = True
            self._put(_DONE)

    # ---------------------------------------------------------------------- asyncio side
    async def next_chunk(self) -> list[int] | Canvas | None:
        """The next committed tokens (one commit), a step's ``Canvas`` (``canvas=True`` only), or None when the
        job is over (check ``error``)."""
        if self._drained:
            return None
        item = await self._queue.get()
        if item is _DONE:
            self._drained = True
            return None
        return item

    async def wait(self) -> None:
        """Drop the remaining blocks and wait for the job to end."""
        while await self.next_chunk() is not None:
            pass


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class EngineWorker:
    """The engine's slots, a thread for each, and the counters reported by /health."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.n_slots = model.n_parallel
        self._slots = [model.slot(i) for i in range(self.n_slots)]
        self._free = list(range(self.n_slots))
        self._slot_tokens: list[list[int]] = [[] for _ in range(self.n_slots)]  # each slot's last conversation
        self._slot_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=self.n_slots, thread_name_prefix="clover-engine")
        self._jobs: list[Job] = []
        self.completed = 0
        self.cancelled = 0
        self.failed = 0
        self.recent: deque[dict[str, Any]] = deque(maxlen=16)  # the latest finished jobs, newest last
        self.prefix_cache: dict[str, int] = self._cache_info()  # as of the last job
        self.on_finished: list[Callable[[Job], None]] = []  # called as each job ends (serve/metrics.py)

    def submit(self, prompt_ids: list[int], params: GenParams, checkpoint_hint: int = 0,
               cache_prompt: bool = True, canvas: bool = False) -> Job:
        job = Job(prompt_ids, params, asyncio.get_running_loop(), checkpoint_hint, cache_prompt, canvas)
        self._jobs.append(job)
        self._executor.submit(self._run, job)
        return job

    def _take_slot(self, prompt_ids: list[int]) -> int:
        """The free slot whose last conversation shares the longest prefix with the prompt (the least recently
        used among ties: ``_free`` keeps release order). A worker thread always finds one: there are as many
        threads as slots."""
        with self._slot_lock:
            best = max(self._free, key=lambda i: _common_prefix(self._slot_tokens[i], prompt_ids))
            self._free.remove(best)
            return best

    def _release_slot(self, i: int, tokens: list[int]) -> None:
        with self._slot_lock:
            self._slot_tokens[i] = tokens
            self._free.append(i)

    def _cache_info(self) -> dict[str, int]:
        """The slots' prefix caches, summed."""
        infos = [dataclasses.asdict(s.cache_info()) for s in self._slots]
        out = {k: sum(d[k] for d in infos) for k in infos[0]}
        if self.n_slots > 1:  # one checkpoint's size is the same in every slot
            out["checkpoint_bytes"] = max(d["checkpoint_bytes"] for d in infos)
        return out

    def _run(self, job: Job) -> None:
        start = time.perf_counter()
        slot = self._take_slot(job.prompt_ids)
        job.slot = slot
        try:
            job.run(self._slots[slot])
        finally:
            self._release_slot(slot, job.prompt_ids + job.generated)
            self.prefix_cache = self._cache_info()
            self._jobs.remove(job)
            s = job.stats
            if job.error is not None:
                self.failed += 1
            elif (s.stop_reason == "cancelled") if s is not None else job.cancelled:
                self.cancelled += 1
            else:
                self.completed += 1
            self.recent.append({
                "prompt_tokens": len(job.prompt_ids),
                "cached_tokens": job.cached_tokens,
                "generated_tokens": s.generated_tokens if s else 0,
                "stop_reason": s.stop_reason if s else ("cancelled" if job.cancelled else "error"),
                "mode": s.mode if s else job.params.mode,  # the mode it ran (diffusion with a grammar: auto)
                "slot": slot,
                "seconds": round(time.perf_counter() - start, 4),
            })
            for hook in self.on_finished:
                hook(job)

    @property
    def running(self) -> int:
        """Jobs decoding now (at most one per slot)."""
        return sum(1 for j in list(self._jobs) if j.started and not j.finished)

    @property
    def jobs(self) -> list[Job]:
        """The queued and running jobs, oldest first (a snapshot)."""
        return list(self._jobs)

    @property
    def waiting(self) -> int:
        return sum(1 for j in list(self._jobs) if not j.started)

    def health(self) -> dict[str, Any]:
        passes, rounds = self.model.pass_stats()
        return {"slots": self.n_slots, "running": self.running, "waiting": self.waiting, "completed": self.completed,
                "batched_passes": passes, "batch_rounds": rounds,
                "cancelled": self.cancelled, "failed": self.failed, "recent": list(self.recent),
                "prefix_cache": self.prefix_cache}

    def shutdown(self) -> None:
        for job in list(self._jobs):
            job.cancel()
        self._executor.shutdown(wait=True, cancel_futures=False)
