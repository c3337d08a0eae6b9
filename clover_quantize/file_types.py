"""The quantization types clover-quantize offers: llama.cpp file types (mixes) and single ggml tensor types."""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from clover_common.errors import BadInput


class UnknownTypeError(BadInput):
    """A type name that is not in the table; the message lists the valid ones."""


@dataclass(frozen=True)
class FileType:
    """A llama.cpp file type: ``ftype`` is the llama_ftype value passed to llama_model_quantize."""

    name: str
    ftype: int
    description: str
    wants_imatrix: bool = False


# llama_ftype values from llama.h (LLAMA_FTYPE_MOSTLY_*). As in llama-quantize, IQ4_NL and IQ4_XS are allowed
# without an importance matrix (ggml quantizes them without one; only IQ1/IQ2/IQ3_XXS cannot) and warn, since an
# imatrix improves them most.
FILE_TYPES: tuple[FileType, ...] = (
    FileType("F32", 0, "32-bit float, no quantization"),
    FileType("F16", 1, "16-bit float"),
    FileType("BF16", 32, "bfloat16"),
    FileType("Q8_0", 7, "8.5 bits per weight, near lossless"),
    FileType("Q6_K", 18, "6.56 bpw K-quant"),
    FileType("Q5_K_M", 17, "5.5 bpw K-quant mix, Q6_K for half of attn_v/ffn_down"),
    FileType("Q5_K_S", 16, "5.5 bpw K-quant"),
    FileType("Q5_0", 8, "5.5 bpw legacy"),
    FileType("Q4_K_M", 15, "4.8 bpw K-quant mix, Q6_K for half of attn_v/ffn_down (the usual INT4 choice)"),
    FileType("Q4_K_S", 14, "4.5 bpw K-quant"),
    FileType("Q4_0", 2, "4.5 bpw legacy"),
    FileType("Q3_K_M", 12, "3.9 bpw K-quant mix"),
    FileType("IQ4_NL", 25, "4.5 bpw non-linear, best with an importance matrix", wants_imatrix=True),
    FileType("IQ4_XS", 30, "4.25 bpw non-linear, best with an importance matrix", wants_imatrix=True),
)

_BY_NAME = {t.name: t for t in FILE_TYPES}


def file_type(name: str) -> FileType:
    """The file type called ``name`` (case-insensitive)."""
    key = name.strip().upper()
    if key not in _BY_NAME:
        raise UnknownTypeError(f"unknown quantization type '{name}'; choose one of {', '.join(_BY_NAME)}")
    return _BY_NAME[key]


# ggml tensor types a user may name in --tensor-type, --output-tensor-type and --token-embedding-type
TENSOR_TYPES: tuple[str, ...] = (
    "F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K", "Q5_0", "Q5_1", "Q4_K", "Q4_0", "Q4_1", "Q3_K", "Q2_K",
    "IQ4_NL", "IQ4_XS",
)


def tensor_type(name: str) -> GGMLQuantizationType:
    """A ggml tensor type by name (case-insensitive), e.g. ``q8_0`` or ``Q6_K``."""
    key = name.strip().upper()
    if key not in TENSOR_TYPES:
        raise UnknownTypeError(f"unknown tensor type '{name}'; choose one of {', '.join(TENSOR_TYPES)}")
    return GGMLQuantizationType[key]


def is_quantized(t: GGMLQuantizationType) -> bool:
    """True for block-quantized types (everything but the float and integer types)."""
    return t not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
                     GGMLQuantizationType.F64, GGMLQuantizationType.I8, GGMLQuantizationType.I16,
                     GGMLQuantizationType.I32, GGMLQuantizationType.I64)


def tensor_nbytes(t: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of ggml type ``t`` and shape ``shape`` (ne0 first); ne0 must fill whole blocks."""
    block, size = GGML_QUANT_SIZES[t]
    n = 1
    for d in shape:
        n *= int(d)
    if int(shape[0]) % block:
        raise ValueError(f"ne0={shape[0]} is not a multiple of {t.name}'s block of {block}")
    return n // block * size
