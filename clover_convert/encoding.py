"""Turning a chunk of source rows into GGUF bytes: decode, reorder columns, transform, encode.

Encoding uses the block quantizers of ``gguf.quants`` (``quantize_blocks``), the code llama.cpp's converter
runs; its BF16 and Q8_0 are bit-identical to ggml's. They are applied to slices of about a million values
rather than 16 rows at a time, which gives the same bytes (every block is independent) with less Python
overhead, lets numpy release the GIL for threads, and bounds the temporaries. Where the result is provably
the same, a plain copy is used instead: BF16 to BF16, F16 to F16 and F32 to F32 (BF16 NaNs are quieted
as ggml's fp32-to-bf16 does).
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from clover_quantize.file_types import tensor_nbytes

from .tensor_plan import Transform

# numpy dtype holding the raw bits of each supported source dtype
RAW_DTYPES = {"BF16": np.dtype("<u2"), "F16": np.dtype("<f2"), "F32": np.dtype("<f4")}
_COPYABLE = {("BF16", GGMLQuantizationType.BF16), ("F16", GGMLQuantizationType.F16),
             ("F32", GGMLQuantizationType.F32)}
_BLOCK_QUANTIZERS = {GGMLQuantizationType.BF16: quants.BF16, GGMLQuantizationType.Q8_0: quants.Q8_0}
SLICE_ELEMENTS = 1 << 20


def to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Widen raw source values to float32 (exact for BF16, F16 and F32)."""
    if dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32, copy=False)


def apply_transform(values: np.ndarray, transform: Transform) -> np.ndarray:
    if transform is Transform.ADD_ONE:
        return values + np.float32(1.0)
    if transform is Transform.NEG_EXP:  # exp in float64, then rounded: the float32 nearest the true value
        return (-np.exp(values.astype(np.float64))).astype(np.float32)
    return values


def encode_chunk(raw: np.ndarray, dtype: str, rows: int, row_length: int, transform: Transform,
                 column_order: np.ndarray | None, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """GGUF bytes for ``rows`` rows of ``row_length`` source values (``raw`` holds them row-major)."""
    raw = raw.reshape(rows, row_length)
    if column_order is not None:
        raw = raw[:, column_order]
    if transform is Transform.NONE and (dtype, ggml_type) in _COPYABLE:
        return _quiet_bf16_nans(raw) if dtype == "BF16" else raw
    out = np.empty(tensor_nbytes(ggml_type, (row_length, rows)), dtype=np.uint8)
    out_row_bytes = out.size // rows
    slice_rows = max(1, SLICE_ELEMENTS // row_length)
    for first in range(0, rows, slice_rows):
        last = min(rows, first + slice_rows)
        values = apply_transform(to_float32(raw[first:last], dtype), transform)
        out[first * out_row_bytes:last * out_row_bytes] = _encode_values(values, ggml_type)
    return out


def _encode_values(values: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """The bytes of float32 ``values`` (whole rows) in ``ggml_type``, as gguf.quants.quantize gives them."""
    if ggml_type == GGMLQuantizationType.F32:
        return values.astype(np.float32, copy=False).reshape(-1).view(np.uint8)
    if ggml_type == GGMLQuantizationType.F16:
        return values.astype(np.float16).reshape(-1).view(np.uint8)
    quantizer = _BLOCK_QUANTIZERS[ggml_type]
    block, _ = GGML_QUANT_SIZES[ggml_type]
    blocks = np.ascontiguousarray(values, dtype=np.float32).reshape(-1, block)
    return quantizer.quantize_blocks(blocks).reshape(-1)


def _quiet_bf16_nans(raw: np.ndarray) -> np.ndarray:
    """What BF16 -> F32 -> BF16 through ggml's converter does to a BF16 NaN: set its quiet bit."""
    nan = (raw & 0x7FFF) > 0x7F80
    if nan.any():
        raw = np.where(nan, raw | 0x0040, raw).astype(np.uint16)
    return raw
