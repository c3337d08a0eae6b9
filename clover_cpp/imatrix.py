"""Importance matrix with masked calibration (`clover-cpp imatrix`).

The collector is libclover's C++ eval callback (cpp_patch/tools/clover/clover-imatrix.{h,cpp}); it sums the
squared inputs of every `blk.*.weight` matmul and writes llama.cpp's imatrix GGUF, which llama-quantize
--imatrix and clover-quantize --imatrix read.

Masked calibration: the calibration text is cut into chunks of ``chunk_size`` tokens (the memory is cleared
between chunks) and each chunk is walked in segments of B tokens, B = the model's block size. Before a
segment is appended with a causal pass, the same positions run once as a block window on the scratch
sequence, the way LowConfidence decoding sees them: the first token is the pending token (always known); of the B
targets that the window predicts, a random fraction r ~ U(0, 1] (at least one) is still masked, and the
window inputs at those targets are the mask token; logits are asked for the rows predicting the masked
targets. Every token row thus passes once causally and once in a partly masked window, so block-mode
activations (mask embeddings, bidirectional attention, the GDN block path) are in the matrix. AR-only
calibration (``masked=False``) sees only the causal passes.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from clover_native import libclover, loader, bindings
from clover_native.loader import NativeError

_PROTOTYPES: dict[str, tuple[object, list[object]]] = {
    "clover_imatrix_init": (ctypes.c_void_p, []),
    "clover_imatrix_free": (None, [ctypes.c_void_p]),
    "clover_imatrix_end_chunk": (None, [ctypes.c_void_p]),
    "clover_imatrix_n_chunks": (ctypes.c_int32, [ctypes.c_void_p]),
    "clover_imatrix_n_entries": (ctypes.c_int32, [ctypes.c_void_p]),
    "clover_imatrix_n_calls": (ctypes.c_int64, [ctypes.c_void_p]),
    "clover_imatrix_last_error": (ctypes.c_char_p, [ctypes.c_void_p]),
    "clover_imatrix_save": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int32,
                                             ctypes.c_char_p, ctypes.c_size_t]),
}


def _lib() -> ctypes.CDLL:
    """libclover with the collector's prototypes declared (kept apart from engine's list, so a libclover
    without the collector still runs the engine)."""
    handle = libclover.lib()
    missing = [name for name in (*_PROTOTYPES, "clover_imatrix_eval_cb") if not hasattr(handle, name)]
    if missing:
        raise NativeError(f"{libclover.lib_path()} lacks {', '.join(missing)}: rebuild it with `make native`")
    for name, (restype, argtypes) in _PROTOTYPES.items():
        fn = getattr(handle, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return handle


class Collector(loader.NativeHandle):
    """The native importance-matrix collector; ``eval_callback`` goes to ``bindings.Context``."""

    def __init__(self) -> None:
        self._lib = _lib()
        self.ptr = self._lib.clover_imatrix_init()
        if not self.ptr:
            raise NativeError("clover_imatrix_init failed (out of memory)")
        address = ctypes.cast(self._lib.clover_imatrix_eval_cb, ctypes.c_void_p).value
        self.eval_callback = (loader.llama().ggml_backend_sched_eval_callback(address), ctypes.c_void_p(self.ptr))

    def end_chunk(self) -> None:
        self._lib.clover_imatrix_end_chunk(self.ptr)

    @property
    def n_chunks(self) -> int:
        return int(self._lib.clover_imatrix_n_chunks(self.ptr))

    @property
    def n_entries(self) -> int:
        return int(self._lib.clover_imatrix_n_entries(self.ptr))

    @property
    def n_calls(self) -> int:
        return int(self._lib.clover_imatrix_n_calls(self.ptr))

    def error(self) -> str | None:
        msg = self._lib.clover_imatrix_last_error(self.ptr)
        return None if msg is None else msg.decode("utf-8", "replace")

    def save(self, path: Path, dataset: str, chunk_size: int) -> None:
        """Atomic write (path.tmp, then rename)."""
        err = ctypes.create_string_buffer(1024)
        rc = self._lib.clover_imatrix_save(self.ptr, str(path).encode(), dataset.encode(), chunk_size, err, len(err))
        if rc != 0:
            raise NativeError(f"cannot write the importance matrix {path}: {err.value.decode('utf-8', 'replace')}")

    def _free(self, ptr: Any) -> None:
        self._lib.clover_imatrix_free(ptr)


def masked_window(segment: Sequence[int], mask_id: int, rng: np.random.Generator) -> tuple[list[int], list[int]]:
    """The block window for ``segment`` (its first token is the pending token) and the logit rows to ask for.

    Of the L = len(segment) targets the window predicts (offsets 1..L), ceil(r*L) with r ~ U(0, 1] are
    masked; window inputs at masked offsets (1..L-1) become ``mask_id``; row j-1 predicts target j."""
    n = len(segment)
    ratio = 1.0 - rng.random()  # (0, 1]
    n_masked = min(n, max(1, math.ceil(ratio * n)))
    masked = np.sort(rng.choice(n, size=n_masked, replace=False)) + 1  # target offsets in 1..n
    window = [int(t) for t in segment]
    for j in masked:
        if j < n:
            window[j] = mask_id
    return window, [int(j) - 1 for j in masked]


@dataclass
class ImatrixResult:
    path: Path
    n_entries: int
    n_chunks: int
    chunk_size: int
    block_size: int
    masked: bool
    n_tokens_file: int      # tokens in the calibration file
    n_tokens: int           # tokens processed (n_chunks * chunk_size)
    causal_rows: int        # token rows of causal passes
    block_rows: int         # token rows of block windows (= n_tokens when masked, else 0)
    masked_inputs: int      # window inputs replaced by the mask token
    block_output_rows: int  # logit rows asked in block windows
    seconds: float


def collect(model: bindings.LlamaModel, tokens: Sequence[int], out_path: str | os.PathLike[str], *,
            dataset: str, chunk_size: int = 512, max_chunks: int | None = None, block_size: int,
            masked: bool = True, seed: int = 0, n_threads: int | None = None,
            progress: bool = True, mask_id: int | None = None) -> ImatrixResult:
    """Run the calibration over ``tokens`` on ``model`` and write the imatrix GGUF to ``out_path``
    (``dataset`` is recorded in imatrix.datasets). Whole chunks only: a shorter tail is not used. ``mask_id``:
    the mask token (libclover's resolution: the GGUF's key, its sidecar's, else by name); None = the vocab's.

    The caller checks the options (``chunk_size``, ``block_size`` >= 1, at least one full chunk)."""
    from tqdm import tqdm

    n_chunks = len(tokens) // chunk_size
    if max_chunks is not None:
        n_chunks = min(n_chunks, max_chunks)
    if n_chunks < 1:
        raise ValueError(f"{len(tokens)} tokens do not fill one chunk of {chunk_size}")
    block_size = min(block_size, chunk_size)
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    causal_rows = block_rows = masked_inputs = block_output_rows = 0

    if mask_id is None:
        mask_id = model.mask_token()
    collector = Collector()
    # masked: B-token segments (a window, then its causal pass); AR-only: one causal pass per chunk.
    # llama.cpp needs n_batch >= n_seq_max (2) and a hybrid model n_ubatch > n_rs_seq + 1: floor both at 8.
    step = block_size if masked else chunk_size
    n_batch = max(step, 8)
    ctx = bindings.Context(model, n_ctx=chunk_size + block_size + 8, n_batch=n_batch,
                         n_ubatch=min(n_batch, max(8, block_size if masked else 512)), n_rs_seq=0,
                         n_threads=n_threads or None, eval_callback=collector.eval_callback)
    bar = tqdm(total=n_chunks * chunk_size, unit="tok", desc="imatrix", file=sys.stderr, disable=not progress,
               dynamic_ncols=True)
    try:
        for c in range(n_chunks):
            ctx.clear()
            chunk = tokens[c * chunk_size:(c + 1) * chunk_size]
            for s in range(0, chunk_size, step):
                segment = chunk[s:s + step]
                if masked:
                    window, rows = masked_window(segment, mask_id, rng)
                    ctx.block(window, rows)
                    block_rows += len(window)
                    masked_inputs += sum(1 for j in rows if j + 1 < len(window))
                    block_output_rows += len(rows)
                ctx.causal(segment, rows=[len(segment) - 1])
                causal_rows += len(segment)
                bar.update(len(segment))
            collector.end_chunk()
            err = collector.error()
            if err:
                raise NativeError(f"importance matrix collection failed: {err}")
        out = Path(out_path)
        collector.save(out, dataset, chunk_size)
        return ImatrixResult(path=out, n_entries=collector.n_entries, n_chunks=collector.n_chunks,
                             chunk_size=chunk_size, block_size=block_size, masked=masked,
                             n_tokens_file=len(tokens), n_tokens=n_chunks * chunk_size, causal_rows=causal_rows,
                             block_rows=block_rows, masked_inputs=masked_inputs,
                             block_output_rows=block_output_rows, seconds=time.perf_counter() - start)
    finally:
        bar.close()
        ctx.close()
        collector.close()
