"""Importance matrices in llama.cpp's GGUF imatrix format (what `clover-cpp imatrix` and llama-imatrix
write), loaded the way llama-quantize loads them: per expert, in_sum2 / counts (1 where a count is 0)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGUFReader

from clover_common.errors import BadInput
from clover_common.input_files import IMATRIX, open_input

from .gguf_input import field_value

SUMS_SUFFIX = ".in_sum2"
COUNTS_SUFFIX = ".counts"


class ImatrixError(BadInput):
    """The importance matrix file is unusable; the message names the file and the field."""


@dataclass
class Imatrix:
    path: Path
    entries: dict[str, np.ndarray]          # weight name -> float32 [n_expert * ne0], the mean of x**2
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0


def load_imatrix(path: Path) -> Imatrix:
    """Read and normalise an imatrix GGUF (--imatrix). Raises ImatrixError naming the file and the field."""
    try:
        with open_input(path, IMATRIX, "--imatrix") as f:  # what gguf-py maps is the checked file
            reader = GGUFReader(f, "r")  # type: ignore[arg-type]
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise ImatrixError(f"{path}: not a GGUF imatrix file ({' '.join(str(exc).split())}); "
                           "make one with `clover-cpp imatrix`") from None
    kind = field_value(reader, "general.type")
    if kind != "imatrix":
        raise ImatrixError(f"{path}: general.type is {kind if kind is not None else 'missing'!r}, not 'imatrix'")
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        if t.name.endswith(SUMS_SUFFIX):
            sums[t.name[: -len(SUMS_SUFFIX)]] = np.asarray(t.data, dtype=np.float32).reshape(-1)
        elif t.name.endswith(COUNTS_SUFFIX):
            counts[t.name[: -len(COUNTS_SUFFIX)]] = np.asarray(t.data, dtype=np.float32).reshape(-1)
    if not sums:
        raise ImatrixError(f"{path}: holds no '*{SUMS_SUFFIX}' tensors")
    entries: dict[str, np.ndarray] = {}
    for name, s in sums.items():
        c = counts.get(name)
        if c is None:
            raise ImatrixError(f"{path}: tensor '{name}{SUMS_SUFFIX}' has no '{name}{COUNTS_SUFFIX}'")
        if c.size == 0 or s.size % c.size:
            raise ImatrixError(f"{path}: '{name}{SUMS_SUFFIX}' has {s.size} values, not a multiple of "
                               f"the {c.size} counts of '{name}{COUNTS_SUFFIX}'")
        per = s.reshape(c.size, -1)
        mean = np.where(c[:, None] > 0, per / np.maximum(c[:, None], 1.0), 1.0).astype(np.float32)
        if not np.isfinite(mean).all():
            raise ImatrixError(f"{path}: '{name}{SUMS_SUFFIX}' holds non-finite values")
        entries[name] = mean.reshape(-1)
    datasets = field_value(reader, "imatrix.datasets")
    return Imatrix(path, entries, [datasets] if isinstance(datasets, str) else list(datasets or []),
                   field_value(reader, "imatrix.chunk_count") or 0, field_value(reader, "imatrix.chunk_size") or 0)
