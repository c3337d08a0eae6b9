"""Hugging Face checkpoint to GGUF converter for Clover models."""
