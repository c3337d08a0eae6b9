"""The raw llama.cpp API for the patched build: a loaded model (``LlamaModel``) and a context with the
engine's sequence layout (``Context``: causal passes on the history, block passes on a scratch copy). Tests, the
importance-matrix collector and the benches drive passes one by one through it; ``clover_cpp.model`` drives the
engine instead.

Block passes use libclover's ``clover_block_decode``, whose protocol lives once, in libllama
(``llama_clover_block_begin`` / ``_end``, src/llama-clover.h): ``seq_cp(0 -> 1)`` with seq 0's coreset top_p,
``causal_attn = false``, decode the window on seq 1 with logits only for the requested rows, ``causal_attn`` back,
``seq_rm(1)``. The committed history (seq 0: KV cells, conv and delta-rule state) is never written.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import libclover
from .loader import NativeError, NativeHandle, env_int, error_reasons, llama, logged_errors, recent_log

HISTORY_SEQ = 0
SCRATCH_SEQ = 1
# Clover's per-sequence graph parameters (src/llama-clover.h: LLAMA_CLOVER_PARAM_*)
CORESET_TOP_P = "clover.coreset_top_p"
FUSED_WINDOW = "clover.fused_window"


def tokenize(vocab: Any, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
    """Token ids of ``text`` with a llama_vocab pointer, growing the buffer when llama_tokenize asks."""
    L = llama()
    data = text.encode("utf-8")
    cap = len(data) + 16
    toks = (L.llama_token * cap)()
    n = L.llama_tokenize(vocab, data, len(data), toks, cap, add_special, parse_special)
    if n < 0:
        cap = -n
        toks = (L.llama_token * cap)()
        n = L.llama_tokenize(vocab, data, len(data), toks, cap, add_special, parse_special)
    if n < 0:
        raise NativeError("llama_tokenize failed")
    return [int(t) for t in toks[:n]]


def check_model(path: str | os.PathLike[str]) -> None:
    """Load ``path`` as llama.cpp would, without reading or allocating the weights (``no_alloc``): every check of
    the loader and of the model's architecture runs. Raises NativeError with llama.cpp's reason."""
    L = llama()
    params = L.llama_model_default_params()
    params.no_alloc = True
    params.load_mode = L.LLAMA_LOAD_MODE_NONE  # the no_alloc pass maps nothing (llama.cpp asserts otherwise)
    params.n_gpu_layers = 0
    with logged_errors() as errors:
        ptr = L.llama_model_load_from_file(str(path).encode(), params)
    if not ptr:
        raise NativeError(f"{path}: llama.cpp cannot load it: {error_reasons(errors) or 'unknown error'}")
    L.llama_model_free(ptr)


class LlamaModel(NativeHandle):
    """A loaded GGUF model (CPU unless n_gpu_layers / $CLOVER_N_GPU_LAYERS offloads layers)."""

    def __init__(self, path: str | os.PathLike[str], n_gpu_layers: int | None = None,
                 use_extra_bufts: bool = True, bd_path: str | os.PathLike[str] | None = None) -> None:
        """``bd_path``: a block-diffusion sidecar (spec 5) attached to a trunk-only file after the load (the
        caller checks its fingerprint first: libclover.read_model_info)."""
        L = llama()
        params = L.llama_model_default_params()
        if n_gpu_layers is None:
            n_gpu_layers = env_int("CLOVER_N_GPU_LAYERS", 0)
        params.n_gpu_layers = n_gpu_layers
        params.use_extra_bufts = use_extra_bufts
        params.use_mmap = True
        self.path = str(path)
        with logged_errors() as errors:
            self.ptr = L.llama_model_load_from_file(self.path.encode(), params)
        if not self.ptr:
            raise NativeError(f"failed to load {self.path}: {error_reasons(errors) or 'unknown error'}")
        self.vocab = L.llama_model_get_vocab(self.ptr)
        self.n_vocab = int(L.llama_vocab_n_tokens(self.vocab))
        if bd_path is not None:
            self._attach_block_diffusion(bd_path)

    def _attach_block_diffusion(self, bd_path: str | os.PathLike[str]) -> None:
        lib = llama().llama_cpp._lib
        fn = lib.llama_clover_attach_block_diffusion
        fn.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
        fn.restype = ctypes.c_bool
        err = ctypes.create_string_buffer(2048)
        if not fn(self.ptr, os.fsencode(bd_path), err, len(err)):
            message = err.value.decode("utf-8", "replace")
            self.close()
            raise NativeError(message)

    def has_block_diffusion(self) -> bool:
        """Whether the file holds the block-diffusion tensors (llama_clover_has_block_diffusion)."""
        lib = llama().llama_cpp._lib
        lib.llama_clover_has_block_diffusion.argtypes = [ctypes.c_void_p]
        lib.llama_clover_has_block_diffusion.restype = ctypes.c_bool
        return bool(lib.llama_clover_has_block_diffusion(self.ptr))

    def meta(self, key: str) -> str | None:
        """A metadata value as llama.cpp stringifies it (no arrays)."""
        L = llama()
        buf = ctypes.create_string_buffer(1024)
        n = L.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return None if n < 0 else buf.value.decode()

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        return tokenize(self.vocab, text, add_special, parse_special)

    def mask_token(self) -> int:
        return int(llama().llama_vocab_mask(self.vocab))

    def _free(self, ptr: Any) -> None:
        llama().llama_model_free(ptr)


def _put(batch: Any, i: int, token: int, pos: int, seq: int, output: bool) -> None:
    """Row ``i`` of a llama_batch: ``token`` at ``pos`` of sequence ``seq``, its logits kept when ``output``."""
    batch.token[i] = int(token)
    batch.pos[i] = pos
    batch.n_seq_id[i] = 1
    batch.seq_id[i][0] = seq
    batch.logits[i] = 1 if output else 0


class Context(NativeHandle):
    """A context on ``LlamaModel`` with two sequences (0 = history, 1 = scratch) and a unified KV cache."""

    def __init__(self, model: LlamaModel, n_ctx: int = 1024, n_batch: int = 512, n_ubatch: int = 64,
                 n_rs_seq: int = 0, n_threads: int | None = None,
                 eval_callback: tuple[Any, Any] | None = None, flash_attn: bool | None = None,
                 op_offload: bool = True, n_seq_max: int = 2) -> None:
        """``eval_callback``: an optional (ggml_backend_sched_eval_callback, user data) pair set as
        ``cb_eval`` / ``cb_eval_user_data`` (e.g. libclover's importance-matrix collector); it is kept
        referenced for the context's lifetime. ``flash_attn``: None = llama.cpp's auto, else on or off.
        ``op_offload``: llama.cpp's default (True) lets the scheduler run large batches of host-resident weights
        on a GPU device when the build has one; False keeps a CPU-only model (n_gpu_layers 0) on the CPU."""
        L = llama()
        p = L.llama_context_default_params()
        self._eval_callback = eval_callback  # the C side holds only raw pointers
        if eval_callback is not None:
            p.cb_eval = eval_callback[0]
            p.cb_eval_user_data = eval_callback[1]
        p.n_ctx = n_ctx
        p.n_batch = n_batch
        p.n_ubatch = n_ubatch
        p.n_seq_max = n_seq_max  # the engine's layout: 2 per slot (history, scratch)
        p.kv_unified = True
        p.n_rs_seq = n_rs_seq
        p.op_offload = op_offload
        if flash_attn is not None:  # enum llama_flash_attn_type: -1 auto, 0 disabled, 1 enabled
            p.flash_attn_type = 1 if flash_attn else 0
        threads = n_threads or env_int("CLOVER_THREADS", 0) or default_threads()
        p.n_threads = threads
        p.n_threads_batch = threads
        self.model = model
        self.n_ubatch = n_ubatch
        self.ptr = L.llama_init_from_model(model.ptr, p)
        if not self.ptr:
            raise NativeError("llama_init_from_model failed: " + recent_log()[-500:])
        self.mem = L.llama_get_memory(self.ptr)
        self.n_rs_seq = int(L.llama_n_rs_seq(self.ptr))

    # -- low level ------------------------------------------------------------------------------
    def _decode(self, tokens: Sequence[int], pos0: int, seq: int, rows: Sequence[int],
                decode: Callable[[Any, Any], int] | None = None) -> np.ndarray:
        """One batch at positions pos0 .. on ``seq``; float32 logits of ``rows``. ``decode(ctx, batch_ptr)``
        replaces llama_decode (the block-pass protocol)."""
        L = llama()
        n = len(tokens)
        if n == 0:
            raise ValueError("empty batch")
        want = set(int(r) for r in rows)
        batch = L.llama_batch_init(n, 0, 1)
        try:
            for i, t in enumerate(tokens):
                _put(batch, i, t, pos0 + i, seq, i in want)
            batch.n_tokens = n
            rc = L.llama_decode(self.ptr, batch) if decode is None else decode(self.ptr, ctypes.addressof(batch))
            if rc != 0:
                raise NativeError(f"llama_decode returned {rc}")
            return self._logits(rows)
        finally:
            L.llama_batch_free(batch)

    def _logits(self, rows: Sequence[int]) -> np.ndarray:
        """The float32 logits of the last decoded batch's ``rows``."""
        L = llama()
        out = np.empty((len(rows), self.model.n_vocab), dtype=np.float32)
        for k, r in enumerate(rows):
            ptr = L.llama_get_logits_ith(self.ptr, int(r))
            out[k] = np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,))
        return out

    def pos_max(self, seq: int = HISTORY_SEQ) -> int:
        return int(llama().llama_memory_seq_pos_max(self.mem, seq))

    def set_seq_param(self, seq: int, name: str, value: float) -> None:
        """Sequence ``seq``'s value of the model's graph parameter ``name`` on this context (llama_set_seq_param:
        src/llama-clover.h names Clover's); NaN clears it. NativeError for a sequence id out of range."""
        lib = llama().llama_cpp._lib
        lib.llama_set_seq_param.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_char_p, ctypes.c_float]
        lib.llama_set_seq_param.restype = ctypes.c_bool
        if not lib.llama_set_seq_param(self.ptr, int(seq), name.encode(), float(value)):
            raise NativeError(f"llama_set_seq_param refused sequence {seq}, {name!r}")

    def seq_param(self, seq: int, name: str) -> float:
        """Sequence ``seq``'s value of ``name`` (NaN when it has none)."""
        lib = llama().llama_cpp._lib
        lib.llama_get_seq_param.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_char_p]
        lib.llama_get_seq_param.restype = ctypes.c_float
        return float(lib.llama_get_seq_param(self.ptr, int(seq), name.encode()))

    def set_coreset_top_p(self, top_p: float | None, seq: int = HISTORY_SEQ) -> None:
        """The block expert coreset top_p (spec 3.3) of sequence ``seq``'s block passes (by default the history's:
        ``block`` copies it to the scratch sequence it runs on); None: the GGUF's value. A reused graph reads it at
        every pass. NativeError outside (0, 1]."""
        if top_p is not None and not 0.0 < top_p <= 1.0:
            raise NativeError(f"coreset_top_p must be in (0, 1], got {top_p!r}")
        self.set_seq_param(seq, CORESET_TOP_P, float("nan") if top_p is None else top_p)


    # -- API ------------------------------------------------------------------------------------
    def causal(self, tokens: Sequence[int], rows: Sequence[int] | None = None) -> np.ndarray:
        """Causal pass appending ``tokens`` to the history; float32 logits [len(rows), n_vocab]
        (all rows by default; row i predicts the token after tokens[i])."""
        pos0 = self.pos_max(HISTORY_SEQ) + 1
        rows = list(range(len(tokens))) if rows is None else list(rows)
        return self._decode(tokens, pos0, HISTORY_SEQ, rows)

    def block(self, window: Sequence[int], rows: Sequence[int] | None = None) -> np.ndarray:
        """Block pass on a scratch copy of the history: window at positions [p, p+B), p = history
        length; logits for ``rows`` (window indices; all by default). History is left untouched."""
        b = len(window)
        if b > self.n_ubatch:
            raise ValueError(f"block window of {b} does not fit n_ubatch={self.n_ubatch}")
        rows = list(range(b)) if rows is None else list(rows)
        pos0 = self.pos_max(HISTORY_SEQ) + 1
        return self._decode(window, pos0, SCRATCH_SEQ, rows, decode=libclover.lib().clover_block_decode)

    def fused(self, tokens: Sequence[int], window: Sequence[int],
              keep: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """A fused pass (the history's LLAMA_CLOVER_PARAM_FUSED_WINDOW): ``tokens`` appended to the history causally
        and, in the same ubatch, a block window right after them over the history and those tokens; the window's
        cells are removed afterwards with one rollback to ``keep`` (default: the end of ``tokens``; the engine keeps
        less after a rejected draft). Float32 logits of every causal row and every window row. Needs n_rs_seq >= the
        rows removed and one ubatch for both."""
        n = len(tokens) + len(window)
        if n > self.n_ubatch:
            raise ValueError(f"a fused pass of {n} rows does not fit n_ubatch={self.n_ubatch}")
        if not self.model.has_block_diffusion():
            raise NativeError("a fused pass needs the block-diffusion tensors (a trunk-only file has none)")
        pos0 = self.pos_max(HISTORY_SEQ) + 1
        self.set_seq_param(HISTORY_SEQ, FUSED_WINDOW, len(window))
        try:
            out = self._decode(list(tokens) + list(window), pos0, HISTORY_SEQ, range(n))
        finally:
            self.set_seq_param(HISTORY_SEQ, FUSED_WINDOW, float("nan"))
        self.rollback(pos0 + len(tokens) if keep is None else keep)
        return out[:len(tokens)], out[len(tokens):]

    def causal_seqs(self, parts: Sequence[tuple[int, Sequence[int]]]) -> list[np.ndarray]:
        """One causal batch of several sequences, in the order given: each (seq, tokens) appended to its sequence;
        the float32 logits of every row, per part. llama.cpp splits the batch into ubatches as it would a server's."""
        L = llama()
        n = sum(len(tokens) for _, tokens in parts)
        if n == 0 or any(len(tokens) == 0 for _, tokens in parts):
            raise ValueError("every part needs at least one token")
        batch = L.llama_batch_init(n, 0, 1)
        try:
            rows: list[range] = []  # each part's rows of the batch
            for seq, tokens in parts:
                start = rows[-1].stop if rows else 0
                rows.append(range(start, start + len(tokens)))
                pos0 = self.pos_max(seq) + 1
                for k, t in enumerate(tokens):
                    _put(batch, start + k, t, pos0 + k, seq, True)
            batch.n_tokens = n
            rc = L.llama_decode(self.ptr, batch)
            if rc != 0:
                raise NativeError(f"llama_decode returned {rc}")
            return [self._logits(r) for r in rows]
        finally:
            L.llama_batch_free(batch)

    def rollback(self, keep: int, seq: int = HISTORY_SEQ) -> None:
        """Keep positions [0, keep) of ``seq``; needs n_rs_seq >= the number of removed positions."""
        ok = llama().llama_memory_seq_rm(self.mem, seq, keep, -1)
        if not ok:
            raise NativeError(f"seq_rm({seq}, {keep}, -1) refused (n_rs_seq={self.n_rs_seq})")

    def clear(self) -> None:
        llama().llama_memory_clear(self.mem, True)

    def _free(self, ptr: Any) -> None:
        llama().llama_free(ptr)


def default_threads() -> int:
    """The engine's default thread count: the physical cores this process may use (libclover)."""
    return int(libclover.lib().clover_default_n_threads())
