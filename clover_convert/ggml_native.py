"""ggml's own quantizers and GGUF writer, called through ctypes from the patched build's libggml-base.

The one-pass converter quantizes with ``ggml_quantize_chunk`` (the function llama_model_quantize calls for
every chunk of rows) and lays out the output's header with gguf.cpp (the code llama_model_quantize writes it
with), so that its bytes are those of the two-step route. Both are plain C functions: a call releases the
GIL, so rows can be quantized on several Python threads at once.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from clover_native import loader
from clover_quantize.file_types import tensor_nbytes
from clover_common.errors import CloverError


class NativeQuantError(CloverError, RuntimeError):
    """ggml rejected the data or the header could not be built."""


class _GgufInitParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.POINTER(ctypes.c_void_p))]


_lib: ctypes.CDLL | None = None


def _bind() -> ctypes.CDLL:
    global _lib
    if _lib is not None:
        return _lib
    loader.llama()  # checks the build against this CPU and loads the libraries from lib_dir()
    lib = ctypes.CDLL(str(loader.lib_dir() / "libggml-base.so"))
    vp, cp, i64, sz = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int64, ctypes.c_size_t
    sigs: dict[str, tuple[object, list[object]]] = {
        "ggml_quantize_chunk": (sz, [ctypes.c_int, vp, vp, i64, i64, i64, vp]),
        "ggml_quantize_requires_imatrix": (ctypes.c_bool, [ctypes.c_int]),
        "ggml_validate_row_data": (ctypes.c_bool, [ctypes.c_int, vp, sz]),
        "ggml_get_tensor": (vp, [vp, cp]),
        "ggml_free": (None, [vp]),
        "gguf_init_empty": (vp, []),
        "gguf_init_from_file": (vp, [cp, _GgufInitParams]),
        "gguf_free": (None, [vp]),
        "gguf_set_kv": (None, [vp, vp]),
        "gguf_set_val_u32": (None, [vp, cp, ctypes.c_uint32]),
        "gguf_set_val_str": (None, [vp, cp, cp]),
        "gguf_remove_key": (i64, [vp, cp]),
        "gguf_add_tensor": (None, [vp, vp]),
        "gguf_set_tensor_type": (None, [vp, cp, ctypes.c_int]),
        "gguf_find_tensor": (i64, [vp, cp]),
        "gguf_get_tensor_offset": (sz, [vp, i64]),
        "gguf_get_tensor_size": (sz, [vp, i64]),
        "gguf_get_meta_size": (sz, [vp]),
        "gguf_get_alignment": (sz, [vp]),
        "gguf_get_meta_data": (None, [vp, vp]),
    }
    for name, (restype, argtypes) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    _lib = lib
    return lib


def requires_imatrix(qtype: GGMLQuantizationType) -> bool:
    """ggml cannot quantize to ``qtype`` without an importance matrix (the IQ1/IQ2/IQ3_XXS types)."""
    return bool(_bind().ggml_quantize_requires_imatrix(int(qtype)))


def quantize_rows(qtype: GGMLQuantizationType, values: np.ndarray, out: np.ndarray,
                  imatrix: np.ndarray | None) -> None:
    """Quantize the float32 rows ``values`` [nrows, n_per_row] into ``out`` (uint8, exactly their size) with
    ``ggml_quantize_chunk``, and validate the result as llama_model_quantize does."""
    lib = _bind()
    nrows, n_per_row = values.shape
    assert values.dtype == np.float32 and values.flags.c_contiguous
    assert out.dtype == np.uint8 and out.flags.c_contiguous and out.size == tensor_nbytes(qtype, (n_per_row, nrows))
    im = None
    if imatrix is not None:
        assert imatrix.dtype == np.float32 and imatrix.size == n_per_row
        im = imatrix.ctypes.data
    size = lib.ggml_quantize_chunk(int(qtype), values.ctypes.data, out.ctypes.data, 0, nrows, n_per_row, im)
    if size != out.size or not lib.ggml_validate_row_data(int(qtype), out.ctypes.data, size):
        raise NativeQuantError(f"quantized data validation failed ({qtype.name}, {nrows} rows of {n_per_row})")


@dataclass(frozen=True)
class QuantizedHeader:
    """The output's header bytes (key/values, tensor infos, padding) and each tensor's data offset (from the
    start of the file) and size."""

    meta: bytes
    offsets: dict[str, int]
    sizes: dict[str, int]
    alignment: int


def quantized_header(skeleton: Path, tensors: Sequence[tuple[str, GGMLQuantizationType]], file_type: int,
                     quantization_version: int, overrides: Sequence[tuple[str, str | int]]) -> QuantizedHeader:
    """The header llama_model_quantize writes for ``skeleton`` (the header of the unquantized file): its
    key/values, then general.quantization_version and general.file_type, no split keys, then ``overrides``
    (ints as u32, as llama.cpp stores integer overrides), and the tensors in ``tensors`` order with their new
    types. Mirrors the header code of llama_model_quantize_impl step by step, with the same gguf.cpp calls."""
    lib = _bind()
    ggml_ctx = ctypes.c_void_p()
    src = lib.gguf_init_from_file(str(skeleton).encode(), _GgufInitParams(True, ctypes.pointer(ggml_ctx)))
    if not src:
        raise NativeQuantError(f"{skeleton}: gguf.cpp cannot read the header")
    out = lib.gguf_init_empty()
    try:
        lib.gguf_set_kv(out, src)
        lib.gguf_set_val_u32(out, b"general.quantization_version", quantization_version)
        lib.gguf_set_val_u32(out, b"general.file_type", file_type)
        for key in (b"split.no", b"split.count", b"split.tensors.count"):
            lib.gguf_remove_key(out, key)
        for key, value in overrides:
            name = key.encode()[:127]  # llama_model_kv_override holds char key[128] and char val_str[128]
            if isinstance(value, int):
                lib.gguf_set_val_u32(out, name, abs(value))
            else:
                lib.gguf_set_val_str(out, name, value.encode()[:127])
        for name, _ in tensors:
            tensor = lib.ggml_get_tensor(ggml_ctx, name.encode())
            if not tensor:
                raise NativeQuantError(f"{skeleton}: no tensor {name}")
            lib.gguf_add_tensor(out, tensor)
        for name, qtype in tensors:
            lib.gguf_set_tensor_type(out, name.encode(), int(qtype))
        meta_size = lib.gguf_get_meta_size(out)
        buf = ctypes.create_string_buffer(meta_size)
        lib.gguf_get_meta_data(out, buf)
        offsets, sizes = {}, {}
        for name, _ in tensors:
            i = lib.gguf_find_tensor(out, name.encode())
            offsets[name] = meta_size + lib.gguf_get_tensor_offset(out, i)
            sizes[name] = lib.gguf_get_tensor_size(out, i)
        return QuantizedHeader(buf.raw, offsets, sizes, lib.gguf_get_alignment(out))
    finally:
        lib.gguf_free(out)
        lib.gguf_free(src)
        if ggml_ctx.value:
            lib.ggml_free(ggml_ctx)
