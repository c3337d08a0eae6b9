"""`make demo`: continue a code prompt with the native engine in several modes and print a stats table.

    .venv/bin/python scripts/demo.py MODEL.gguf [--prompt TEXT] [-n N]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import clover_cpp

DEFAULT_PROMPT = "def fibonacci(n):\n"
MODES = ("ar", "auto", "diffusion", "spec")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("-n", "--max-tokens", type=int, default=96)
    args = parser.parse_args(argv)
    rows = []
    with clover_cpp.Model(str(args.model)) as model:  # the engine's default threads, as a user gets them
        model_threads = model.n_threads
        for mode in MODES:
            model.reset()
            result = model.run(args.prompt, mode=mode, max_tokens=args.max_tokens)
            s = result.stats
            print(f"--- {mode} (B={s.block_size}, threshold={s.threshold:.2f}) ---")
            print(args.prompt + model.detokenize(result.tokens))
            rows.append((mode, s.generated_tokens, s.decode_tok_s, s.tokens_per_pass, s.block_passes, s.causal_passes))
    print(f"({model_threads} threads: the physical cores this process may use)")
    print("| mode | tokens | decode tok/s | TPF | block passes | causal passes |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode, tokens, tok_s, tpf, blocks, causal in rows:
        print(f"| {mode} | {tokens} | {tok_s:.1f} | {tpf:.2f} | {blocks} | {causal} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
