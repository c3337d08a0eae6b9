"""Streaming tensor data from safetensors files into the GGUF writer, one bounded chunk at a time.

A chunk is a run of whole rows of one GGUF tensor, at most ``CHUNK_ELEMENTS`` values (64 MiB as float32),
or one row when a row is longer. Its source bytes are read with ``pread`` into a fresh buffer (no mmap, so
file pages never count towards the process's memory), encoded, written and dropped. With ``threads`` > 1,
up to ``threads`` chunks are read and encoded ahead in worker threads while the main thread writes.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable, Iterator

import numpy as np

from clover_common.errors import CloverInputError
from clover_common.input_files import SAFETENSORS, open_input_fd

from .encoding import RAW_DTYPES, encode_chunk, to_float32
from .tensor_plan import ConversionPlan, SourceSpan, TensorPlan

log = logging.getLogger(__name__)

CHUNK_ELEMENTS = 16 * 1024 * 1024


@dataclass(frozen=True)
class Chunk:
    tensor: TensorPlan
    rows: int
    spans: tuple[SourceSpan, ...]  # exactly rows * row_length elements


def iter_chunks(tensor: TensorPlan, max_elements: int | None = None) -> Iterator[Chunk]:
    """Split a tensor's spans into chunks of whole rows, at most ``max_elements`` (default CHUNK_ELEMENTS)."""
    max_elements = CHUNK_ELEMENTS if max_elements is None else max_elements
    row_length = tensor.row_length
    total_rows = tensor.n_elements // row_length
    rows_per_chunk = max(1, max_elements // row_length)
    spans = iter(tensor.spans)
    current: SourceSpan | None = None
    used = 0  # elements of `current` already assigned
    for first_row in range(0, total_rows, rows_per_chunk):
        rows = min(rows_per_chunk, total_rows - first_row)
        needed = rows * row_length
        pieces: list[SourceSpan] = []
        while needed:
            if current is None or used == current.count:
                current, used = next(spans), 0
            take = min(needed, current.count - used)
            pieces.append(SourceSpan(current.hf_name, current.start + used, take))
            used += take
            needed -= take
        yield Chunk(tensor, rows, tuple(pieces))


class SourceReader:
    """Reads element spans of source tensors with pread; one file descriptor per file."""

    def __init__(self, plan: ConversionPlan) -> None:
        self._plan = plan
        self._fds: dict[Path, int] = {}
        try:
            for path in sorted({source.path for source in plan.sources.values()}):
                self._fds[path] = open_input_fd(path, SAFETENSORS)  # a regular file still, never a fifo's wait
        except BaseException:
            self.close()
            raise

    def read(self, spans: tuple[SourceSpan, ...]) -> tuple[np.ndarray, str]:
        """The concatenated raw values of ``spans`` and their dtype (float32 if the sources' dtypes differ)."""
        sources = [self._plan.sources[s.hf_name] for s in spans]
        dtypes = {s.dtype for s in sources}
        if len(dtypes) == 1:
            (dtype,) = dtypes
            out = np.empty(sum(s.count for s in spans), dtype=RAW_DTYPES[dtype])
            position = 0
            for span, source in zip(spans, sources):
                self._read_into(out[position:position + span.count], source.path,
                                source.data_offset + span.start * source.itemsize)
                position += span.count
            return out, dtype
        parts = [to_float32(self.read((span,))[0], source.dtype) for span, source in zip(spans, sources)]
        return np.concatenate(parts), "F32"

    def _read_into(self, target: np.ndarray, path: Path, offset: int) -> None:
        view = memoryview(target).cast("B")
        fd = self._fds[path]
        done = 0
        while done < len(view):
            try:
                n = os.preadv(fd, [view[done:]], offset + done)
            except OSError as exc:
                raise CloverInputError(path, f"cannot be read ({exc.strerror or exc})") from None
            if n == 0:
                raise CloverInputError(path, f"is truncated: it ends before byte {offset + len(view)}")
            done += n

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def count_nonfinite(raw: np.ndarray, dtype: str) -> int:
    """NaN and infinite values among raw source values (BF16 as its bits: the exponent all ones)."""
    if dtype == "BF16":
        return int(np.count_nonzero((raw & 0x7F80) == 0x7F80))
    return int(raw.size - np.count_nonzero(np.isfinite(raw)))


def encode(reader: SourceReader, chunk: Chunk) -> tuple[np.ndarray, int]:
    """The GGUF bytes of ``chunk`` and the number of non-finite source values in it."""
    raw, dtype = reader.read(chunk.spans)
    t = chunk.tensor
    return (encode_chunk(raw, dtype, chunk.rows, t.row_length, t.transform, t.column_order, t.ggml_type),
            count_nonfinite(raw, dtype))


def check_finite(plan: ConversionPlan, tensor: TensorPlan, nonfinite: int, allow: bool) -> None:
    """NaN or inf weights: refused (CloverInputError naming the tensor and the count) unless allowed, then a
    warning. The check counts source values, before any transform."""
    if not nonfinite:
        return
    names = sorted({span.hf_name for span in tensor.spans})
    source = plan.sources[names[0]].path
    what = (f"tensor '{names[0]}'" if len(names) == 1 else f"tensors {', '.join(repr(n) for n in names)}") + \
        f" (GGUF {tensor.name}) hold{'s' if len(names) == 1 else ''} {nonfinite} non-finite value" + \
        ("s" if nonfinite != 1 else "") + " (NaN or inf)"
    if not allow:
        raise CloverInputError(source, f"{what}; --allow-nonfinite converts it anyway")
    log.warning("%s: %s", source, what)


class ChunkPipeline:
    """Encodes the chunks of all tensors in file order, up to ``threads`` chunks ahead of the writer."""

    def __init__(self, plan: ConversionPlan, threads: int, allow_nonfinite: bool = False) -> None:
        self._plan = plan
        self._allow_nonfinite = allow_nonfinite
        self._reader = SourceReader(plan)
        self._jobs = (chunk for tensor in plan.tensors for chunk in iter_chunks(tensor))
        self._threads = max(1, threads)
        self._executor = ThreadPoolExecutor(self._threads) if self._threads > 1 else None
        self._pending: deque[tuple[Chunk, Future[tuple[np.ndarray, int]]]] = deque()
        self.on_bytes: Callable[[int], None] = lambda n: None  # progress callback, bytes written

    def _refill(self) -> None:
        assert self._executor is not None
        while len(self._pending) < self._threads:
            chunk = next(self._jobs, None)
            if chunk is None:
                return
            self._pending.append((chunk, self._executor.submit(encode, self._reader, chunk)))

    def next_chunk(self) -> tuple[Chunk, tuple[np.ndarray, int]]:
        if self._executor is None:
            chunk = next(self._jobs)
            return chunk, encode(self._reader, chunk)
        self._refill()
        chunk, future = self._pending.popleft()
        data = future.result()
        self._refill()
        return chunk, data

    def write_tensor(self, tensor: TensorPlan, fp: IO[bytes]) -> None:
        """Write every chunk of ``tensor`` (the next tensor in file order) and check the byte count."""
        written = 0
        nonfinite = 0
        while written < tensor.nbytes:
            chunk, (data, bad) = self.next_chunk()
            if chunk.tensor is not tensor:
                raise RuntimeError(f"chunk of {chunk.tensor.name} arrived while writing {tensor.name}")
            fp.write(memoryview(np.ascontiguousarray(data)).cast("B"))
            written += data.nbytes
            nonfinite += bad
            self.on_bytes(data.nbytes)
        check_finite(self._plan, tensor, nonfinite, self._allow_nonfinite)
        if written != tensor.nbytes:
            raise RuntimeError(f"tensor {tensor.name} produced {written} bytes, expected {tensor.nbytes}")

    def close(self) -> None:
        if self._executor is not None:
            for _, future in self._pending:
                future.cancel()
            self._executor.shutdown(wait=True)
            self._pending.clear()
        self._reader.close()


class StreamedTensor:
    """What GGUFWriter.add_tensor needs of an array (shape, dtype, nbytes, tofile), produced on demand."""

    def __init__(self, tensor: TensorPlan, pipeline: ChunkPipeline) -> None:
        self._tensor = tensor
        self._pipeline = pipeline
        self.shape = tensor.shape
        self.dtype = np.dtype(np.float32)  # not uint8, so the writer takes `shape` as the logical shape
        self.nbytes = tensor.nbytes

    def tofile(self, fp: IO[bytes]) -> None:
        self._pipeline.write_tensor(self._tensor, fp)
