"""Quantization of Clover GGUF files."""
