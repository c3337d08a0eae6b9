"""Thin helpers over llama-cpp-python's low-level API for the patched llama.cpp (architecture `clover`).

The native libraries are found in ``build/native/lib`` (``make native``) or in ``$CLOVER_NATIVE_LIB``.
``LLAMA_CPP_LIB_PATH`` is set to that folder before ``llama_cpp`` is imported, so the bindings resolve
against our build, never a bundled one.

Block passes use libclover's ``clover_block_decode`` (the protocol lives once, in C): ``seq_cp(0 -> 1)``,
``causal_attn = false``, decode the window on seq 1 with logits only for the requested rows, ``seq_rm(1)``,
``causal_attn = true``. The committed history (seq 0: KV cells, conv and delta-rule state) is never written.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from clover_common.errors import BadInput, CloverError

from . import cpu

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_LIB_DIR = ROOT / "build" / "native" / "lib"
HISTORY_SEQ = 0
SCRATCH_SEQ = 1

_llama: ModuleType | None = None
_log_lines: list[str] = []
_log_cb: Any = None
_log_listeners: list[Callable[[int, str], None]] = []


def env_int(name: str, default: int) -> int:
    """An integer setting from the environment ($CLOVER_THREADS, $CLOVER_N_GPU_LAYERS); BadInput naming the variable
    when it is not an integer."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise BadInput(f"${name} must be an integer, got {text!r}") from None


class NativeError(CloverError, RuntimeError):
    """The native runtime is missing or a native call failed."""


def tokenize(vocab: Any, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
    """Token ids of ``text`` with a llama_vocab pointer, growing the buffer when llama_tokenize asks."""
    L = llama()
    data = text.encode("utf-8")
    cap = len(data) + 16
    toks = (L.llama_token * cap)()
    n = L.llama_tokenize(vocab, data, len(data), toks, cap, add_special, parse_special)
    if n < 0:
        cap = -n
        toks = (L.llama_token * cap)()
        n = L.llama_tokenize(vocab, data, len(data), toks, cap, add_special, parse_special)
    if n < 0:
        raise NativeError("llama_tokenize failed")
    return [int(t) for t in toks[:n]]


def installed_lib_dir() -> Path | None:
    """``llama_cpp/lib`` of an installed wheel of this project (setup.py puts libclover there), else None. Found
    without importing llama_cpp, which would bind its library path."""
    import importlib.util  # noqa: PLC0415

    try:
        spec = importlib.util.find_spec("llama_cpp")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    d = Path(spec.origin).parent / "lib"
    return d if any((d / f"libclover{ext}").exists() for ext in (".so", ".dylib")) else None


def lib_dir() -> Path:
    """Folder holding libllama.so: ``$CLOVER_NATIVE_LIB``, else a checkout's build/native/lib (``make native``),
    else the libraries an installed wheel carries (``pip install .``: llama_cpp/lib)."""
    env = os.environ.get("CLOVER_NATIVE_LIB")
    if env:
        return Path(env)
    if DEFAULT_LIB_DIR.exists():
        return DEFAULT_LIB_DIR
    return installed_lib_dir() or DEFAULT_LIB_DIR


def _load_backend_modules(llama_cpp: ModuleType, d: Path) -> None:
    """A portable build (GGML_BACKEND_DL, what wheels carry) has ggml's CPU backend as run-time modules
    (libggml-cpu-<level>.so) in ``d``; ggml looks for them only beside the executable (python) and in the working
    directory, so load them from ``d``, the best variant for this CPU first. A build that links its backends has
    them registered already, and this does nothing."""
    lib = llama_cpp.llama_cpp._lib  # dlsym through libllama reaches libggml's symbols too
    lib.ggml_backend_reg_count.restype = ctypes.c_size_t
    if lib.ggml_backend_reg_count() == 0:
        lib.ggml_backend_load_all_from_path.argtypes = [ctypes.c_char_p]
        lib.ggml_backend_load_all_from_path(str(d).encode())


def native_available() -> tuple[bool, str]:
    """(True, "") when the native library and the Python bindings can be used, else (False, reason)."""
    d = lib_dir()
    if not (d / "libllama.so").exists() and not (d / "libllama.dylib").exists():
        return False, f"native library not found in {d} (run `make native`)"
    try:
        llama()
    except Exception as exc:  # noqa: BLE001 - reported to the caller as a reason
        return False, f"cannot load the native library from {d}: {exc}"
    return True, ""


def _preload_libstdcxx() -> None:
    """Put the system libstdc++ in the global symbol scope before libllama is loaded.

    python3 does not link libstdc++, so libllama's C++ template instantiations (std::ostream inserters,
    ...) are resolved through its own dependency list, where a CUDA build's libggml-cuda.so (compiled by
    nvcc's host toolchain) comes first and exports its copies. Binding to those crashed in
    llama_model::print_info on an H200 (CUDA 13). A C++ program links libstdc++ first and never sees this.
    """
    if sys.platform != "linux":
        return
    try:
        ctypes.CDLL("libstdc++.so.6", mode=ctypes.RTLD_GLOBAL)
    except OSError:
        pass


def llama() -> ModuleType:
    """The ``llama_cpp`` module bound to our libraries (imported once, backend initialised)."""
    global _llama, _log_cb
    if _llama is not None:
        return _llama
    # ggml's abort hook attaches gdb to the process for a backtrace; under a supervisor (tests, serve) that hung
    # for minutes and left orphans. A native abort then only prints its one GGML_ASSERT line. ggml reads this
    # when the library loads (its terminate handler) and when it aborts, so set it before the import.
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")
    d = lib_dir()
    if not (d / "libllama.so").exists() and not (d / "libllama.dylib").exists():
        raise NativeError(f"native library not found in {d}: run `make native` or set CLOVER_NATIVE_LIB")
    prev = os.environ.get("LLAMA_CPP_LIB_PATH")
    # The venv's .pth (scripts/install_lib_path.py) sets LLAMA_CPP_LIB_PATH as a default and marks it with
    # CLOVER_LLAMA_LIB_DEFAULT: that default yields to lib_dir() as long as llama_cpp has not been imported.
    venv_default = prev is not None and prev == os.environ.get("CLOVER_LLAMA_LIB_DEFAULT")
    if prev is not None and Path(prev).resolve() != d.resolve() and (not venv_default or "llama_cpp" in sys.modules):
        raise NativeError(f"LLAMA_CPP_LIB_PATH={prev} points elsewhere than {d}"
                          + (" (llama_cpp was imported before clover_cpp)" if venv_default else ""))
    try:
        cpu.check_build(d.parent)
    except RuntimeError as exc:
        raise NativeError(str(exc)) from None
    os.environ["LLAMA_CPP_LIB_PATH"] = str(d)
    _preload_libstdcxx()
    try:
        import llama_cpp  # noqa: PLC0415 - must follow LLAMA_CPP_LIB_PATH
    except ImportError as exc:
        raise NativeError(f"llama-cpp-python is not installed (make native): {exc}") from exc

    @llama_cpp.llama_log_callback
    def _cb(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        msg = text.decode("utf-8", "replace")
        _log_lines.append(msg)
        del _log_lines[:-200]
        for listener in list(_log_listeners):
            listener(level, msg)
        if level == 4 and os.environ.get("CLOVER_NATIVE_QUIET") != "1":  # GGML_LOG_LEVEL_ERROR
            print(msg, end="", flush=True, file=__import__("sys").stderr)

    _log_cb = _cb
    llama_cpp.llama_log_set(_cb, ctypes.c_void_p(0))
    _load_backend_modules(llama_cpp, d)
    llama_cpp.llama_backend_init()
    _llama = llama_cpp
    return llama_cpp


class _LineJoiner:
    """llama.cpp logs fragments (a line may come in several calls, GGML_LOG_LEVEL_CONT continuing the
    previous one); this hands whole lines, each with the level of the message it belongs to."""

    def __init__(self, on_line: Callable[[int, str], None]) -> None:
        self.on_line = on_line
        self.buf = ""
        self.level = 0

    def __call__(self, level: int, text: str) -> None:
        if level != 5:  # GGML_LOG_LEVEL_CONT
            self.level = level
        self.buf += text
        while "\n" in self.buf:
            line, self.buf = self.buf.split("\n", 1)
            self.on_line(self.level, line)

    def flush(self) -> None:
        if self.buf:
            self.on_line(self.level, self.buf)
            self.buf = ""


@contextmanager
def log_listener(on_line: Callable[[int, str], None]) -> Iterator[None]:
    """Call ``on_line(level, line)`` with every whole line llama.cpp logs inside the ``with`` block
    (GGML_LOG_LEVEL_*: 2 info, 3 warn, 4 error); an unterminated last line is delivered at the end."""
    llama()
    joiner = _LineJoiner(on_line)
    _log_listeners.append(joiner)
    try:
        yield
    finally:
        _log_listeners.remove(joiner)
        joiner.flush()


# "llama_model_load: error loading model: error loading model hyperparameters: X" -> "X"
_LOG_PREFIX = re.compile(r"^(?:\w+: |error loading model(?: [a-z ]+)?: )+")
_GENERIC = ("failed to load model", "error loading model", "failed to read", "failed to initialize")


def error_reasons(lines: Sequence[str]) -> str:
    """llama.cpp's logged error lines, each without its function prefixes, deduplicated, joined with "; ":
    the reason a load failed (gguf's and the model loader's messages are only logged)."""
    out: list[str] = []
    for line in lines:
        text = line.strip()
        reason = _LOG_PREFIX.sub("", text).strip() or text
        if reason.rstrip(":").lower() in _GENERIC and len(lines) > 1:
            continue
        out.append(reason)
    return "; ".join(dict.fromkeys(r for r in out if r))


@contextmanager
def logged_errors() -> Iterator[list[str]]:
    """The ERROR-level lines llama.cpp logs inside the ``with`` block, in a list filled as they come."""
    lines: list[str] = []
    with log_listener(lambda level, line: lines.append(line) if level == 4 else None):
        yield lines


def check_model(path: str | os.PathLike[str]) -> None:
    """Load ``path`` as llama.cpp would, without reading or allocating the weights (``no_alloc``): every check of
    the loader and of the model's architecture runs. Raises NativeError with llama.cpp's reason."""
    L = llama()
    params = L.llama_model_default_params()
    params.no_alloc = True
    params.load_mode = L.LLAMA_LOAD_MODE_NONE  # the no_alloc pass maps nothing (llama.cpp asserts otherwise)
    params.n_gpu_layers = 0
    with logged_errors() as errors:
        ptr = L.llama_model_load_from_file(str(path).encode(), params)
    if not ptr:
        raise NativeError(f"{path}: llama.cpp cannot load it: {error_reasons(errors) or 'unknown error'}")
    L.llama_model_free(ptr)


def recent_log() -> str:
    """The last lines llama.cpp logged (load errors are only reported there)."""
    return "".join(_log_lines)


class NativeHandle:
    """Owns one native pointer, ``ptr``: ``close()`` frees it once, and so does garbage collection."""

    ptr: Any = None

    def _free(self, ptr: Any) -> None:
        raise NotImplementedError

    def close(self) -> None:
        if self.ptr:
            self._free(self.ptr)
            self.ptr = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class LlamaModel(NativeHandle):
    """A loaded GGUF model (CPU unless n_gpu_layers / $CLOVER_N_GPU_LAYERS offloads layers)."""

    def __init__(self, path: str | os.PathLike[str], n_gpu_layers: int | None = None,
                 use_extra_bufts: bool = True, bd_path: str | os.PathLike[str] | None = None) -> None:
        """``bd_path``: a block-diffusion sidecar (spec 5) attached to a trunk-only file after the load (the
        caller checks its fingerprint first: libclover.read_model_info)."""
        L = llama()
        params = L.llama_model_default_params()
        if n_gpu_layers is None:
            n_gpu_layers = env_int("CLOVER_N_GPU_LAYERS", 0)
        params.n_gpu_layers = n_gpu_layers
        params.use_extra_bufts = use_extra_bufts
        params.use_mmap = True
        self.path = str(path)
        with logged_errors() as errors:
            self.ptr = L.llama_model_load_from_file(self.path.encode(), params)
        if not self.ptr:
            raise NativeError(f"failed to load {self.path}: {error_reasons(errors) or 'unknown error'}")
        self.vocab = L.llama_model_get_vocab(self.ptr)
        self.n_vocab = int(L.llama_vocab_n_tokens(self.vocab))
        if bd_path is not None:
            self._attach_block_diffusion(bd_path)

    def _attach_block_diffusion(self, bd_path: str | os.PathLike[str]) -> None:
        lib = llama().llama_cpp._lib
        fn = lib.llama_clover_attach_block_diffusion
        fn.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
        fn.restype = ctypes.c_bool
        err = ctypes.create_string_buffer(2048)
        if not fn(self.ptr, os.fsencode(bd_path), err, len(err)):
            message = err.value.decode("utf-8", "replace")
            self.close()
            raise NativeError(message)

    def set_coreset_top_p(self, top_p: float) -> None:
        """The block expert coreset's top_p of this model's next block passes (spec 3.3; the patch's
        llama_clover_set_coreset_top_p, which a reused graph reads at every pass). NativeError outside (0, 1]."""
        lib = llama().llama_cpp._lib
        lib.llama_clover_set_coreset_top_p.argtypes = [ctypes.c_void_p, ctypes.c_float]
        lib.llama_clover_set_coreset_top_p.restype = ctypes.c_bool
        if not lib.llama_clover_set_coreset_top_p(self.ptr, float(top_p)):
            raise NativeError(f"coreset_top_p must be in (0, 1], got {top_p!r}")

    def meta(self, key: str) -> str | None:
        """A metadata value as llama.cpp stringifies it (no arrays)."""
        L = llama()
        buf = ctypes.create_string_buffer(1024)
        n = L.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return None if n < 0 else buf.value.decode()

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        return tokenize(self.vocab, text, add_special, parse_special)

    def mask_token(self) -> int:
        return int(llama().llama_vocab_mask(self.vocab))

    def _free(self, ptr: Any) -> None:
        llama().llama_model_free(ptr)


class Context(NativeHandle):
    """A context on ``LlamaModel`` with two sequences (0 = history, 1 = scratch) and a unified KV cache."""

    def __init__(self, model: LlamaModel, n_ctx: int = 1024, n_batch: int = 512, n_ubatch: int = 64,
                 n_rs_seq: int = 0, n_threads: int | None = None,
                 eval_callback: tuple[Any, Any] | None = None, flash_attn: bool | None = None,
                 op_offload: bool = True, n_seq_max: int = 2) -> None:
        """``eval_callback``: an optional (ggml_backend_sched_eval_callback, user data) pair set as
        ``cb_eval`` / ``cb_eval_user_data`` (e.g. libclover's importance-matrix collector); it is kept
        referenced for the context's lifetime. ``flash_attn``: None = llama.cpp's auto, else on or off.
        ``op_offload``: llama.cpp's default (True) lets the scheduler run large batches of host-resident weights
        on a GPU device when the build has one; False keeps a CPU-only model (n_gpu_layers 0) on the CPU."""
        L = llama()
        p = L.llama_context_default_params()
        self._eval_callback = eval_callback  # the C side holds only raw pointers
        if eval_callback is not None:
            p.cb_eval = eval_callback[0]
            p.cb_eval_user_data = eval_callback[1]
        p.n_ctx = n_ctx
        p.n_batch = n_batch
        p.n_ubatch = n_ubatch
        p.n_seq_max = n_seq_max  # the engine's layout: 2 per slot (history, scratch)
        p.kv_unified = True
        p.n_rs_seq = n_rs_seq
        p.op_offload = op_offload
        if flash_attn is not None:  # enum llama_flash_attn_type: -1 auto, 0 disabled, 1 enabled
            p.flash_attn_type = 1 if flash_attn else 0
        threads = n_threads or env_int("CLOVER_THREADS", 0) or default_threads()
        p.n_threads = threads
        p.n_threads_batch = threads
        self.model = model
        self.n_ubatch = n_ubatch
        self.ptr = L.llama_init_from_model(model.ptr, p)
        if not self.ptr:
            raise NativeError("llama_init_from_model failed: " + recent_log()[-500:])
        self.mem = L.llama_get_memory(self.ptr)
        self.n_rs_seq = int(L.llama_n_rs_seq(self.ptr))

    # -- low level ------------------------------------------------------------------------------
    def _decode(self, tokens: Sequence[int], pos0: int, seq: int, rows: Sequence[int],
                decode: Callable[[Any, Any], int] | None = None) -> np.ndarray:
        """One batch at positions pos0 .. on ``seq``; float32 logits of ``rows``. ``decode(ctx, batch_ptr)``
        replaces llama_decode (the block-pass protocol)."""
        L = llama()
        n = len(tokens)
        if n == 0:
            raise ValueError("empty batch")
        want = set(int(r) for r in rows)
        batch = L.llama_batch_init(n, 0, 1)
        try:
            for i, t in enumerate(tokens):
                batch.token[i] = int(t)
                batch.pos[i] = pos0 + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = 1 if i in want else 0
            batch.n_tokens = n
            rc = L.llama_decode(self.ptr, batch) if decode is None else decode(self.ptr, ctypes.addressof(batch))
            if rc != 0:
                raise NativeError(f"llama_decode returned {rc}")
            out = np.empty((len(rows), self.model.n_vocab), dtype=np.float32)
            for k, r in enumerate(rows):
                ptr = L.llama_get_logits_ith(self.ptr, int(r))
                out[k] = np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,))
            return out
        finally:
            L.llama_batch_free(batch)

    def pos_max(self, seq: int = HISTORY_SEQ) -> int:
        return int(llama().llama_memory_seq_pos_max(self.mem, seq))

    # -- API ------------------------------------------------------------------------------------
    def causal(self, tokens: Sequence[int], rows: Sequence[int] | None = None) -> np.ndarray:
        """Causal pass appending ``tokens`` to the history; float32 logits [len(rows), n_vocab]
        (all rows by default; row i predicts the token after tokens[i])."""
        pos0 = self.pos_max(HISTORY_SEQ) + 1
        rows = list(range(len(tokens))) if rows is None else list(rows)
        return self._decode(tokens, pos0, HISTORY_SEQ, rows)

    def block(self, window: Sequence[int], rows: Sequence[int] | None = None) -> np.ndarray:
        """Block pass on a scratch copy of the history: window at positions [p, p+B), p = history
        length; logits for ``rows`` (window indices; all by default). History is left untouched."""
        b = len(window)
        if b > self.n_ubatch:
            raise ValueError(f"block window of {b} does not fit n_ubatch={self.n_ubatch}")
        from . import libclover  # noqa: PLC0415 - libclover imports this module

        rows = list(range(b)) if rows is None else list(rows)
        pos0 = self.pos_max(HISTORY_SEQ) + 1
        return self._decode(window, pos0, SCRATCH_SEQ, rows, decode=libclover.lib().clover_block_decode)

    def rollback(self, keep: int) -> None:
        """Keep history positions [0, keep); needs n_rs_seq >= the number of removed positions."""
        ok = llama().llama_memory_seq_rm(self.mem, HISTORY_SEQ, keep, -1)
        if not ok:
            raise NativeError(f"seq_rm(0, {keep}, -1) refused (n_rs_seq={self.n_rs_seq})")

    def clear(self) -> None:
        llama().llama_memory_clear(self.mem, True)

    def _free(self, ptr: Any) -> None:
        llama().llama_free(ptr)


def default_threads() -> int:
    """The engine's default thread count: the physical cores this process may use (libclover)."""
    from . import libclover  # noqa: PLC0415 - libclover imports this module

    return int(libclover.lib().clover_default_n_threads())


def load_model(path: str | os.PathLike[str]) -> LlamaModel:
    return LlamaModel(path)


def create_context(model: LlamaModel, **kwargs: Any) -> Context:
    return Context(model, **kwargs)
