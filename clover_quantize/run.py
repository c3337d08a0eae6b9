"""Drive llama_model_quantize of the patched llama.cpp (through llama-cpp-python) for Clover GGUF files.

The per-tensor types are llama.cpp's own decisions: a dry run (``params.dry_run``) logs one line per tensor
with the type it would write, and the plan is read from those lines. The real run writes into a
temporary folder next to the output and renames at the end, so a failure leaves no partial file; SIGTERM,
SIGHUP and SIGINT remove it too (the CLI installs the handlers), and a run sweeps the folders that killed
runs of the same output left. An output that is not a regular file or that is an input is refused.
"""

from __future__ import annotations

import ctypes
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType
from tqdm import tqdm

from clover_native import loader
from clover_common import safe_output

from clover_common.errors import CloverError

from .importance import Imatrix, load_imatrix
from .gguf_input import InputError, InputModel, read_input
from .file_types import FileType, tensor_nbytes

# "[  12/ 853]           blk.0.ffn_down_exps.weight - [  512,  2048,   256,     1], type =   bf16, "
_TENSOR_LINE = re.compile(r"\[\s*(\d+)/\s*(\d+)\]\s+(\S+)\s+-\s+\[([^\]]*)\],\s+type\s+=\s+(\w+),")
# dry run, the rest of the line: "size =   512.00 MiB ->   144.00 MiB (q4_K)" or "size =    0.016 MiB"
_DRY_TAIL = re.compile(r"size\s+=\s+[\d.]+\s+MiB(?:\s+->\s+[\d.]+\s+MiB\s+\((\w+)\))?")


TEMP_SUFFIX = ".tmp"  # the temporary folder: .{OUT.gguf}.pid{PID}.XXXXXXXX.tmp next to the output


class QuantizeError(CloverError, RuntimeError):
    """llama.cpp refused or failed; the message carries its reason."""


@dataclass(frozen=True)
class TensorQuantPlan:
    name: str
    shape: tuple[int, ...]
    src_type: GGMLQuantizationType
    dst_type: GGMLQuantizationType
    src_bytes: int
    dst_bytes: int


@dataclass
class Plan:
    file_type: FileType
    tensors: list[TensorQuantPlan]

    @property
    def src_bytes(self) -> int:
        return sum(t.src_bytes for t in self.tensors)

    @property
    def dst_bytes(self) -> int:
        return sum(t.dst_bytes for t in self.tensors)

    @property
    def n_params(self) -> int:
        total = 0
        for t in self.tensors:
            n = 1
            for d in t.shape:
                n *= d
            total += n
        return total

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.dst_bytes / max(1, self.n_params)

    def types_by_count(self) -> dict[str, tuple[int, int]]:
        """dst type name -> (tensor count, bytes)."""
        out: dict[str, tuple[int, int]] = {}
        for t in self.tensors:
            n, b = out.get(t.dst_type.name, (0, 0))
            out[t.dst_type.name] = (n + 1, b + t.dst_bytes)
        return dict(sorted(out.items(), key=lambda kv: -kv[1][1]))


@dataclass
class QuantizeOptions:
    input: Path
    file_type: FileType
    output: Path | None = None
    imatrix: Path | None = None
    tensor_types: Sequence[tuple[str, GGMLQuantizationType]] = ()
    output_tensor_type: GGMLQuantizationType | None = None
    token_embedding_type: GGMLQuantizationType | None = None
    threads: int = 0
    dry_run: bool = False
    keep_split: bool = False
    allow_requantize: bool = False
    progress: bool | None = None      # None: a bar when stderr is a terminal


@dataclass
class QuantizeResult:
    plan: Plan
    paths: list[Path] = field(default_factory=list)   # written files (none for a dry run)
    imatrix: Imatrix | None = None


def default_output(path: Path, ft: FileType) -> Path:
    """``model-f16.gguf`` -> ``model-Q4_K_M.gguf`` (a trailing float-type tag is replaced)."""
    stem = re.sub(r"-\d{5}-of-\d{5}$", "", path.stem)
    stem = re.sub(r"[-_.](f32|f16|bf16|F32|F16|BF16)$", "", stem)
    return path.with_name(f"{stem}-{ft.name}.gguf")


def imatrix_advice(ft: FileType, model: Path | str) -> str | None:
    """The note for a type that is allowed without an importance matrix but much better with one."""
    if not ft.wants_imatrix:
        return None
    return (f"{ft.name} without --imatrix is allowed, as in llama-quantize, but an importance matrix improves it "
            f"most: `clover-cpp imatrix -m {model} -f calib.txt -o imatrix.gguf`, then --imatrix imatrix.gguf")


def check_options(opts: QuantizeOptions, model: InputModel) -> None:
    """The checks llama.cpp would make late (or not at all), made before any work, with clear messages."""
    if model.quantized and not opts.allow_requantize:
        t = model.quantized[0]
        raise InputError(f"{opts.input}: tensor {t.name} is already {t.type.name}: quantizing a quantized file "
                         "loses precision twice; start from the f16/bf16/f32 GGUF or pass --allow-requantize")
    for pattern, _ in opts.tensor_types:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise InputError(f"--tensor-type: '{pattern}' is not a valid regular expression ({exc})") from None


class _Params:
    """llama_model_quantize_params plus the C arrays it points to (kept alive as long as this object)."""

    def __init__(self, opts: QuantizeOptions, imatrix: Imatrix | None, dry_run: bool) -> None:
        L = loader.llama()
        p = L.llama_model_quantize_default_params()
        p.nthread = int(opts.threads)
        p.ftype = opts.file_type.ftype
        p.allow_requantize = bool(opts.allow_requantize)
        p.keep_split = bool(opts.keep_split)
        p.dry_run = dry_run
        if opts.output_tensor_type is not None:
            p.output_tensor_type = int(opts.output_tensor_type)
        if opts.token_embedding_type is not None:
            p.token_embedding_type = int(opts.token_embedding_type)
        self._keep: list[Any] = []
        if opts.tensor_types:
            arr = (L.llama_model_tensor_override * (len(opts.tensor_types) + 1))()
            for i, (pattern, qtype) in enumerate(opts.tensor_types):
                arr[i].pattern = pattern.encode()
                arr[i].type = int(qtype)
            arr[len(opts.tensor_types)].pattern = None
            p.tt_overrides = arr
            self._keep.append(arr)
        if imatrix is not None:
            entries = list(imatrix.entries.items())
            arr_i = (L.llama_model_imatrix_data * (len(entries) + 1))()
            for i, (name, values) in enumerate(entries):
                arr_i[i].name = name.encode()
                arr_i[i].data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
                arr_i[i].size = values.size
            arr_i[len(entries)].name = None
            p.imatrix = arr_i
            self._keep += [arr_i, entries]
        kv = _output_kv(L, imatrix)
        p.kv_overrides = kv
        self._keep.append(kv)
        self.params = p


QUANTIZED_BY = "clover-quantize"


def output_keys(imatrix: Imatrix | None, quantized_by: str = QUANTIZED_BY) -> list[tuple[str, str | int]]:
    """Keys written into a quantized output: general.quantized_by (gguf's Keys.General.QUANTIZED_BY, which
    model hubs show), and the quantize.imatrix.* keys llama-quantize records when an imatrix is used."""
    items: list[tuple[str, str | int]] = [("general.quantized_by", quantized_by)]
    if imatrix is not None:
        items.append(("quantize.imatrix.file", str(imatrix.path)))
        if imatrix.datasets:
            items.append(("quantize.imatrix.dataset", imatrix.datasets[0]))
        items.append(("quantize.imatrix.entries_count", len(imatrix.entries)))
        if imatrix.chunk_count:
            items.append(("quantize.imatrix.chunks_count", imatrix.chunk_count))
    return items


def _output_kv(L: Any, imatrix: Imatrix | None) -> Any:
    """output_keys as llama_model_kv_override entries (llama-quantize applies kv_overrides to its output)."""
    items = output_keys(imatrix)
    arr = (L.llama_model_kv_override * (len(items) + 1))()
    for i, (key, value) in enumerate(items):
        arr[i].key = key.encode()[:127]
        if isinstance(value, int):
            arr[i].tag = L.LLAMA_KV_OVERRIDE_TYPE_INT
            arr[i].value.val_i64 = value
        else:
            arr[i].tag = L.LLAMA_KV_OVERRIDE_TYPE_STR
            arr[i].value.val_str = value.encode()[:127]
    arr[len(items)].key = b""
    return arr


def _call_quantize(src: Path, dst: Path, params: _Params, on_line: Callable[[str], None]) -> None:
    L = loader.llama()
    errors: list[str] = []

    def on_log(level: int, line: str) -> None:
        if level == 4 or "failed to quantize" in line:  # GGML_LOG_LEVEL_ERROR
            errors.append(line.strip())
        on_line(line)

    with loader.log_listener(on_log):
        rc = L.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params.params))
    if rc != 0:
        reasons = [e for e in errors if e] or ["unknown error (see llama.cpp's log)"]
        raise QuantizeError(f"llama_model_quantize failed on {src}: " + " | ".join(dict.fromkeys(reasons)))


def plan_quantization(opts: QuantizeOptions, model: InputModel, imatrix: Imatrix | None = None) -> Plan:
    """llama.cpp's per-tensor types for ``opts`` (a dry run: reads no tensor data, writes nothing)."""
    by_name = {t.name: t for t in model.tensors}
    rows: list[TensorQuantPlan] = []
    pending: dict[str, Any] = {}

    def on_line(line: str) -> None:
        m = _TENSOR_LINE.search(line)
        if not m:
            return
        name = m.group(3)
        tail = _DRY_TAIL.search(line, m.end())
        if name not in by_name or tail is None:
            pending["bad"] = line
            return
        src = by_name[name]
        dst = GGMLQuantizationType[tail.group(1).upper()] if tail.group(1) else src.type
        rows.append(TensorQuantPlan(name, src.shape, src.type, dst, src.nbytes,
                               src.nbytes if dst == src.type else tensor_nbytes(dst, src.shape)))

    params = _Params(opts, imatrix, dry_run=True)
    _call_quantize(model.path, model.path.with_suffix(".dry-run.gguf"), params, on_line)
    if "bad" in pending or len(rows) != len(model.tensors):
        raise QuantizeError(f"could not read llama.cpp's plan for {model.path}: parsed {len(rows)} of "
                            f"{len(model.tensors)} tensors" + (f" (line: {pending['bad']!r})" if pending else ""))
    return Plan(opts.file_type, rows)


def quantize(opts: QuantizeOptions) -> QuantizeResult:
    """Plan (dry run) or quantize ``opts.input``. Raises InputError, ImatrixError or QuantizeError."""
    model = read_input(opts.input)
    check_options(opts, model)
    imatrix = load_imatrix(opts.imatrix) if opts.imatrix is not None else None
    plan = plan_quantization(opts, model, imatrix)
    result = QuantizeResult(plan, imatrix=imatrix)
    if opts.dry_run:
        return result
    out = opts.output or default_output(opts.input, opts.file_type)
    if not out.parent.is_dir():
        raise InputError(f"{out.parent}: no such directory for the output")
    inputs = [*model.shards] + ([opts.imatrix] if opts.imatrix is not None else [])
    keep_split = opts.keep_split and len(model.shards) > 1
    check_outputs(split_names(out, len(model.shards)) if keep_split else [out], inputs)  # before any work
    opts_run = QuantizeOptions(**{**opts.__dict__, "keep_split": keep_split})
    params = _Params(opts_run, imatrix, dry_run=False)
    bar = tqdm(total=len(model.tensors), unit="tensor", desc="clover-quantize", dynamic_ncols=True,
               disable=None if opts.progress is None else not opts.progress)

    def on_line(line: str) -> None:
        if _TENSOR_LINE.search(line):
            bar.update(1)

    safe_output.sweep_stale(out.parent, out.name, TEMP_SUFFIX)  # what a killed run of this output left
    tmp = safe_output.make_temp_dir(out.parent, out.name, TEMP_SUFFIX)
    try:
        target = tmp / (out.stem if keep_split else out.name)
        _call_in_thread(_call_quantize, model.path, target, params, on_line)
        written = sorted(tmp.iterdir())
        if not written:
            raise QuantizeError(f"llama_model_quantize wrote nothing for {opts.input}")
        finals = [out.parent / p.name for p in written]
        targets = check_outputs(finals, inputs)  # again: the paths may have changed meanwhile
        with safe_output.deferred_signals():  # all shards or none
            for p, final in zip(written, targets):
                p.replace(final)
        result.paths = finals
        return result
    finally:
        bar.close()
        safe_output.remove_temp(tmp)


def split_names(out: Path, count: int) -> list[Path]:
    """llama.cpp's shard names for --keep-split (``llama_split_path``)."""
    return [out.with_name(f"{out.stem}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def check_outputs(paths: Sequence[Path], inputs: Sequence[Path]) -> list[Path]:
    """An output must be a regular file or absent and none of the inputs (symlinks resolved); returns the
    paths to rename onto (a symlink's target, so the link stays)."""
    try:
        return [safe_output.check_output(p, inputs) for p in paths]
    except safe_output.UnsafeOutput as exc:
        raise InputError(str(exc)) from None


def _call_in_thread(fn: Callable[..., None], *args: Any) -> None:
    """Run ``fn`` (a long native call) on a helper thread, so that SIGINT/SIGTERM/SIGHUP reach the main thread
    at once: it unwinds (removing the temporary directory) while the native call is abandoned; the process
    then exits. Errors of ``fn`` are raised here."""
    box: dict[str, BaseException] = {}

    def run() -> None:
        try:
            fn(*args)
        except BaseException as exc:
            box["error"] = exc

    global _native_thread
    thread = threading.Thread(target=run, name="clover-quantize", daemon=True)
    _native_thread = thread
    thread.start()
    while thread.is_alive():
        thread.join(0.1)
    _native_thread = None
    if "error" in box:
        raise box["error"]


_native_thread: threading.Thread | None = None


def native_call_running() -> bool:
    """A native quantization abandoned by an interrupt is still running (the caller should exit with os._exit)."""
    return _native_thread is not None and _native_thread.is_alive()
