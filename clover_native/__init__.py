"""The ground floor of the native runtime: what every package that touches the patched llama.cpp shares.

``cpu`` (the CPU's features and the build's), ``loader`` (finds the native libraries, binds ``llama_cpp`` to them,
llama.cpp's log), ``libclover`` (ctypes of clover.h) and ``bindings`` (the raw llama model and context). The
runtime (``clover_cpp``), the converter and the quantizer build on it; it imports nothing of theirs.
"""

from .loader import NativeError

__all__ = ["NativeError"]
