"""Python bindings and build helpers for the patched llama.cpp Clover runtime."""
