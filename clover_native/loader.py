"""Finds and loads the patched llama.cpp for the rest of clover_cpp: the folder of the native libraries, the
``llama_cpp`` module bound to them, and llama.cpp's log (errors are often only logged there).

The native libraries are found in ``build/native/lib`` (``make native``), in ``$CLOVER_NATIVE_LIB``, or in an
installed wheel. ``LLAMA_CPP_LIB_PATH`` is set to that folder before ``llama_cpp`` is imported, so the bindings
resolve against our build, never a bundled one. This module sits at the bottom of the package's imports: it
imports only ``cpu`` (a leaf), so that libclover.py and bindings.py both build on it without a cycle.
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

from clover_common.errors import BadInput, CloverError

from . import cpu

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_LIB_DIR = ROOT / "build" / "native" / "lib"

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


def installed_lib_dir() -> Path | None:
    """``llama_cpp/lib`` of an installed wheel of this project (setup.py puts libclover there), else None. Found
    without importing llama_cpp, which would bind its library path."""
    import importlib.util

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


def tool_path(name: str) -> Path:
    """A native tool (llama-server, llama-quantize, rpc-server, ...) of the build ``lib_dir()`` belongs to: in
    lib_dir() itself (where a wheel carries it), else in its sibling bin/ (a build's). The bin/ path when neither
    exists, for the caller's message."""
    d = lib_dir()
    return next((p for p in (d / name, d.parent / "bin" / name) if p.is_file()), d.parent / "bin" / name)


def machine_summary() -> str:
    """This CPU and, when the build lib_dir() belongs to was limited to an ISA of its own, that ISA (benchmarks)."""
    return cpu.machine_summary(lib_dir().parent)


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


def loadable(path: Path, load: Callable[[], Any], missing: str) -> tuple[bool, str]:
    """(True, "") when ``path`` exists and ``load()`` succeeds, else (False, the reason): ``missing`` when the
    file is not there, or what loading raised."""
    if not path.exists():
        return False, missing
    try:
        load()
    except Exception as exc:
        return False, f"cannot load {path}: {exc}"
    return True, ""


def native_available() -> tuple[bool, str]:
    """(True, "") when the native library and the Python bindings can be used, else (False, reason)."""
    d = lib_dir()
    lib = d / ("libllama.dylib" if sys.platform == "darwin" else "libllama.so")
    return loadable(lib, llama, f"native library not found in {d} (run `make native`)")


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


OPENMP_RUNTIMES = ("libgomp.so.1", "libomp.so", "libomp.so.5", "libiomp5.so", "libomp.dylib")


def release_openmp_threads() -> bool:
    """Free the calling thread's OpenMP workers (``omp_pause_resource_all``) where ggml runs on OpenMP; True when
    a runtime was found.

    ggml's CPU backend keeps a pool of workers per calling thread, and libgomp counts the workers of every pool:
    once they outnumber the cores it stops spinning at ggml's per-op barriers and sleeps at each. Loading a model
    leaves a pool on the loading thread (AMX and repacked weights are converted in an OpenMP loop), so a pass on
    another thread (a server's engine thread) ran 1.7x slower: a one-token step of the `mid` preset at Q8_0 took
    29 ms against 17 ms (2-core Xeon with AMX). Only a runtime the process has already loaded is used, and a
    thread that runs passes again gets a new pool at its next pass.
    """
    for name in OPENMP_RUNTIMES:
        try:
            runtime = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LOCAL)
        except (OSError, AttributeError):
            continue
        pause = getattr(runtime, "omp_pause_resource_all", None)
        if pause is None:
            return False
        pause.argtypes = [ctypes.c_int]
        pause.restype = ctypes.c_int
        pause(1)  # omp_pause_soft
        return True
    return False


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
        import llama_cpp
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
        except Exception:
            pass
