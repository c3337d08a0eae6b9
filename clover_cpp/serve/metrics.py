"""What finished requests add up to, for llama-server's ``GET /metrics`` (Prometheus text, served with --metrics)
and ``GET /slots``: ``Meter.record`` is the one hook, called by the worker as each job ends, streamed or not
(``EngineWorker.on_finished``); ``Meter.render`` writes llama-server's metrics, with the names, help texts and
types of its ``server_task_result_metrics::to_metrics`` (tools/server/server-task.cpp of the pinned llama.cpp),
then clover's own, prefixed ``clover:``, most of them by decoding mode (a ``mode`` label)."""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

from ..gen_params import MODES
from .worker import EngineWorker, Job

CONTENT_TYPE = "text/plain; version=0.0.4"  # llama-server's


@dataclass
class _Rate:
    """Tokens and the seconds they took."""

    tokens: int = 0
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens += tokens
        self.seconds += seconds

    @property
    def per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _ModeCounts:
    """One decoding mode's finished requests, what they generated and the decode-time passes it took."""

    requests: int = 0
    generated: int = 0
    block_passes: int = 0
    causal_passes: int = 0

    @property
    def tokens_per_pass(self) -> float:
        passes = self.block_passes + self.causal_passes
        return self.generated / passes if passes else 0.0


class Meter:
    """Counters since the server started, fed by ``record`` from the worker threads, read by the routes."""

    def __init__(self, worker: EngineWorker) -> None:
        self.worker = worker
        self.started = time.time()
        self._lock = threading.Lock()
        self.prompt, self.predict = _Rate(), _Rate()  # since the start
        self._prompt_window, self._predict_window = _Rate(), _Rate()  # since the last scrape, as llama-server's
        self.prompt_cached = 0  # prompt tokens taken from a slot's history instead of prefilled
        self.cache_hits = 0  # requests that took some
        self.n_tokens_max = 0
        self.drafted = self.accepted = self.drafts = 0  # auto mode's draft tokens, accepted ones, verifications
        self.modes = {m: _ModeCounts() for m in MODES}
        self.last: dict[int, Job] = {}  # each slot's last finished job (/slots)
        self._task_ids: weakref.WeakKeyDictionary[Job, int] = weakref.WeakKeyDictionary()
        self._next_id = itertools.count()
        worker.on_finished.append(self.record)

    def record(self, job: Job) -> None:
        """A job has ended (completed, stopped, cancelled or failed): count it, and what it ran."""
        s = job.stats
        mode = s.mode if s is not None else job.params.mode
        with self._lock:
            self._task_id(job)
            self.last[job.slot] = job
            counts = self.modes.setdefault(mode, _ModeCounts())
            counts.requests += 1
            if s is None:  # failed, or cancelled before it started: nothing was decoded
                return
            prefilled = len(job.prompt_ids) - job.cached_tokens
            for rate in (self.prompt, self._prompt_window):
                rate.add(prefilled, s.prefill_ms / 1e3)
            for rate in (self.predict, self._predict_window):
                rate.add(s.generated_tokens, s.decode_ms / 1e3)
            self.prompt_cached += job.cached_tokens
            self.cache_hits += job.cached_tokens > 0
            self.n_tokens_max = max(self.n_tokens_max, len(job.prompt_ids) + s.generated_tokens)
            counts.generated += s.generated_tokens
            counts.block_passes += s.block_passes
            counts.causal_passes += s.causal_passes
            if s.mode == "auto":
                self.drafted += s.auto_drafted
                self.accepted += s.auto_accepted
                self.drafts += sum(n for kind, n in s.auto_rounds.items() if kind != "none")

    def _task_id(self, job: Job) -> int:
        if job not in self._task_ids:
            self._task_ids[job] = next(self._next_id)
        return self._task_ids[job]

    def task_id(self, job: Job) -> int:
        """llama-server's ``id_task``: a number of each request's own, in the order this meter first saw them."""
        with self._lock:
            return self._task_id(job)

    def _decodes(self) -> tuple[int, float]:
        """(llama_decode calls, busy slots per call). With several slots, the engine's rounds and the slots' passes
        per round. One slot's engine counts no rounds: the finished requests' decode-time passes then (their prompt
        passes are not counted), one busy slot each."""
        if self.worker.n_slots > 1:
            passes, rounds = self.worker.model.pass_stats()
            return rounds, passes / rounds if rounds else 0.0
        n = sum(c.block_passes + c.causal_passes for c in self.modes.values())
        return n, 1.0 if n else 0.0

    def render(self) -> str:
        """The Prometheus text; the throughput gauges cover the time since the previous scrape, as llama-server's."""
        with self._lock:
            llama = self._llama_metrics()
            self._prompt_window, self._predict_window = _Rate(), _Rate()
            clover = self._clover_metrics()
        return "".join(_family(*m) for m in llama + clover)

    def _llama_metrics(self) -> list[tuple[str, str, str, Any]]:
        n_decode, busy = self._decodes()
        return [
            ("llamacpp:prompt_tokens_total", "counter", "Number of prompt tokens processed, excluding cached tokens",
             self.prompt.tokens),
            ("llamacpp:prompt_tokens_cached_total", "counter", "Number of prompt tokens reused from the cache",
             self.prompt_cached),
            ("llamacpp:prompt_seconds_total", "counter", "Total time spent processing prompts", self.prompt.seconds),
            ("llamacpp:tokens_predicted_total", "counter", "Number of generation tokens processed",
             self.predict.tokens),
            ("llamacpp:tokens_predicted_seconds_total", "counter", "Total time spent generating tokens",
             self.predict.seconds),
            ("llamacpp:n_decode_total", "counter",
             "Total number of llama_decode() calls, excluding speculative decoding and multimodal decoding", n_decode),
            ("llamacpp:n_tokens_max", "counter", "Largest observed sequence length (prompt + generation)",
             self.n_tokens_max),
            # llama.cpp's speculative decoding is off; auto mode's drafts are the closest thing, and are counted
            # here (spec mode's drafts are its block passes: clover:block_passes_total)
            ("llamacpp:spec_decode_num_draft_tokens_total", "counter", "Speculative: Total draft tokens generated",
             self.drafted),
            ("llamacpp:spec_decode_num_accepted_tokens_total", "counter",
             "Speculative: Total draft tokens accepted by the target model", self.accepted),
            ("llamacpp:spec_decode_num_drafts_total", "counter",
             "Speculative: Total speculative decoding verification steps", self.drafts),
            # generated tokens per decode second, not llama-server's decode steps per second: a clover pass commits
            # several tokens, and that is the throughput a client sees
            ("llamacpp:prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s",
             self._prompt_window.per_second),
            ("llamacpp:predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s",
             self._predict_window.per_second),
            ("llamacpp:requests_processing", "gauge", "Number of requests processing", self.worker.running),
            ("llamacpp:requests_deferred", "gauge", "Number of requests deferred", self.worker.waiting),
            ("llamacpp:n_busy_slots_per_decode", "gauge", "Average number of busy slots per llama_decode() call",
             busy),
        ]

    def _clover_metrics(self) -> list[tuple[str, str, str, Any]]:
        def by_mode(field: str) -> dict[str, Any]:
            return {m: getattr(c, field) for m, c in self.modes.items()}

        return [
            ("clover:requests_total", "counter", "Requests finished (completed, stopped, cancelled or failed), by "
             "decoding mode", by_mode("requests")),
            ("clover:generated_tokens_total", "counter", "Tokens generated, by decoding mode", by_mode("generated")),
            ("clover:block_passes_total", "counter", "Decode-time block passes, by decoding mode",
             by_mode("block_passes")),
            ("clover:causal_passes_total", "counter", "Decode-time causal passes (ar steps, commits, verifications), "
             "by decoding mode", by_mode("causal_passes")),
            ("clover:tokens_per_pass", "gauge", "Generated tokens per decode-time pass (TPF) of the requests "
             "finished so far, by decoding mode", by_mode("tokens_per_pass")),
            ("clover:prefix_cache_hits_total", "counter", "Requests that reused a prefix of a slot's history "
             "(llamacpp:prompt_tokens_cached_total counts the tokens)", self.cache_hits),
        ]


def _value(v: Any) -> str:
    return str(int(v)) if isinstance(v, (bool, int)) else repr(float(v))


def _family(name: str, kind: str, help_text: str, value: Any) -> str:
    """One metric's HELP, TYPE and samples; a dict value is one sample per mode."""
    head = f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n"
    if isinstance(value, dict):
        return head + "".join(f'{name}{{mode="{m}"}} {_value(v)}\n' for m, v in value.items())
    return head + f"{name} {_value(value)}\n"
