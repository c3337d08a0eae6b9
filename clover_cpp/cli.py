"""`clover-cpp`: the native Clover engine from the command line.

    clover-cpp generate -m MODEL.gguf -p TEXT [--mode ar|diffusion|spec] [--block-size B] [--threshold T]
                        [-n N] [--draft-steps S] [--temperature T --top-k K --top-p P --seed S] [--json]

Bad input prints exactly one line (``clover-cpp: error: ...``) and exits with status 2.
Subcommands planned next to ``generate``: ``chat``, ``serve``, ``imatrix``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import NoReturn

EXIT_BAD_INPUT = 2
PROG = "clover-cpp"


class BadInput(Exception):
    """Reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse prints usage over several lines; we want one
        raise BadInput(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Clover native decoding engine (llama.cpp + libclover).")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    gen = sub.add_parser("generate", help="continue a prompt with the native engine")
    gen.add_argument("-m", "--model", required=True, help="Clover GGUF file")
    gen.add_argument("-p", "--prompt", required=True)
    gen.add_argument("--mode", choices=["ar", "diffusion", "spec"], default="diffusion")
    gen.add_argument("--block-size", type=int, default=None)
    gen.add_argument("--threshold", type=float, default=None)
    gen.add_argument("--draft-steps", type=int, default=0)
    gen.add_argument("-n", "--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("-c", "--ctx-size", type=int, default=0, help="context size (0 = min(n_ctx_train, 4096))")
    gen.add_argument("-t", "--threads", type=int, default=0)
    gen.add_argument("-ngl", "--n-gpu-layers", type=int, default=0)
    gen.add_argument("--json", action="store_true", help="print text, token ids and stats as JSON")
    return parser


def _check(args: argparse.Namespace) -> None:
    if not os.path.isfile(args.model):
        raise BadInput(f"{args.model}: no such file")
    if args.block_size is not None and args.block_size < 1:
        raise BadInput(f"--block-size must be at least 1, got {args.block_size}")
    if args.max_tokens < 0:
        raise BadInput(f"-n/--max-tokens must be >= 0, got {args.max_tokens}")
    if args.draft_steps < 0:
        raise BadInput(f"--draft-steps must be >= 0, got {args.draft_steps}")
    if args.temperature < 0:
        raise BadInput(f"--temperature must be >= 0, got {args.temperature}")
    if not 0.0 < args.top_p <= 1.0:
        raise BadInput(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        raise BadInput(f"--top-k must be >= 0, got {args.top_k}")


def run_generate(args: argparse.Namespace) -> int:
    from .model import Model

    _check(args)
    with Model(args.model, n_ctx=args.ctx_size, n_threads=args.threads, n_gpu_layers=args.n_gpu_layers) as model:
        prompt_ids = model.tokenize(args.prompt)
        if not prompt_ids:
            raise BadInput("the prompt is empty after tokenization (--prompt)")
        gen = model.generate(prompt_ids, mode=args.mode, block_size=args.block_size, threshold=args.threshold,
                             draft_steps=args.draft_steps, max_tokens=args.max_tokens,
                             temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
        start = time.perf_counter()
        if args.json:
            tokens = gen.wait()
        else:
            sys.stdout.write(args.prompt)
            shown = ""
            for _ in gen:  # stream: print the text that the new block adds
                text = model.detokenize(gen.tokens)
                sys.stdout.write(text[len(shown):] if text.startswith(shown) else text)
                sys.stdout.flush()
                shown = text
            tokens = gen.tokens
        seconds = time.perf_counter() - start
        stats = gen.stats
        assert stats is not None
        text = model.detokenize(tokens)
    if args.json:
        print(json.dumps({"text": text, "prompt_ids": prompt_ids, "tokens": tokens,
                          "stats": stats.to_dict() | {"seconds": seconds}}))
    else:
        print(flush=True)
        print(f"[{stats.mode}] {stats.generated_tokens} tokens, {stats.block_passes} block + "
              f"{stats.causal_passes} causal passes, {stats.tokens_per_pass:.2f} tokens/pass, "
              f"prefill {stats.prefill_tok_s:.1f} tok/s, decode {stats.decode_tok_s:.1f} tok/s, "
              f"stop: {stats.stop_reason}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    from .native import NativeError

    os.environ.setdefault("CLOVER_NATIVE_QUIET", "1")  # llama.cpp's error log would add lines; we print one
    try:
        args = build_parser().parse_args(argv)
        return run_generate(args)
    except (BadInput, ValueError, FileNotFoundError, NativeError) as exc:
        message = " ".join(str(exc).split())  # always exactly one line
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
