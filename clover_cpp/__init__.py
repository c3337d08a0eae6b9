"""Python bindings and build helpers for the patched llama.cpp Clover runtime.

``clover_cpp.Model`` drives the native decoding engine (libclover); ``clover_cpp.native`` holds low-level
helpers over llama-cpp-python.
"""

from .model import EngineError, Generation, Model, ModelInfo, Result, Stats
from .native import NativeError

__all__ = ["EngineError", "Generation", "Model", "ModelInfo", "NativeError", "Result", "Stats"]
