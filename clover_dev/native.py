"""Passes of the native engine that the parity tests and the benchmarks read: causal and block logits of documents,
the parity tests' block windows, and the weight buffer types llama.cpp allocates. clover_native is imported when a
pass runs, so this module imports without the native build."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

Windows = list[tuple[int, list[int]]]  # (segment boundary p, masked rows of the window starting at p)
_BUFFER = re.compile(r"(\S+) model buffer size")


def causal_and_block_logits(path: Path, docs: list[tuple[list[int], Windows]], window: int,
                            use_extra_bufts: bool = True, router: Any = None,
                            bd_path: Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """For each (tokens, windows) document, on a fresh history: the causal logits of every position (the
    tokens appended segment by segment) and, at each boundary p, the block logits of the masked rows of
    the window tokens[p:p+window] over the history tokens[:p]. Rows of all documents, concatenated.
    ``use_extra_bufts=False`` loads the weights without AMX or repacked layouts. ``router``: an object with
    ``eval_callback`` and ``end_pass`` (tests/support/routing.py's NativeRouterMargins) that collects the native
    routing margins of the same rows. ``bd_path``: a block-diffusion sidecar for a trunk-only ``path``."""
    from clover_native import bindings

    model = bindings.LlamaModel(path, use_extra_bufts=use_extra_bufts, bd_path=bd_path)
    ctx = bindings.Context(model, n_ctx=1024, n_ubatch=64, n_batch=512,
                           eval_callback=router.eval_callback if router else None)
    mask = model.mask_token()
    causal, block = [], []

    def run_causal(ids: list[int]) -> None:
        causal.append(ctx.causal(ids))
        if router:
            router.end_pass("causal", len(ids))

    try:
        for tokens, windows in docs:
            ctx.clear()
            done = 0
            for p, masked in windows:
                run_causal(tokens[done:p])
                done = p
                canvas = [mask if j in masked else t for j, t in enumerate(tokens[p:p + window])]
                block.append(ctx.block(canvas, rows=masked))
                if router:
                    router.end_pass("block", len(canvas), masked)
            run_causal(tokens[done:])
        return np.concatenate(causal), np.concatenate(block)
    finally:
        ctx.close()
        model.close()


def block_window(ids: list[int], p: int, b: int, canvas: str, mask: int) -> list[int]:
    """The window at p of the parity tests: seed ids[p], then B-1 canvas slots (``masked``: all mask;
    ``filled``: the true tokens; ``partly``: every other one masked)."""
    known = ids[p + 1:p + b]
    if canvas == "masked":
        rest = [mask] * (b - 1)
    elif canvas == "filled":
        rest = list(known)
    else:
        rest = [t if i % 2 == 0 else mask for i, t in enumerate(known)]
    return [ids[p]] + rest


def buffer_types(path: Path, use_extra_bufts: bool) -> list[str]:
    """The weight buffer types llama.cpp reports at load (CPU_Mapped, CPU_REPACK, AMX, ...)."""
    from clover_native import bindings, loader

    seen: list[str] = []
    with loader.log_listener(lambda _level, line: seen.extend(m.group(1) for m in _BUFFER.finditer(line))):
        bindings.LlamaModel(path, use_extra_bufts=use_extra_bufts).close()
    return sorted(set(seen))
