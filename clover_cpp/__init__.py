"""Python bindings and build helpers for the patched llama.cpp Clover runtime.

``clover_cpp.Model`` drives the native decoding engine (libclover); ``clover_native.bindings`` holds the raw
llama.cpp model and context, and ``clover_native.loader`` finds and loads the native libraries.
"""

from .model import EngineError, Generation, Model, ModelInfo, Result, Stats
from clover_native.loader import NativeError

__all__ = ["EngineError", "Generation", "Model", "ModelInfo", "NativeError", "Result", "Stats"]
