#!/usr/bin/env python3
"""Run the vendored llama.cpp convert_hf_to_gguf.py on a Qwen3.5-MoE checkpoint (reference converter).

    python3 scripts/vendored_convert.py MODEL_DIR --outfile OUT.gguf [--outtype f32|f16|bf16|q8_0]
        [--tree VENDORED_LLAMA_CPP] [--tokenizer-pre qwen35] [-- EXTRA CONVERTER ARGS]

Needs a Python with torch, numpy, safetensors and transformers (the project venv, .venv/bin/python).
- The vendored tree's own gguf-py is put first on sys.path: the PyPI gguf 0.19.0 wheel is not the gguf-py of the
  vendored tree (it lacks writer helpers the converter calls and cannot quantize K-quants).
- `--no-mtp` is always passed: our checkpoints have no MTP tensors and the converter asserts otherwise.
- The converter refuses BPE tokenizers whose pre-tokenizer hash it does not know. Our test checkpoints
  use a tiny BPE tokenizer with Qwen3.5's regex, so TextModel.get_vocab_base_pre (conversion/base.py,
  the only hash lookup; no Qwen class overrides it) is replaced by one returning --tokenizer-pre.
  The rest of the vocab step (token list, types, merges, special tokens) runs unchanged.
"""
from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TREE = REPO_ROOT / "build" / "llama-cpp-python-0.3.36" / "vendor" / "llama.cpp"
OUTTYPES = ("f32", "f16", "bf16", "q8_0")


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="HF checkpoint directory")
    parser.add_argument("--outfile", type=Path, required=True)
    parser.add_argument("--outtype", choices=OUTTYPES, default="f32")
    parser.add_argument("--tree", type=Path, default=DEFAULT_TREE,
                        help="vendored llama.cpp tree (default: the unpacked pinned sdist)")
    parser.add_argument("--tokenizer-pre", default="qwen35",
                        help="value returned instead of the pre-tokenizer hash lookup")
    return parser.parse_known_args(argv)


def use_vendored_packages(tree: Path) -> None:
    """Put the vendored gguf-py and conversion package first on sys.path and check they win."""
    if not (tree / "convert_hf_to_gguf.py").is_file():
        sys.exit(f"error: {tree} is not a llama.cpp tree; run `python3 scripts/llama_sdist.py unpack`")
    sys.path[:0] = [str(tree / "gguf-py"), str(tree)]
    import gguf  # type: ignore[import-not-found]  # found via sys.path above

    if not Path(gguf.__file__).resolve().is_relative_to(tree.resolve()):
        sys.exit(f"error: gguf was imported from {gguf.__file__}, not from {tree}/gguf-py")


def force_tokenizer_pre(name: str) -> None:
    from conversion.base import TextModel  # type: ignore[import-not-found]

    def get_vocab_base_pre(self: TextModel, tokenizer: object) -> str:
        return name

    TextModel.get_vocab_base_pre = get_vocab_base_pre


def main(argv: list[str] | None = None) -> None:
    args, extra = parse_args(argv)
    tree = args.tree.resolve()
    use_vendored_packages(tree)
    force_tokenizer_pre(args.tokenizer_pre)
    extra = [a for a in extra if a != "--"]
    sys.argv = ["convert_hf_to_gguf.py", str(args.model), "--outfile", str(args.outfile),
                "--outtype", args.outtype, "--no-mtp", *extra]
    runpy.run_path(str(tree / "convert_hf_to_gguf.py"), run_name="__main__")


if __name__ == "__main__":
    main()
