"""One pass from the safetensors shards to a llama.cpp quantization type (``--outtype Q4_K_M`` and the other
clover-quantize types), with no intermediate GGUF.

The result is byte for byte what ``clover-convert --outtype <source precision>`` followed by
``clover-quantize`` writes (apart from general.quantized_by), because every decision and every byte comes
from the same code:

1. The GGUF the two-step route would write first is planned as usual, and only its header is written, into
   the output's temporary folder, followed by a sparse all-zero data region (a skeleton: no disk used).
2. llama_model_quantize runs on the skeleton as a dry run (clover-quantize's planner). Its per-tensor
   types are llama.cpp's own: the mix, the Clover F32 tensors, ssm_alpha/beta at Q8_0 or better, the output
   and token-embedding types, and the fallbacks for rows that do not fill whole blocks. Its tensor order is
   the one llama_model_quantize writes.
3. The output header is built from the skeleton's with gguf.cpp, as llama_model_quantize builds it.
4. Each tensor is streamed from the shards in chunks of whole rows (at most CHUNK_ELEMENTS values, 64 MiB as
   float32), converted exactly as the two-step route's first file holds it, widened to float32 as
   llama_model_quantize does, and quantized with ggml_quantize_chunk: a chunk's rows are split among the
   threads (never across an expert, whose importance vector differs), and one chunk is read ahead.

Memory stays bounded by a few chunks whatever the model; the only disk used is the output, written to a
temporary file and renamed at the end.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import IO

import numpy as np
from gguf import GGML_QUANT_VERSION, GGMLQuantizationType, GGUFWriter
from tqdm import tqdm

from clover_quantize.importance import Imatrix, ImatrixError
from clover_quantize.gguf_input import read_input
from clover_quantize.run import Plan, QuantizeOptions, output_keys, plan_quantization
from clover_quantize.file_types import FileType, tensor_nbytes

from . import ggml_native
from .encoding import encode_chunk
from .output import AtomicOutput, OutputError, check_free_space
from .streaming import Chunk, SourceReader, check_finite, count_nonfinite, iter_chunks
from .tensor_plan import ConversionPlan, TensorPlan

QUANTIZED_BY = "clover-convert"
TIMINGS_ENV = "CLOVER_CONVERT_TIMINGS"  # a JSON file to write the time split to (bench/bench_convert.py)
_NEVER_NEED_IMATRIX = ("token_embd.weight", "output.weight")  # llama.cpp's tensor_requires_imatrix


@dataclass
class Timings:
    """Seconds spent in each stage (thread-seconds: reading ahead overlaps the rest)."""

    read: float = 0.0
    convert: float = 0.0
    quantize: float = 0.0
    write: float = 0.0
    plan: float = 0.0
    wall: float = 0.0
    threads: int = 1
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, stage: str, seconds: float) -> None:
        with self._lock:
            setattr(self, stage, getattr(self, stage) + seconds)

    def as_dict(self) -> dict[str, float]:
        return {f.name: round(getattr(self, f.name), 3) for f in fields(self) if f.name != "_lock"}


@dataclass
class OnePassResult:
    plan: Plan
    path: Path
    timings: Timings


def check_imatrix(imatrix: Imatrix, plan: Plan, file_type: FileType) -> None:
    """Refuse, before any data is written, what llama_model_quantize would refuse midway (an importance vector
    whose size does not match its tensor) and what it would silently accept: an imatrix that names none of
    the model's tensors, or one that lacks a tensor that ggml cannot quantize without one."""
    quantized = [t for t in plan.tensors if t.dst_type != t.src_type]
    if not any(t.name in imatrix.entries for t in plan.tensors):
        first = next(iter(imatrix.entries))
        raise ImatrixError(f"{imatrix.path}: none of its {len(imatrix.entries)} entries names a tensor of this "
                           f"model (the first is '{first}'): an imatrix of another model?")
    for t in quantized:
        values = imatrix.entries.get(t.name)
        n_expert = t.shape[2] if len(t.shape) > 2 else 1
        if values is not None and values.size != t.shape[0] * n_expert and t.name != "token_embd.weight":
            what = f"{t.shape[0]} columns" + (f" x {n_expert} experts" if len(t.shape) > 2 else "")
            raise ImatrixError(f"{imatrix.path}: '{t.name}' holds {values.size} values, but the model's tensor "
                               f"needs {t.shape[0] * n_expert} ({what}): an imatrix of another model?")
        if values is None and ggml_native.requires_imatrix(t.dst_type) and t.name not in _NEVER_NEED_IMATRIX:
            raise ImatrixError(f"{imatrix.path}: has no entry for '{t.name}', which {file_type.name} quantizes "
                               f"to {t.dst_type.name} and needs one for (make the imatrix from this model)")


def write_header_and_hole(writer: GGUFWriter, path: Path) -> None:
    """The header, key/values and tensor infos of ``writer``'s file, then its data region as a hole."""
    writer.write_header_to_file(path=path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    assert writer.fout is not None
    for fout, tensors in zip(writer.fout, writer.tensors):
        writer.write_padding(fout, fout.tell())
        data = sum(GGUFWriter.ggml_pad(ti.nbytes, writer.data_alignment) for ti in tensors.values())
        fout.truncate(fout.tell() + data)
    writer.close()


def write_quantized(writer: GGUFWriter, plan: ConversionPlan, output: AtomicOutput, file_type: FileType,
                    imatrix: Imatrix | None, threads: int, progress: bool | None,
                    allow_nonfinite: bool = False) -> OnePassResult:
    """Write ``plan`` (the two-step route's first file, whose header ``writer`` holds) quantized to
    ``file_type`` at ``output``'s temporary path; the caller publishes it. Raises ImatrixError, QuantizeError or
    OutputError."""
    start = time.perf_counter()
    timings = Timings(threads=threads)
    final_path = output.final_path
    skeleton = output.temp_path.with_name(f"skeleton-{final_path.name}")
    try:
        write_header_and_hole(writer, skeleton)
    except OSError as exc:
        raise OutputError(final_path, f"cannot be written ({exc.strerror or exc})") from None
    opts = QuantizeOptions(input=skeleton, file_type=file_type, imatrix=imatrix.path if imatrix else None,
                           threads=threads, dry_run=True)
    qplan = plan_quantization(opts, read_input(skeleton), imatrix)
    if imatrix is not None:
        check_imatrix(imatrix, qplan, file_type)
    header = ggml_native.quantized_header(skeleton, [(t.name, t.dst_type) for t in qplan.tensors],
                                          file_type.ftype, GGML_QUANT_VERSION,
                                          output_keys(imatrix, QUANTIZED_BY))
    skeleton.unlink()
    timings.plan = time.perf_counter() - start
    check_free_space(final_path.parent, qplan.dst_bytes + len(header.meta))
    writer_ = _TensorWriter(plan, qplan, header, imatrix, threads, timings, allow_nonfinite)
    bar = tqdm(total=sum(t.src_bytes for t in qplan.tensors), unit="B", unit_scale=True, unit_divisor=1024,
               desc=f"clover-convert {file_type.name}", file=sys.stderr, dynamic_ncols=True,
               disable=None if progress is None else not progress)
    try:
        with open(output.temp_path, "wb") as fp:
            fp.write(header.meta)
            writer_.write_all(fp, bar.update)
    except OSError as exc:
        raise OutputError(final_path, f"cannot be written ({exc.strerror or exc})") from None
    finally:
        bar.close()
        writer_.close()
    timings.wall = time.perf_counter() - start
    _dump_timings(timings)
    return OnePassResult(qplan, final_path, timings)


def _dump_timings(timings: Timings) -> None:
    path = os.environ.get(TIMINGS_ENV)
    if path:
        Path(path).write_text(json.dumps(timings.as_dict(), indent=1) + "\n")


def _as_float32(data: np.ndarray, ggml_type: GGMLQuantizationType, rows: int, row_length: int) -> np.ndarray:
    """The float32 values of encoded rows, as llama_model_quantize widens them (exact for F32, F16, BF16)."""
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if ggml_type == GGMLQuantizationType.BF16:
        bits = raw.view("<u2").astype(np.uint32)
        bits <<= 16  # in place: one float32-sized buffer per piece
        values = bits.view(np.float32)
    elif ggml_type == GGMLQuantizationType.F16:
        values = raw.view("<f2").astype(np.float32)
    elif ggml_type == GGMLQuantizationType.F32:
        values = raw.view("<f4")
    else:
        raise ValueError(f"cannot requantize from {ggml_type.name}")
    return values.reshape(rows, row_length)


class _TensorWriter:
    """Streams the tensors in the output's order: one chunk read and converted ahead on a helper thread,
    each chunk's rows quantized on ``threads`` threads, then written."""

    def __init__(self, plan: ConversionPlan, qplan: Plan, header: ggml_native.QuantizedHeader,
                 imatrix: Imatrix | None, threads: int, timings: Timings, allow_nonfinite: bool) -> None:
        self._plan = plan
        self._allow_nonfinite = allow_nonfinite
        self._by_name = {t.name: t for t in plan.tensors}
        self._qplan = qplan
        self._header = header
        self._imatrix = imatrix
        self._threads = max(1, threads)
        self._timings = timings
        self._reader = SourceReader(plan)
        self._ahead = ThreadPoolExecutor(1, thread_name_prefix="clover-read")
        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="clover-quant") if self._threads > 1 else None

    def close(self) -> None:
        self._ahead.shutdown(wait=True, cancel_futures=True)
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._reader.close()

    def _chunks(self) -> Iterator[Chunk]:
        for t in self._qplan.tensors:
            tensor = self._by_name[t.name]
            if t.src_type != tensor.ggml_type or tuple(reversed(tensor.shape)) != t.shape:
                raise RuntimeError(f"llama.cpp's plan of {t.name} ({t.src_type.name} {t.shape}) does not match "
                                   f"the conversion's ({tensor.ggml_type.name} {tensor.shape})")
            yield from iter_chunks(tensor)

    def _encode(self, chunk: Chunk) -> tuple[np.ndarray, int]:
        """The chunk as the two-step route's first file holds it, and its count of non-finite source values."""
        t0 = time.perf_counter()
        raw, dtype = self._reader.read(chunk.spans)
        t1 = time.perf_counter()
        t = chunk.tensor
        data = encode_chunk(raw, dtype, chunk.rows, t.row_length, t.transform, t.column_order, t.ggml_type)
        nonfinite = count_nonfinite(raw, dtype)
        self._timings.add("read", t1 - t0)
        self._timings.add("convert", time.perf_counter() - t1)
        return data, nonfinite

    def write_all(self, fp: IO[bytes], on_bytes: Callable[[int], None]) -> None:
        chunks = self._chunks()
        pending: Future[tuple[np.ndarray, int]] | None = None
        nxt = next(chunks, None)
        if nxt is not None:
            pending = self._ahead.submit(self._encode, nxt)
        dst_types = {t.name: t.dst_type for t in self._qplan.tensors}
        current: TensorPlan | None = None
        first_row = nonfinite = 0
        while nxt is not None:
            chunk, (data, bad) = nxt, pending.result()  # type: ignore[union-attr]
            nxt = next(chunks, None)
            pending = self._ahead.submit(self._encode, nxt) if nxt is not None else None
            tensor = chunk.tensor
            if tensor is not current:
                self._finish(fp, current, nonfinite)
                current, first_row, nonfinite = tensor, 0, 0
                self._seek(fp, self._header.offsets[tensor.name])
            nonfinite += bad
            dst = dst_types[tensor.name]
            out = data if dst == tensor.ggml_type else self._quantize(tensor, dst, data, chunk.rows, first_row)
            t0 = time.perf_counter()
            fp.write(memoryview(np.ascontiguousarray(out)).cast("B"))
            self._timings.add("write", time.perf_counter() - t0)
            first_row += chunk.rows
            on_bytes(int(data.nbytes))
        self._finish(fp, current, nonfinite)

    def _seek(self, fp: IO[bytes], offset: int) -> None:
        """Zero padding up to ``offset`` (llama_model_quantize pads each tensor to the alignment)."""
        gap = offset - fp.tell()
        if gap < 0:
            raise RuntimeError(f"tensor data overlaps at byte {offset}")
        fp.write(b"\0" * gap)

    def _finish(self, fp: IO[bytes], tensor: TensorPlan | None, nonfinite: int) -> None:
        if tensor is None:
            return
        check_finite(self._plan, tensor, nonfinite, self._allow_nonfinite)
        end = self._header.offsets[tensor.name] + self._header.sizes[tensor.name]
        if fp.tell() != end:
            raise RuntimeError(f"tensor {tensor.name} wrote {fp.tell() - self._header.offsets[tensor.name]} "
                               f"bytes, expected {self._header.sizes[tensor.name]}")
        align = self._header.alignment
        self._seek(fp, (end + align - 1) // align * align)

    def _quantize(self, tensor: TensorPlan, dst: GGMLQuantizationType, data: np.ndarray, rows: int,
                  first_row: int) -> np.ndarray:
        n_per_row = tensor.row_length
        row_bytes = tensor_nbytes(dst, (n_per_row,))
        out = np.empty(rows * row_bytes, dtype=np.uint8)
        rows_per_expert = tensor.shape[-2] if len(tensor.shape) >= 2 else 1
        importance = self._imatrix.entries.get(tensor.name) if self._imatrix is not None else None
        if importance is not None and importance.size != n_per_row * (math.prod(tensor.shape[:-2]) or 1):
            importance = None  # token_embd: llama_model_quantize ignores a mismatched vector there
        piece = max(1, math.ceil(rows / self._threads))
        jobs = []
        row = 0
        while row < rows:  # pieces of at most `piece` rows that never cross an expert
            glob = first_row + row
            n = min(rows - row, piece, rows_per_expert - glob % rows_per_expert)
            vector = None
            if importance is not None:
                e = glob // rows_per_expert
                vector = importance[e * n_per_row:(e + 1) * n_per_row]
            jobs.append((row, n, vector))
            row += n
        source_type = tensor.ggml_type

        def run(job: tuple[int, int, np.ndarray | None]) -> None:
            r, n, vector = job
            t0 = time.perf_counter()
            in_row = data.nbytes // rows
            part = np.ascontiguousarray(data).reshape(-1).view(np.uint8)[r * in_row:(r + n) * in_row]
            values = np.ascontiguousarray(_as_float32(part, source_type, n, n_per_row))
            t1 = time.perf_counter()
            ggml_native.quantize_rows(dst, values, out[r * row_bytes:(r + n) * row_bytes],
                                      None if vector is None else np.ascontiguousarray(vector))
            self._timings.add("convert", t1 - t0)
            self._timings.add("quantize", time.perf_counter() - t1)

        if self._pool is None or len(jobs) == 1:
            for job in jobs:
                run(job)
        else:
            for f in [self._pool.submit(run, job) for job in jobs]:
                f.result()
        return out
