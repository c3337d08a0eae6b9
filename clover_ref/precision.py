"""Emulated backend arithmetic for the reference: what ggml's CUDA backend rounds, imitated in float32.

The reference computes everything in float32 (and causal passes one position at a time). The native
graph on a GPU does not: which kernel a mat-mul takes depends on the weight type and on how many rows
the pass has, and some kernels round their inputs. ``emulate(arith)`` makes the reference round the
same values the same way, so that a drift between the reference and a GPU run can be attributed
without a GPU (docs/native.md, "CUDA parity").

The dispatch rules are read from the pinned tree (ggml/src/ggml-cuda, F32 weights, FA compiled off):

- dense F32 mat-mul (``mul_mat``): ``mmvf`` (exact f32) up to 3 rows on Ampere and newer; ``mmf`` up to
  16 rows, which feeds the raw f32 bits to TF32 tensor-core MMA (the hardware keeps the top 19 bits:
  truncation); cuBLAS above, whose handle is in ``CUBLAS_TF32_TENSOR_OP_MATH`` (inputs rounded to TF32);
- F32 experts (``mul_mat_id``): ``mmf`` for every batch up to 512 tokens, a single token included;
- attention without flash attention: K·Q with F16 keys takes the queries in f16 beyond one row
  (f32 accumulation, the op asks for GGML_PREC_F32); P·V with F16 values takes P in f16 beyond one
  row, and above 16 rows goes through cuBLAS in ``CUBLAS_COMPUTE_16F`` (f16 accumulation, f16 result);
- the KV cache stores keys and values as f16 (on the CPU too).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Arithmetic:
    """Which reduced-precision paths to imitate. Row counts are those of one ubatch of the pass."""

    name: str
    kv_f16: bool = False               # keys and values stored as f16
    dense_tf32: bool = False           # dense mat-muls above dense_exact_max_rows rows see TF32 inputs
    dense_exact_max_rows: int = 3      # mmvf
    mmf_max_rows: int = 16             # mmf (truncating TF32) up to here, cuBLAS (rounding TF32) above
    experts_tf32: bool = False         # expert mat-muls see truncated TF32 inputs at any row count
    attn_f16: bool = False             # Q (K·Q) and P (P·V) rounded to f16 beyond one row
    pv_f16_acc_min_rows: int = 17      # P·V accumulated in f16 (cuBLAS COMPUTE_16F) from here
    f16_acc_chunk: int = 16            # k-width of one tensor-core MMA between two f16 roundings
    ubatch: int = 64                   # physical batch size of the native context

    def but(self, **changes: object) -> "Arithmetic":
        return replace(self, **changes)  # type: ignore[arg-type]


EXACT = Arithmetic("exact")
CPU_KV_F16 = Arithmetic("kv-f16", kv_f16=True)
HOPPER = Arithmetic("hopper", kv_f16=True, dense_tf32=True, experts_tf32=True, attn_f16=True)
PRESETS = {
    "exact": EXACT,
    "kv-f16": CPU_KV_F16,
    "dense-tf32": CPU_KV_F16.but(name="dense-tf32", dense_tf32=True),
    "experts-tf32": CPU_KV_F16.but(name="experts-tf32", experts_tf32=True),
    "attn-f16": CPU_KV_F16.but(name="attn-f16", attn_f16=True),
    "hopper": HOPPER,
    "hopper-no-tf32": HOPPER.but(name="hopper-no-tf32", dense_tf32=False, experts_tf32=False),
}

_active: Arithmetic = EXACT
_rows: int = 1


@contextlib.contextmanager
def emulate(arith: Arithmetic) -> Iterator[Arithmetic]:
    """Run the reference under ``arith`` inside the block (not thread-safe: a process-wide setting)."""
    global _active
    previous, _active = _active, arith
    try:
        yield arith
    finally:
        _active = previous


def active() -> Arithmetic:
    return _active


@contextlib.contextmanager
def pass_rows(rows: int) -> Iterator[None]:
    """The number of rows of the ubatch the native graph would compute the current position in."""
    global _rows
    previous, _rows = _rows, max(1, int(rows))
    try:
        yield
    finally:
        _rows = previous


def ubatch_rows(n_tokens: int, index: int) -> int:
    """Rows of the ubatch that holds token ``index`` when a pass of ``n_tokens`` is split by ``ubatch``."""
    size = max(1, _active.ubatch)
    start = (index // size) * size
    return min(size, n_tokens - start)


# ------------------------------------------------------------------------------------------ rounding
def tf32_truncate(x: torch.Tensor) -> torch.Tensor:
    """Keep 10 explicit mantissa bits by dropping the low 13 (what TF32 MMA does with raw f32 bits)."""
    bits = x.contiguous().view(torch.int32)
    return (bits & ~0x1FFF).view(torch.float32)


def tf32_round(x: torch.Tensor) -> torch.Tensor:
    """Round to 10 explicit mantissa bits, ties away from zero (cvt.rna.tf32.f32); finite inputs."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def f16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(torch.float32)


# ------------------------------------------------------------------------------------------ products
def _dense_cast() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The input rounding of an F32 ``mul_mat`` at the current row count: None (mmvf, exact), truncation
    (mmf) or rounding (cuBLAS)."""
    a = _active
    if not a.dense_tf32 or _rows <= a.dense_exact_max_rows:
        return None
    return tf32_truncate if _rows <= a.mmf_max_rows else tf32_round


def dense(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T for a dense weight (``mul_mat``)."""
    cast = _dense_cast()
    return F.linear(x, weight) if cast is None else F.linear(cast(x), cast(weight))


def expert(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T for one expert's matrix (``mul_mat_id``)."""
    if _active.experts_tf32:
        return F.linear(tf32_truncate(x), tf32_truncate(weight))
    return F.linear(x, weight)


def activations(equation: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """An einsum between two f32 activations (a ``mul_mat`` with an F32 src0, as dense)."""
    cast = _dense_cast()
    return torch.einsum(equation, a, b) if cast is None else torch.einsum(equation, cast(a), cast(b))


def cache_value(x: torch.Tensor) -> torch.Tensor:
    """A key or value as the KV cache stores it."""
    return f16(x) if _active.kv_f16 else x


def attention_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q [Tq, H, hd] . k [H, Tk, hd] -> [H, Tq, Tk] (K·Q with F16 keys, f32 accumulation)."""
    if _active.attn_f16 and _rows > 1:
        q = f16(q)
    return torch.einsum("qhd,hkd->hqk", q, k)


def attention_values(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """p [H, Tq, Tk] . v [H, Tk, hd] -> [Tq, H, hd] (P·V with F16 values)."""
    a = _active
    if not a.attn_f16 or _rows <= 1:
        return torch.einsum("hqk,hkd->qhd", p, v)
    p = f16(p)
    if _rows < a.pv_f16_acc_min_rows:
        return torch.einsum("hqk,hkd->qhd", p, v)
    acc = torch.zeros(p.shape[0], p.shape[1], v.shape[-1])
    for start in range(0, p.shape[-1], a.f16_acc_chunk):
        stop = start + a.f16_acc_chunk
        acc = f16(acc + torch.einsum("hqk,hkd->hqd", p[..., start:stop], v[:, start:stop]))
    return acc.transpose(0, 1)


class Linear(nn.Linear):
    """nn.Linear whose product follows the emulated arithmetic (same parameters and state-dict keys)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = dense(x, self.weight)
        return y if self.bias is None else y + self.bias
