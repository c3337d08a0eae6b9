"""``clover_cpp.Model``: the native Clover decoding engine (libclover) from Python.

    with clover_cpp.Model("tiny-f32.gguf") as m:
        gen = m.generate("def fibonacci(n):", mode="diffusion", max_tokens=64)
        for block in gen:          # committed tokens, one list per committed block (ar: per token)
            print(m.detokenize(block), end="", flush=True)
        print(gen.stats.tokens_per_pass)

``generate`` runs the C call in a worker thread; its callbacks push committed blocks into a small queue
(the worker waits when the consumer falls ``buffer`` blocks behind). Closing the iterator early (``close()``,
``break`` followed by garbage collection, or a new ``generate``) cancels the generation through the
callback's return value; the engine then resets its history (clover.h), so the next call starts fresh.
``run`` is the synchronous form: all tokens and the stats, no thread.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from clover_common.generate_output import RunStats
from clover_common.errors import BadInput
from clover_common.input_files import GGUF, check_input_file

from clover_native import libclover, loader, bindings
from clover_native.loader import NativeError
from .gen_params import GenParams, merge, to_c
from .offload import Offload


class EngineError(NativeError):
    """A call into libclover failed; the message is the engine's last error."""


class GrammarDeadEnd(BadInput):
    """A constrained generation reached a point where its grammar allows no token (the request's fault)."""


DEFAULT_CACHE_RAM_MIB = 1024     # serve and chat: host memory for prefix-reuse checkpoints (--cache-ram)
DEFAULT_CHECKPOINT_EVERY = 1024  # a checkpoint every this many prefilled tokens (--checkpoint-every)


@dataclass(frozen=True)
class CacheInfo:
    """The prefix cache's state (clover_cache_info): checkpoints held and the counters since load."""

    n_checkpoints: int
    n_bytes: int
    max_bytes: int
    checkpoint_bytes: int
    n_saved: int
    n_evicted: int
    n_restored: int
    n_reused_tokens: int

@dataclass(frozen=True)
class ModelInfo:
    """The clover settings of the loaded GGUF (spec section 5), as typed values."""

    block_size: int
    threshold: float
    mask_token_id: int
    conv_right_kernel: int
    calibrated_block_sizes: tuple[int, ...]
    calibrated_thresholds: tuple[float, ...]
    n_vocab: int
    n_ctx_train: int
    coreset_top_p: float = 1.0
    history_rows: int = 32
    has_block_diffusion: bool = True
    repeat_penalty: float = 1.0  # the default penalties (spec 4), from the GGUF
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @classmethod
    def from_c(cls, info: libclover.clover_model_info) -> "ModelInfo":
        n = max(0, min(int(info.n_calibrated), libclover.CLOVER_MAX_CALIBRATED))
        return cls(int(info.block_size), float(info.threshold), int(info.mask_token_id),
                   int(info.conv_right_kernel), tuple(int(x) for x in info.calibrated_block_sizes[:n]),
                   tuple(float(x) for x in info.calibrated_thresholds[:n]), int(info.n_vocab),
                   int(info.n_ctx_train), float(info.coreset_top_p), int(info.history_rows),
                   bool(info.has_block_diffusion), float(info.repeat_penalty), float(info.presence_penalty),
                   float(info.frequency_penalty))

    def threshold_for(self, block_size: int) -> float:
        """The threshold a call without one uses (spec 4.3): the calibrated threshold for B, else the default. Read
        from the file's keys (clover_model_info_threshold), by the rule the engine and llama-server apply to a loaded
        model (llama_clover_threshold)."""
        c = libclover.clover_model_info()
        c.block_size, c.threshold, c.n_calibrated = self.block_size, self.threshold, len(self.calibrated_block_sizes)
        for i, (b, t) in enumerate(zip(self.calibrated_block_sizes, self.calibrated_thresholds)):
            c.calibrated_block_sizes[i], c.calibrated_thresholds[i] = b, t
        return float(libclover.lib().clover_model_info_threshold(ctypes.byref(c), int(block_size)))


def _histogram(values: Sequence[int]) -> list[int]:
    """A C histogram with trailing zeros trimmed (index = value; the last C bin holds larger values)."""
    out = [int(v) for v in values]
    while out and out[-1] == 0:
        out.pop()
    return out


@dataclass(frozen=True)
class PassCosts:
    """What the engine's passes cost, in ms (clover.h; ``Model.measure_pass_costs``): an ar step in a run of them
    costs ar_ms, a causal pass of w rows in a run of same-width passes causal_fixed_ms + w * causal_row_ms, a pass
    whose shape changed rebuild_ms more, and a block pass of w rows block_fixed_ms + w * block_row_ms. A
    measurement for benchmarks: no decoding rule reads it."""

    ar_ms: float
    causal_fixed_ms: float
    causal_row_ms: float
    rebuild_ms: float
    block_fixed_ms: float
    block_row_ms: float

    @classmethod
    def from_c(cls, c: libclover.clover_pass_costs) -> "PassCosts":
        return cls(*(float(getattr(c, name)) for name, _ in libclover.clover_pass_costs._fields_))


@dataclass
class Stats(RunStats):
    """What one generate call did. Histograms are lists indexed by value (``steps_per_block[s]`` = number
    of blocks that took s steps); bin 64 holds everything larger."""

    prefill_ms: float = 0.0
    block_ms: float = 0.0
    causal_ms: float = 0.0
    steps_per_block: list[int] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)
    stop_reason: str = ""
    wall_s: float = 0.0
    threads: int = 0
    auto_rounds: dict[str, int] = field(default_factory=dict)  # auto: rounds by draft kind (none, ngram, block)
    auto_drafted: int = 0          # auto: draft tokens verified
    auto_accepted: int = 0         # auto: draft tokens accepted
    auto_accepted_block: int = 0   # auto: of those, the ones block passes drafted
    graph_reuses: int = 0  # decode-time passes that reused a built graph; the others built theirs
    coreset_top_p: float = 1.0  # the block passes' coreset top_p the call used (resolved by libclover)
    fused_passes: int = 0  # spec: of the causal passes, the fused verify + draft ones (docs/native.md)
    replays: int = 0  # auto: of the causal passes, those that decoded a long draft's kept tokens again after its
                      # verification rejected more than the recurrent state rolls back (docs/decoding.md, "Bounds")

    @classmethod
    def from_c(cls, s: libclover.clover_stats, wall_s: float, threads: int) -> "Stats":
        """libclover's stats; B, the threshold and the coreset top_p are the ones the call resolved and used."""
        mode = libclover.MODE_NAMES[int(s.mode)]  # the mode the call ran in (diffusion with a grammar: auto)
        auto = mode == "auto"
        return cls(mode, int(s.block_size), float(s.threshold), int(s.n_prompt_tokens), int(s.n_generated),
                   int(s.n_block_passes), int(s.n_causal_passes), float(s.t_prefill_ms), float(s.t_block_ms),
                   float(s.t_causal_ms), _histogram(s.steps_per_block), _histogram(s.accepted_lengths),
                   libclover.STOP_REASONS.get(int(s.stop_reason), f"unknown({int(s.stop_reason)})"), wall_s,
                   threads, dict(zip(libclover.DRAFT_KINDS, (int(n) for n in s.auto_rounds))) if auto else {},
                   int(s.auto_drafted), int(s.auto_accepted), int(s.auto_accepted_block), int(s.n_graph_reuses),
                   float(s.coreset_top_p), int(s.n_fused_passes), int(s.n_replays))

    @property
    def decode_ms(self) -> float:
        return self.block_ms + self.causal_ms

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / (self.prefill_ms / 1e3) if self.prefill_ms > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.generated_tokens / (self.decode_ms / 1e3) if self.decode_ms > 0 else 0.0

    @property
    def ms_per_pass(self) -> float:
        return self.decode_ms / self.passes if self.passes else 0.0

    @property
    def ms_per_block_pass(self) -> float:
        return self.block_ms / self.block_passes if self.block_passes else 0.0

    @property
    def ms_per_causal_pass(self) -> float:
        return self.causal_ms / self.causal_passes if self.causal_passes else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode, "block_size": self.block_size, "threshold": self.threshold,
            "coreset_top_p": self.coreset_top_p, "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "block_passes": self.block_passes, "causal_passes": self.causal_passes,
            "tokens_per_pass": self.tokens_per_pass, "prefill_ms": self.prefill_ms,
            "prefill_tok_s": self.prefill_tok_s, "block_ms": self.block_ms, "causal_ms": self.causal_ms,
            "decode_tok_s": self.decode_tok_s, "ms_per_pass": self.ms_per_pass,
            "ms_per_block_pass": self.ms_per_block_pass, "ms_per_causal_pass": self.ms_per_causal_pass,
            "steps_per_block_hist": list(self.steps_per_block),
            "accepted_lengths_hist": list(self.accepted_lengths),
            "stop_reason": self.stop_reason, "wall_s": self.wall_s, "threads": self.threads,
            "graph_builds": self.passes - self.graph_reuses,
        } | ({"auto_rounds": dict(self.auto_rounds), "auto_drafted": self.auto_drafted,
              "auto_accepted": self.auto_accepted, "auto_accepted_block": self.auto_accepted_block,
              "replays": self.replays}
             if self.mode == "auto" else {})


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log P (spec 4's P, after bias, penalties and grammar; diffusion: the confidence
    distribution it was filled from) and its most likely alternatives, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass
class Result:
    tokens: list[int]
    stats: Stats
    logprobs: list[TokenLogprob] | None = None  # with GenParams.logprobs, one per token


class _Call:
    """One prepared clover_slot_generate call: the C parameters, kept-alive arrays and the C callbacks."""

    def __init__(self, model: "Model", prompt_ids: list[int], params: GenParams,
                 on_tokens: Callable[[list[int]], bool], on_step: Callable[[list[int]], Any] | None) -> None:
        L = libclover.lib()
        self.model = model
        self.prompt = (libclover.llama_token * max(1, len(prompt_ids)))(*[int(t) for t in prompt_ids])
        self.n_prompt = len(prompt_ids)
        self.params = L.clover_gen_default_params()
        p = self.params
        to_c(params, p)  # the scalar fields, from the table of gen_params (None: the C value for the GGUF's)
        stop_ids = params.stop_ids
        self._stop, n_stop = libclover.token_array(None if stop_ids is None else list(stop_ids))
        if stop_ids is None:  # NULL with n < 0: the vocabulary's end-of-generation set
            p.stop_ids, p.n_stop_ids = None, -1
        else:
            p.stop_ids, p.n_stop_ids = ctypes.cast(self._stop, libclover.llama_token_p), n_stop
        self._banned, n_banned = libclover.token_array(list(params.banned_ids) or None)
        p.banned_ids = ctypes.cast(self._banned, libclover.llama_token_p) if self._banned is not None else None
        p.n_banned_ids = n_banned
        self._set_distribution(p, params)
        self.stats = libclover.clover_stats()
        self.user_on_step = on_step
        self.user_on_tokens = on_tokens
        self.error: BaseException | None = None
        self.cancel = threading.Event()
        self.tokens_cb = libclover.clover_tokens_cb(self._tokens)
        self.step_cb = libclover.clover_step_cb(self._step) if on_step is not None else libclover.clover_step_cb()

    def _set_distribution(self, p: Any, params: GenParams) -> None:
        """The distribution stage's fields (spec 4); the arrays and callback are kept alive on self."""
        self._bias_ids, n_bias = libclover.token_array([t for t, _ in params.logit_bias] or None)
        self._bias_values = (ctypes.c_float * max(1, n_bias))(*[b for _, b in params.logit_bias])
        p.bias_ids = ctypes.cast(self._bias_ids, libclover.llama_token_p) if self._bias_ids is not None else None
        p.bias_values = ctypes.cast(self._bias_values, ctypes.POINTER(ctypes.c_float))
        p.n_bias = n_bias
        self._grammar = params.grammar.encode() if params.grammar else None
        p.grammar = self._grammar
        self._after, n_after = libclover.token_array(list(params.grammar_after_ids) or None)
        p.grammar_after_ids = ctypes.cast(self._after, libclover.llama_token_p) if self._after is not None else None
        p.n_grammar_after_ids = n_after
        self.logprobs: list[TokenLogprob] | None = None
        self.on_logprobs: Callable[[TokenLogprob], Any] | None = None
        p.n_logprobs = -1 if params.logprobs is None else int(params.logprobs)
        if params.logprobs is not None:
            self.logprobs = []
            self.logprobs_cb = libclover.clover_logprobs_cb(self._logprob)
            p.on_logprobs = self.logprobs_cb

    def _logprob(self, token: int, logprob: float, ids: Any, lps: Any, n: int, _user: Any) -> bool:
        try:
            entry = TokenLogprob(int(token), float(logprob), tuple((int(ids[i]), float(lps[i])) for i in range(n)))
            assert self.logprobs is not None
            self.logprobs.append(entry)
            return self.on_logprobs is None or self.on_logprobs(entry) is not False
        except BaseException as exc:
            self.error = exc
            return False

    def set_on_step(self, on_step: Callable[[list[int]], Any]) -> None:
        """Ask for the LowConfidence canvases (before the call runs)."""
        self.user_on_step = on_step
        self.step_cb = libclover.clover_step_cb(self._step)

    def _tokens(self, ptr: Any, n: int, _user: Any) -> bool:
        try:
            if self.cancel.is_set():
                return False
            return bool(self.user_on_tokens([int(ptr[i]) for i in range(n)]))
        except BaseException as exc:
            self.error = exc
            return False

    def _step(self, ptr: Any, n: int, _user: Any) -> bool:
        try:
            if self.cancel.is_set():
                return False
            assert self.user_on_step is not None
            return self.user_on_step([int(ptr[i]) for i in range(n)]) is not False
        except BaseException as exc:
            self.error = exc
            return False

    def run(self) -> tuple[int, float]:
        L = libclover.lib()
        start = time.perf_counter()
        rc = L.clover_slot_generate(self.model._handle(), self.prompt, self.n_prompt, ctypes.byref(self.params),
                                    self.tokens_cb, self.step_cb, None, ctypes.byref(self.stats))
        return int(rc), time.perf_counter() - start

    def result_stats(self, wall_s: float) -> Stats:
        return Stats.from_c(self.stats, wall_s, self.model.n_threads)

    def raise_for(self, rc: int) -> None:
        if self.error is not None:
            raise self.error
        if rc < 0:
            message = self.model.last_error() or "clover_slot_generate failed"
            if "(a dead end of the grammar)" in message:
                raise GrammarDeadEnd(message)
            if message.startswith("grammar:"):  # the call's grammar was refused before anything ran
                raise BadInput(message)
            raise EngineError(message)


class Generation:
    """The iterator ``Model.generate`` returns: yields committed token lists as they arrive. The one bridge from
    a native generation on a worker thread to a consumer thread (``generate()``, chat); the server's slots run
    the engine on their own threads instead (worker.Job).

    ``events()`` yields ``("block", tokens)`` and, with ``steps=True``, ``("step", canvas)`` after each
    LowConfidence step. ``cancel()`` (any thread, e.g. a SIGINT handler) stops the engine at its next callback
    and the iteration then ends normally, with ``stats.stop_reason`` "cancelled". ``stats`` and ``tokens``
    (every committed token) are set once the generation is over. ``close()`` cancels a running generation (the
    engine resets its history) and waits for the worker.
    """

    _DONE = object()

    def __init__(self, call: _Call, buffer: int, steps: bool = False) -> None:
        self._call = call
        self._queue: queue.Queue[Any] = queue.Queue()
        self._space = threading.Semaphore(max(1, buffer))  # committed blocks only: steps never wait
        self.tokens: list[int] = []
        self.stats: Stats | None = None
        self.cancelled = False
        self._rc = 0
        self._finished = False
        self._blocks: Iterator[list[int]] | None = None  # __next__'s view of events()
        call.user_on_tokens = self._push
        if steps:
            user_on_step = call.user_on_step

            def on_step(canvas: list[int]) -> bool:
                self._queue.put(("step", canvas))
                return user_on_step is None or user_on_step(canvas) is not False
            call.set_on_step(on_step)
        self._thread = threading.Thread(target=self._work, name="clover-generate", daemon=True)
        self._thread.start()

    def _push(self, tokens: list[int]) -> bool:
        while not self._space.acquire(timeout=0.05):
            if self._call.cancel.is_set():
                return False
        if self._call.cancel.is_set():
            return False
        self._queue.put(("block", tokens))
        return True

    def _work(self) -> None:
        rc, wall = -1, 0.0
        try:
            rc, wall = self._call.run()
        except BaseException as exc:
            self._call.error = exc
        finally:
            self._rc = rc
            self.stats = self._call.result_stats(wall)
            self._queue.put(self._DONE)

    def cancel(self) -> None:
        """Stop at the engine's next callback; the iteration ends once the engine has stopped."""
        self.cancelled = True
        self._call.cancel.set()

    def events(self) -> Iterator[tuple[str, list[int]]]:
        """``("block", tokens)`` and ``("step", canvas)`` until the generation ends (raises its error, if any)."""
        while not self._finished:
            item = self._queue.get()
            if item is self._DONE:
                self._finish()
                return
            kind, payload = item
            if kind == "block":
                self._space.release()
                self.tokens.extend(payload)
            yield kind, payload

    def __iter__(self) -> Iterator[list[int]]:
        return self

    def __next__(self) -> list[int]:
        if self._blocks is None:
            self._blocks = (payload for kind, payload in self.events() if kind == "block")
        return next(self._blocks)

    def _finish(self) -> None:
        self._thread.join()
        self._finished = True
        if self._call.model._active is self:
            self._call.model._active = None
        if not self.cancelled:
            self._call.raise_for(self._rc)

    def wait(self) -> list[int]:
        """Consume the rest; returns all tokens."""
        for _ in self:
            pass
        return self.tokens

    def close(self) -> None:
        """Cancel (if still running) and wait for the worker; the engine has reset its history if cancelled."""
        if self._finished:
            return
        if self._thread.is_alive():
            self.cancel()
        while True:  # drain, so a worker blocked on the buffer sees the cancel
            item = self._queue.get()
            if item is self._DONE:
                break
            if item[0] == "block":
                self._space.release()
        self._thread.join()
        self._finished = True
        if self._call.model._active is self:
            self._call.model._active = None

    @property
    def done(self) -> bool:
        return self._finished

    def __enter__(self) -> "Generation":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def engine_params(n_ctx: int = 0, n_threads: int = 0, max_block_size: int = 0, n_gpu_layers: int | None = None,
                  n_batch: int = 0, use_extra_bufts: bool = True, offload: Offload | None = None,
                  n_parallel: int = 1, bd_path: str | os.PathLike[str] | None = None,
                  graph_cache: int | None = None, prefill_chunk: int | None = None,
                  ) -> tuple[libclover.clover_engine_params, list[bytes]]:
    """The clover_engine_params Model(...) loads with (Model's arguments), and the strings they point to (keep them
    alive until the load returns)."""
    params = libclover.lib().clover_engine_default_params()
    if n_ctx:
        params.n_ctx = int(n_ctx)
    if n_batch:
        params.n_batch = int(n_batch)
    if max_block_size:
        params.max_block_size = int(max_block_size)
    if n_threads:
        params.n_threads = int(n_threads)
    else:
        params.n_threads = loader.env_int("CLOVER_THREADS", params.n_threads)
    if n_gpu_layers is None:  # $CLOVER_N_GPU_LAYERS, as clover_native.bindings.LlamaModel
        n_gpu_layers = loader.env_int("CLOVER_N_GPU_LAYERS", 0)
    params.n_gpu_layers = int(n_gpu_layers)
    params.use_extra_bufts = bool(use_extra_bufts)
    if n_parallel < 1:
        raise BadInput(f"n_parallel must be at least 1, got {n_parallel}")
    params.n_parallel = int(n_parallel)
    keep = (offload or Offload()).apply(params)
    if bd_path is not None:
        keep.append(os.fsencode(bd_path))
        params.bd_path = keep[-1]
    if prefill_chunk is not None:
        if prefill_chunk < 0:
            raise BadInput(f"prefill_chunk must be >= 0, got {prefill_chunk}")
        params.n_prefill_chunk = int(prefill_chunk)
    if graph_cache is None:  # $CLOVER_GRAPH_CACHE, as $CLOVER_THREADS: a benchmark's switch
        graph_cache = loader.env_int("CLOVER_GRAPH_CACHE", -1)
    if graph_cache >= 0:
        params.n_graph_cache = int(graph_cache)
    return params, keep


class Model(loader.NativeHandle):
    """One loaded GGUF and its engine context (history, scratch sequence, rollback room)."""

    def __init__(self, path: str | os.PathLike[str], n_ctx: int = 0, n_threads: int = 0, max_block_size: int = 0,
                 n_gpu_layers: int | None = None, n_batch: int = 0, use_extra_bufts: bool = True,
                 offload: Offload | None = None, cache_ram_mib: float = 0,
                 checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY, n_parallel: int = 1,
                 bd_path: str | os.PathLike[str] | None = None, graph_cache: int | None = None,
                 prefill_chunk: int | None = None) -> None:
        """``bd_path``: a block-diffusion sidecar (``NAME.bd.gguf``, spec 5) for a trunk-only ``path``.
        ``graph_cache``: compute graphs kept besides the last one, so that the modes' alternating pass shapes are
        built once (None = $CLOVER_GRAPH_CACHE, else libclover's default, CLOVER_GRAPH_CACHE_DEFAULT; 0 = llama.cpp's
        reuse of the last one only). ``prefill_chunk``: with slots, prompt tokens per prefill pass while another
        slot generates (None = libclover's default, 128; 0 = n_batch): the others' passes run between a long prompt's
        chunks and share their rounds.
        ``use_extra_bufts=False`` keeps every weight in plain CPU buffers: no AMX or repacked layouts
        (llama.cpp's ``--no-repack``). ``offload``: llama.cpp's -ot, --cpu-moe, --n-cpu-moe, -sm, -mg, -ts
        (clover_cpp/offload.py). ``cache_ram_mib`` / ``checkpoint_every``: the prefix cache (``set_cache``).
        ``n_parallel``: slots sharing the context (``slot(i)``); ``n_ctx`` is divided among them."""
        L = libclover.lib()
        self.path = str(path)
        for file in (self.path, bd_path):
            if file is not None:
                check_input_file(file, GGUF)  # llama.cpp would wait on a fifo, and read a device without end
        params, keep = engine_params(n_ctx=n_ctx, n_threads=n_threads, max_block_size=max_block_size,
                                     n_gpu_layers=n_gpu_layers, n_batch=n_batch, use_extra_bufts=use_extra_bufts,
                                     offload=offload, n_parallel=n_parallel, bd_path=bd_path,
                                     graph_cache=graph_cache, prefill_chunk=prefill_chunk)
        err = ctypes.create_string_buffer(2048)
        with loader.logged_errors() as logged:  # gguf's and the loader's reasons are only logged
            self.ptr = L.clover_engine_load(self.path.encode(), params, err, len(err))
        if not self.ptr:
            msg = err.value.decode("utf-8", "replace").strip() or "unknown error"
            reasons = loader.error_reasons(logged)
            if reasons and msg.startswith("llama.cpp could not load"):
                msg = "llama.cpp refused it"  # the reason says what; the path is already in the line
            msg = msg.removeprefix(f"'{self.path}': ")
            raise EngineError(f"cannot load {self.path}: {msg}" + (f": {reasons}" if reasons else ""))
        del keep
        loader.release_openmp_threads()  # the load's workers: passes may run on other threads (a server's)
        self._slot_ptr = L.clover_engine_slot(self.ptr, 0)
        self.info = ModelInfo.from_c(L.clover_engine_info(self.ptr).contents)
        self._llama_model = L.clover_engine_model(self.ptr)
        self._vocab = loader.llama().llama_model_get_vocab(self._llama_model)
        self._active: Generation | None = None
        self._lock = threading.Lock()
        self._owner: Model | None = None  # set on slot views: the Model that owns the engine
        if cache_ram_mib:
            for i in range(self.n_parallel):
                self.slot(i).set_cache(cache_ram_mib / self.n_parallel, checkpoint_every)

    # ---------------------------------------------------------------------------------- plumbing
    def _handle(self) -> int:
        """This Model's slot (a clover_slot_p)."""
        self._engine()
        return self._slot_ptr

    def _engine(self) -> int:
        """The engine (a clover_engine_p): the owning Model's."""
        if not self.ptr or (self._owner is not None and not self._owner.ptr):
            raise EngineError("the model is closed")
        return (self._owner or self).ptr

    # ---------------------------------------------------------------------------------- slots
    @property
    def n_parallel(self) -> int:
        """Slots of the engine (``n_parallel`` at load)."""
        return int(libclover.lib().clover_engine_n_parallel(self._engine()))

    def slot(self, i: int) -> "Model":
        """Slot ``i`` (0 is this model): a Model with its own history, prefix cache and generations on the shared
        context. Drive each slot from one thread at a time; different slots may run on different threads at once,
        and the engine batches their passes (docs/serve.md, "Slots"). The owning Model frees every slot."""
        if self._owner is not None:
            return self._owner.slot(i)
        if i == 0:
            return self
        ptr = libclover.lib().clover_engine_slot(self._engine(), int(i))
        if not ptr:
            raise BadInput(f"slot {i} is out of range: the model has {self.n_parallel} slots")
        view = Model.__new__(Model)
        view.__dict__.update(self.__dict__)
        view.ptr, view._slot_ptr, view._owner, view._active, view._lock = ptr, ptr, self, None, threading.Lock()
        return view

    def pass_stats(self) -> tuple[int, int]:
        """(passes, llama_decode rounds) the slots have run: more passes than rounds means passes of several slots
        ran batched together. (0, 0) with one slot."""
        passes, rounds = ctypes.c_int64(), ctypes.c_int64()
        libclover.lib().clover_engine_pass_stats(self._engine(), ctypes.byref(passes), ctypes.byref(rounds))
        return int(passes.value), int(rounds.value)

    def block_pass_stats(self) -> tuple[int, int]:
        """pass_stats for block passes only: more passes than rounds means windows of several slots shared a block
        pass (each with its own coreset top_p, spec 3.3). (0, 0) with one slot."""
        passes, rounds = ctypes.c_int64(), ctypes.c_int64()
        libclover.lib().clover_engine_block_pass_stats(self._engine(), ctypes.byref(passes), ctypes.byref(rounds))
        return int(passes.value), int(rounds.value)

    def last_error(self) -> str:
        msg = libclover.lib().clover_slot_last_error(self._handle())
        return msg.decode("utf-8", "replace") if msg else ""

    @property
    def llama_model(self) -> int:
        """The engine's ``llama_model *`` (for llama_cpp low-level calls)."""
        self._handle()
        return self._llama_model

    @property
    def llama_context(self) -> int:
        return libclover.lib().clover_engine_context(self._engine())

    @property
    def n_ctx(self) -> int:
        """The positions a history may use (``n_ctx`` resolved). llama.cpp's context can be larger: it is made
        at least n_batch long."""
        return int(libclover.lib().clover_engine_n_ctx(self._engine()))

    @property
    def max_block_size(self) -> int:
        """The largest block size this engine accepts, as the engine resolved it at load (``max_block_size``, or by
        default the largest of clover.block_size and the calibrated sizes)."""
        return int(libclover.lib().clover_engine_max_block_size(self._engine()))

    @property
    def llama_n_ctx(self) -> int:
        """The context llama.cpp allocated (at least n_batch)."""
        return int(loader.llama().llama_n_ctx(self.llama_context))

    # ---------------------------------------------------------------------------------- what passes cost
    def measure_pass_costs(self) -> PassCosts:
        """Measure what the passes cost now, on the scratch sequence (the history is not touched)."""
        c = libclover.clover_pass_costs()
        if libclover.lib().clover_slot_measure_costs(self._handle(), ctypes.byref(c)) != 0:
            raise EngineError(self.last_error() or "measuring pass costs failed")
        return PassCosts.from_c(c)

    @property
    def n_threads(self) -> int:
        """Threads the engine decodes with (``n_threads=0`` resolves to the usable physical cores)."""
        return int(libclover.lib().clover_engine_n_threads(self._engine()))

    @property
    def n_past(self) -> int:
        """Positions committed to the history (the pending token's position); 0 after a reset."""
        return int(libclover.lib().clover_slot_n_past(self._handle()))

    # ---------------------------------------------------------------------------------- tokens
    def tokenize(self, text: str, special: bool = True, add_special: bool = False) -> list[int]:
        """Text to token ids; ``special`` parses special tokens such as ``<|im_start|>``; ``add_special`` adds the
        vocabulary's BOS/EOS where it asks for them (llama_tokenize's add_special)."""
        try:
            return bindings.tokenize(self._vocab, text, add_special=add_special, parse_special=special)
        except loader.NativeError as exc:
            raise EngineError(str(exc)) from None

    def token_piece(self, token: int) -> bytes:
        """One token's bytes (special tokens rendered), which may be part of a UTF-8 character."""
        L = loader.llama()
        buf = ctypes.create_string_buffer(64)
        n = L.llama_token_to_piece(self._vocab, int(token), buf, len(buf), 0, True)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = L.llama_token_to_piece(self._vocab, int(token), buf, len(buf), 0, True)
        return buf.raw[:max(n, 0)]

    def detokenize(self, ids: Sequence[int], special: bool = True) -> str:
        """Token ids to text; ``special`` renders special tokens (as the reference's decode does)."""
        if not ids:
            return ""
        L = loader.llama()
        arr = (L.llama_token * len(ids))(*[int(t) for t in ids])
        cap = 16 * len(ids) + 64
        for _ in range(2):
            buf = ctypes.create_string_buffer(cap)
            n = L.llama_detokenize(self._vocab, arr, len(ids), buf, cap, False, special)
            if n >= 0:
                return buf.raw[:n].decode("utf-8", "replace")
            cap = -n + 1
        raise EngineError("llama_detokenize failed")

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        ids = self.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise BadInput("the prompt is empty; at least one token is needed (the last one is the pending token)")
        return ids

    # ---------------------------------------------------------------------------------- generation
    def generate(self, prompt: str | Sequence[int], params: GenParams | None = None, *,
                 on_step: Callable[[list[int]], Any] | None = None, buffer: int = 2, steps: bool = False,
                 **fields: Any) -> Generation:
        """Continue ``prompt`` on the engine's history; an iterator of committed token lists.

        ``params`` (default ``GenParams()``), with any of its fields given as keywords instead or on top
        (``mode="spec", max_tokens=32``). ``on_step(canvas)`` is called from the worker thread after each
        LowConfidence step (masked targets hold ``info.mask_token_id``); returning False cancels. ``steps=True``
        also delivers the canvases through ``Generation.events()``. A still-running previous generation is
        cancelled first.
        """
        self.close_active()
        call = _Call(self, self._prompt_ids(prompt), merge(params, fields), lambda _t: True, on_step)
        gen = Generation(call, buffer, steps)
        self._active = gen
        return gen

    def run(self, prompt: str | Sequence[int], params: GenParams | None = None, *,
            on_step: Callable[[list[int]], Any] | None = None, on_tokens: Callable[[list[int]], Any] | None = None,
            on_logprobs: Callable[[TokenLogprob], Any] | None = None, **fields: Any) -> Result:
        """Synchronous ``generate``: runs in the calling thread and returns all tokens and the stats.
        ``on_tokens(block)`` / ``on_step(canvas)`` returning False cancels. With ``logprobs``, ``on_logprobs``
        gets each token's ``TokenLogprob`` before ``on_tokens`` gets the token."""
        self.close_active()
        tokens: list[int] = []

        def push(block: list[int]) -> bool:
            tokens.extend(block)
            return True if on_tokens is None else on_tokens(block) is not False

        call = _Call(self, self._prompt_ids(prompt), merge(params, fields), push, on_step)
        call.on_logprobs = on_logprobs
        with self._lock:
            rc, wall = call.run()
        call.raise_for(rc)
        return Result(tokens, call.result_stats(wall), call.logprobs)

    def check_grammar(self, grammar: str) -> None:
        """Raise ``BadInput`` unless the GBNF grammar parses against this vocabulary and allows some token at
        its start (what a constrained call would refuse, found before it runs)."""
        err = ctypes.create_string_buffer(2048)
        if libclover.lib().clover_engine_check_grammar(self._engine(), grammar.encode(), None, err, len(err)) != 0:
            raise BadInput(err.value.decode(errors="replace"))

    def close_active(self) -> None:
        if getattr(self, "_active", None) is not None:
            active, self._active = self._active, None
            active.close()

    def reset(self) -> None:
        """Forget the history: the next generate starts with a fresh prefill."""
        self.close_active()
        libclover.lib().clover_slot_reset(self._handle())

    # ---------------------------------------------------------------------------------- prefix reuse
    def set_cache(self, ram_mib: float, checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY) -> None:
        """Keep recurrent-state checkpoints in up to ``ram_mib`` MiB of host memory (0 = none): at the end of
        each prefill and every ``checkpoint_every`` prefilled tokens (docs/serve.md, "Prefix reuse")."""
        if ram_mib < 0 or checkpoint_every < 0:
            raise BadInput("the cache size and the checkpoint interval must not be negative")
        libclover.lib().clover_slot_set_cache(self._handle(), int(ram_mib * 2**20), int(checkpoint_every))

    def reuse_prefix(self, prompt_ids: Sequence[int], checkpoint_at: Sequence[int] = ()) -> int:
        """Keep the longest prefix of the history that ``prompt_ids`` starts with and that a checkpoint can
        restore; forget the rest. Returns n: generate with ``prompt_ids[n:]`` to continue as if the whole
        prompt had been prefilled (0: a fresh history). ``checkpoint_at``: positions the coming prefill also
        checkpoints at, such as where the chat template's generation prompt starts (0s are ignored)."""
        self.close_active()
        h = self._handle()
        ids = (libclover.llama_token * len(prompt_ids))(*prompt_ids)
        reused = int(libclover.lib().clover_slot_reuse_prefix(h, ids, len(prompt_ids)))
        for pos in checkpoint_at:
            if pos > 0:
                libclover.lib().clover_slot_checkpoint_hint(h, int(pos))
        return reused

    def cache_info(self) -> CacheInfo:
        c = libclover.clover_cache_info()
        libclover.lib().clover_slot_cache_info(self._handle(), ctypes.byref(c))
        return CacheInfo(**{name: int(getattr(c, name)) for name, _ in c._fields_})

    # ---------------------------------------------------------------------------------- sessions
    def _single_slot(self, what: str) -> None:
        if self._owner is not None or self.n_parallel != 1:
            raise EngineError(f"{what} needs a model loaded with one slot (n_parallel=1)")

    def history_state(self) -> bytes:
        """The history's sequence state: ``llama_state_seq_get_data`` on sequence 0 with flags 0 (the attention
        KV entries and the recurrent state of positions [0, n_past)). With the tokens those positions hold,
        ``restore_history`` puts it back, in this engine or another one on the same GGUF."""
        self._single_slot("saving a session")
        self.close_active()
        L = loader.llama()
        ctx = self.llama_context
        n = self.n_past
        mem = L.llama_get_memory(ctx)
        lo, hi = int(L.llama_memory_seq_pos_min(mem, 0)), int(L.llama_memory_seq_pos_max(mem, 0))
        if n <= 0 or lo < 0 or hi != n - 1:  # a hybrid memory's pos_min is its recurrent cell's, at n - 1
            raise EngineError(f"the history's sequence holds positions [{lo}, {hi}], not the {n} committed ones")
        with self._lock:
            size = int(L.llama_state_seq_get_size(ctx, 0))
            buf = (ctypes.c_uint8 * max(1, size))()
            got = int(L.llama_state_seq_get_data(ctx, buf, size, 0)) if size else 0
        if size == 0 or got != size:
            raise EngineError("llama_state_seq_get_data could not save the history's state")
        return ctypes.string_at(buf, size)

    def restore_history(self, tokens: Sequence[int], state: bytes) -> None:
        """Replace the history with ``state`` (``history_state``) holding ``tokens``: the next prompt that extends
        them prefills only the rest (``reuse_prefix``). No tokens: a fresh history. On failure the engine is reset
        and ``EngineError`` raised."""
        self._single_slot("restoring a session")
        if len(tokens) + 1 > self.n_ctx:  # checked first: the history is still intact
            raise EngineError(f"a history of {len(tokens)} tokens does not fit the context size {self.n_ctx}")
        self.close_active()
        L, C = loader.llama(), libclover.lib()
        h = self._handle()
        C.clover_slot_reset(h)
        if not tokens:
            return
        if not state:
            raise EngineError("no engine state for a history of tokens")
        src = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        with self._lock:
            read = int(L.llama_state_seq_set_data(self.llama_context, src, len(state), 0))
            if read != len(state):
                C.clover_slot_reset(h)
                raise EngineError(f"llama.cpp read {read} of the {len(state)} bytes of engine state (a state from "
                                  "another model or context layout?); the engine was reset")
            ids = (libclover.llama_token * len(tokens))(*[int(t) for t in tokens])
            if C.clover_slot_set_history(h, ids, len(tokens)) != 0:
                raise EngineError(self.last_error() or "clover_slot_set_history failed")

    def _free(self, ptr: Any) -> None:
        self.close_active()
        if self._owner is None:  # a slot view's engine is freed by its owner
            libclover.lib().clover_engine_free(ptr)

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
