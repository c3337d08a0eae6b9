"""How far two sets of logits are apart: the native parity tests' metric, and KL with top-1 agreement."""

from __future__ import annotations

import numpy as np


def parity(native_logits: np.ndarray, ref_logits: np.ndarray, rel: float) -> dict[str, float]:
    """Max |diff|, the tolerance rel * max(1, max|ref|), and top-1 mismatches where the ref's top-2 gap > tol."""
    a = np.asarray(native_logits, dtype=np.float64)
    b = np.asarray(ref_logits, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"logits of different shapes: {a.shape} and {b.shape}")
    diff = float(np.abs(a - b).max())
    scale = max(1.0, float(np.abs(b).max()))
    tol = rel * scale
    top2 = np.sort(b, axis=-1)[..., -2:]
    gap = top2[..., 1] - top2[..., 0]
    decisive = gap > tol
    mism = int(((a.argmax(-1) != b.argmax(-1)) & decisive).sum())
    return {"max_abs_diff": diff, "max_abs_ref": float(np.abs(b).max()), "tol": tol, "rel": diff / scale,
            "top1_mismatch_decisive": mism, "rows": int(a.shape[0])}


def kl_top1(ref: np.ndarray, q: np.ndarray) -> tuple[float, float]:
    """Mean KL(softmax(ref) || softmax(q)) over rows, and the share of rows with the same argmax."""
    def log_softmax(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float64) - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lp, lq = log_softmax(ref), log_softmax(q)
    return float((np.exp(lp) * (lp - lq)).sum(-1).mean()), float((ref.argmax(-1) == q.argmax(-1)).mean())
