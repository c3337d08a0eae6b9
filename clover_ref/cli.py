"""`clover-ref`: make random checkpoints and generate with the PyTorch reference.

    clover-ref init OUT_DIR --preset tiny|mid|35b-shape [--seed N] [--layers N] [--config-only]
    clover-ref generate MODEL_DIR -p TEXT --mode ar|diffusion|spec [--block-size B] [--threshold T] [-n N] [--json]

`generate --json` prints the output object shared with clover-cpp and llama-clover (clover_common.generate_output).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from clover_common import cli_runner
from clover_common.cli_runner import OneLineParser
from clover_common.errors import CloverError, CloverInputError
from clover_common.input_files import check_input_dir


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="clover-ref", description="Clover PyTorch reference: checkpoints and "
                                     "generation (the oracle for the native runtime).")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    init = sub.add_parser("init", help="write a random checkpoint in the spec's Hugging Face format")
    init.add_argument("out_dir", type=Path)
    init.add_argument("--preset", required=True, choices=["tiny", "mid", "35b-shape"])
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--layers", type=int, default=None, help="keep only the first N layers")
    init.add_argument("--config-only", action="store_true", help="write config.json and tokenizer files only")
    init.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    init.add_argument("--shard-size", type=int, default=None, metavar="BYTES",
                      help="split the weights into safetensors shards of at most BYTES, with an index")
    init.add_argument("--nested", action="store_true",
                      help="nest the text config under text_config, with model.language_model. tensor names")

    gen = sub.add_parser("generate", help="continue a prompt with the reference decoders")
    gen.add_argument("model_dir", type=Path)
    gen.add_argument("-p", "--prompt", required=True)
    gen.add_argument("--mode", choices=["ar", "diffusion", "spec"], default="diffusion")
    gen.add_argument("--block-size", type=int, default=None)
    gen.add_argument("--threshold", type=float, default=None)
    gen.add_argument("--draft-steps", type=int, default=0)
    gen.add_argument("--coreset-top-p", type=float, default=None,
                     help="the block expert coreset's top_p in (0, 1] (default: the model's coreset_top_p)")
    gen.add_argument("-n", "--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--json", action="store_true",
                     help="print text, token ids and stats as one JSON object (docs/generate-output.schema.json)")
    return parser


def run_init(args: argparse.Namespace) -> int:
    from .factory import init_checkpoint

    start = time.perf_counter()
    config = init_checkpoint(args.out_dir, args.preset, seed=args.seed, layers=args.layers,
                             config_only=args.config_only, dtype=args.dtype,
                             max_shard_bytes=args.shard_size, nested=args.nested)
    what = "config and tokenizer" if args.config_only else "checkpoint"
    print(f"wrote {args.preset} {what} ({config.num_hidden_layers} layers) to {args.out_dir} "
          f"in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


def run_generate(args: argparse.Namespace) -> int:
    from .checkpoint import load_model
    from .decode import generate
    from clover_common.tokenizer import load_tokenizer

    check_input_dir(args.model_dir, "a Clover checkpoint")
    tokenizer = load_tokenizer(args.model_dir)
    model = load_model(args.model_dir)
    prompt_ids = tokenizer.encode(args.prompt).ids
    if not prompt_ids:
        raise CloverInputError(None, "the prompt is empty after tokenization", field="--prompt")
    start = time.perf_counter()
    result = generate(model, prompt_ids, mode=args.mode, block_size=args.block_size, threshold=args.threshold,
                      draft_steps=args.draft_steps, max_new_tokens=args.max_tokens,
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                      coreset_top_p=args.coreset_top_p)
    seconds = time.perf_counter() - start
    text = tokenizer.decode(result.tokens, skip_special_tokens=False)
    if args.json:
        from clover_common.generate_output import generate_output, histogram_from_samples

        s = result.stats
        print(json.dumps(generate_output(
            text=text, prompt_ids=prompt_ids, tokens=result.tokens, mode=s.mode, block_size=s.block_size,
            threshold=s.threshold, prompt_tokens=s.prompt_tokens, block_passes=s.block_passes,
            causal_passes=s.causal_passes, prefill_ms=s.prefill_ms, decode_ms=s.decode_ms,
            steps_per_block=histogram_from_samples(s.steps_per_block),
            accepted_lengths=histogram_from_samples(s.accepted_lengths), stop_reason=s.stop_reason,
            prefill_passes=s.prefill_passes, seconds=seconds)))
    else:
        print(args.prompt + text)
        s = result.stats
        print(f"[{s.mode}] {s.generated_tokens} tokens, {s.block_passes} block + {s.causal_passes} causal passes, "
              f"{s.tokens_per_pass:.2f} tokens/pass, {s.generated_tokens / seconds:.1f} tok/s", file=sys.stderr)
    return 0


def require_torch() -> None:
    """clover-ref runs the PyTorch reference; the base install (convert, quantize, cpp) comes without torch."""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise CloverError("clover-ref needs PyTorch, which the base install leaves out: "
                         "pip install 'clover-toolkit[reference]'") from None


def main(argv: list[str] | None = None) -> int:
    return cli_runner.run("clover-ref", lambda: _run(build_parser().parse_args(argv)))


def _run(args: argparse.Namespace) -> int:
    require_torch()
    return run_init(args) if args.command == "init" else run_generate(args)


if __name__ == "__main__":
    sys.exit(main())
