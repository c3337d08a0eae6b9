"""`clover-cpp`: the native Clover engine from the command line.

    clover-cpp generate -m MODEL.gguf -p TEXT [--mode auto|ar|diffusion|spec] [--block-size B] [--threshold T]
                        [-n N] [--draft-steps S] [--temp T --top-k K --top-p P -s S] [--json]
                        [--repeat-penalty N --presence-penalty N --frequency-penalty N]
                        [--grammar GBNF | --grammar-file F | -j/--json-schema SCHEMA | -jf/--json-schema-file F]
    generate and chat take llama.cpp's penalty and grammar flags (spec 4's distribution stage; docs/decoding.md,
    "Constrained decoding").
    generate and chat also take llama.cpp's names for the common options, as aliases of the same option:
    --temp (--temperature), -s/--seed, -n/--n-predict (--max-tokens), --top-k, --top-p, -c, -t, -ngl.
    generate and chat take llama.cpp's offload flags: -ngl N, -ncmoe/--n-cpu-moe N, -cmoe/--cpu-moe,
    -ot/--override-tensor REGEX=BUFT, -sm/--split-mode none|layer|row, -ts/--tensor-split N0,N1, -mg/--main-gpu I,
    -fitt/--fit-target MiB (clover_cpp/offload.py)
    clover-cpp imatrix -m F16.gguf -f CALIB.txt [-o imatrix.gguf] [--chunk-size 512] [--chunks N]
                       [--block-size B] [--no-masked] [--seed S] [-t N] [-ngl N]       (clover_cpp/imatrix.py)
    clover-cpp chat -m MODEL.gguf [--mode M] [--think on|off] [--visual] ...   (clover_cpp/chat.py)
    clover-cpp serve -m MODEL.gguf [llama-server's options]   the patched llama-server (clover_cpp/launch.py)

Bad input prints exactly one line (``clover-cpp: error: ...``) and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from clover_common import cli_runner
from clover_common.cli_runner import OneLineParser
from clover_common.errors import BadInput
from clover_common.input_files import CALIBRATION_TEXT, GGUF, check_input_file, read_input_text

from . import options
from .options import BD_HELP, at_least

PROG = "clover-cpp"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description="Clover native decoding engine (llama.cpp + libclover).")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    gen = sub.add_parser("generate", help="continue a prompt with the native engine")
    options.add_model_args(gen)
    gen.add_argument("-p", "--prompt", required=True)
    options.add_generation_args(gen, max_tokens=64, max_tokens_help="tokens to generate (default 64)", seed=0,
                                draft_steps=True, distribution=True)
    gen.add_argument("--json", action="store_true",
                     help="print text, token ids and stats as one JSON object (docs/generate-output.schema.json)")

    imx = sub.add_parser("imatrix", help="importance matrix for quantization, with masked calibration")
    imx.add_argument("-m", "--model", required=True, help="Clover GGUF file (F16/BF16/F32)")
    imx.add_argument("--bd", metavar="FILE", default=None, help=BD_HELP)
    imx.add_argument("-f", "--file", required=True, help="calibration text (UTF-8)")
    imx.add_argument("-o", "--output", default="imatrix.gguf", help="output imatrix GGUF (default imatrix.gguf)")
    imx.add_argument("--chunk-size", type=int, default=512, help="tokens per chunk; memory is cleared between")
    imx.add_argument("--chunks", type=int, default=None, help="process at most this many chunks")
    imx.add_argument("--block-size", type=int, default=None, help="block window size (default clover.block_size)")
    imx.add_argument("--no-masked", action="store_true", help="causal passes only (AR-only calibration)")
    imx.add_argument("--seed", type=int, default=0, help="seed of the random masks")
    imx.add_argument("-t", "--threads", type=int, default=0)
    imx.add_argument("-ngl", "--n-gpu-layers", type=int, default=0)
    imx.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_chat(sub)
    return parser


def _add_chat(sub: argparse._SubParsersAction) -> None:
    chat = sub.add_parser("chat", help="interactive multi-turn chat with the model's chat template")
    options.add_engine_args(chat)
    options.add_generation_args(chat, max_tokens=1024, max_tokens_help="most tokens per answer", seed=0,
                                distribution=True)
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--reasoning", choices=["show", "hide"], default="show",
                      help="show the <think> reasoning dimmed, or hide it")
    chat.add_argument("--visual", action="store_true", help="show the canvas filling step by step")
    chat.add_argument("--color", choices=["auto", "always", "never"], default="auto")
    chat.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-generation tokens")


def run_generate(args: argparse.Namespace) -> int:
    options.check_model_args(args)
    params = options.gen_params(args)
    with options.open_model(args) as model:
        options.check_grammar(model, args, params)
        prompt_ids = model.tokenize(args.prompt)
        if not prompt_ids:
            raise BadInput("the prompt is empty after tokenization (--prompt)")
        gen = model.generate(prompt_ids, params)
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
        print(json.dumps(json_output(text, prompt_ids, tokens, stats, seconds)))
    else:
        print(flush=True)
        print(f"[{stats.mode}] {stats.generated_tokens} tokens, {stats.block_passes} block + "
              f"{stats.causal_passes} causal passes, {stats.tokens_per_pass:.2f} tokens/pass, "
              f"prefill {stats.prefill_tok_s:.1f} tok/s, decode {stats.decode_tok_s:.1f} tok/s, "
              f"{stats.threads} thread{'s' * (stats.threads != 1)}, stop: {stats.stop_reason}", file=sys.stderr)
    return 0


def json_output(text: str, prompt_ids: list[int], tokens: list[int], stats, seconds: float) -> dict:
    """generate --json: the object clover-ref and llama-clover print too (clover_common.generate_output)."""
    from clover_common.generate_output import generate_output, histogram_from_bins

    extra = {"threads": stats.threads, "seconds": seconds, "block_ms": stats.block_ms, "causal_ms": stats.causal_ms,
             "coreset_top_p": stats.coreset_top_p}
    if stats.mode == "auto":
        extra |= {"auto_rounds": dict(stats.auto_rounds), "auto_drafted": stats.auto_drafted,
                  "auto_accepted": stats.auto_accepted, "replays": stats.replays}
    return generate_output(text=text, prompt_ids=prompt_ids, tokens=tokens, mode=stats.mode,
                           block_size=stats.block_size, threshold=stats.threshold,
                           prompt_tokens=stats.prompt_tokens, block_passes=stats.block_passes,
                           causal_passes=stats.causal_passes, prefill_ms=stats.prefill_ms,
                           decode_ms=stats.decode_ms, steps_per_block=histogram_from_bins(stats.steps_per_block),
                           accepted_lengths=histogram_from_bins(stats.accepted_lengths),
                           stop_reason=stats.stop_reason, **extra)


def run_imatrix(args: argparse.Namespace) -> int:
    """Masked calibration over a text file, written in llama.cpp's imatrix GGUF format (clover_cpp/imatrix.py)."""
    from pathlib import Path

    from clover_native import libclover, loader, bindings
    from .imatrix import collect

    at_least(("--chunk-size", args.chunk_size, 1), ("--chunks", args.chunks, 1),
              ("--block-size", args.block_size, 1), ("-t/--threads", args.threads, 0),
              ("-ngl/--n-gpu-layers", args.n_gpu_layers, -1), ("--seed", args.seed, 0))
    for flag, path, kind in (("-m/--model", args.model, GGUF), ("-f/--file", args.file, CALIBRATION_TEXT),
                             ("--bd", args.bd, GGUF)):
        if path is not None:
            check_input_file(path, kind, flag)
    out = Path(args.output)
    if out.is_dir() or not out.resolve().parent.is_dir():
        raise BadInput(f"{out}: cannot write there (-o/--output needs a file in an existing folder)")
    try:
        info = libclover.read_model_info(args.model, args.bd)
    except loader.NativeError as exc:
        raise BadInput(f"{args.model} is not a clover GGUF: {exc}") from None
    if args.chunk_size > info.n_ctx_train:
        raise BadInput(f"--chunk-size {args.chunk_size} exceeds the model's training context {info.n_ctx_train}")
    text = read_input_text(args.file, CALIBRATION_TEXT, "-f/--file")
    if not text.strip():
        raise BadInput(f"{args.file}: the calibration file is empty")
    model = bindings.LlamaModel(args.model, n_gpu_layers=args.n_gpu_layers, bd_path=args.bd)
    try:
        tokens = model.tokenize(text, add_special=False, parse_special=False)
        if len(tokens) < args.chunk_size:
            raise BadInput(f"{args.file}: {len(tokens)} tokens, fewer than one chunk of {args.chunk_size} "
                           "(use a longer file or a smaller --chunk-size)")
        res = collect(model, tokens, out, dataset=args.file, chunk_size=args.chunk_size, max_chunks=args.chunks,
                      block_size=args.block_size or info.block_size, masked=not args.no_masked, seed=args.seed,
                      mask_id=info.mask_token_id,
                      n_threads=args.threads or None, progress=not args.no_progress)
    finally:
        model.close()
    calib = (f"masked calibration: {res.causal_rows} causal + {res.block_rows} block-window rows, "
             f"{res.masked_inputs} masked inputs, B = {res.block_size}" if res.masked
             else f"AR-only calibration: {res.causal_rows} causal rows")
    chunks = f"{res.n_chunks} chunk{'s' if res.n_chunks != 1 else ''} of {res.chunk_size} tokens"
    print(f"{PROG}: wrote {res.path}: {res.n_entries} entries, {chunks} ({res.n_tokens} of {res.n_tokens_file} "
          f"tokens; {calib}) in {res.seconds:.1f} s", file=sys.stderr)
    return 0


def run_chat_command(args: argparse.Namespace) -> int:
    """The interactive chat (clover_cpp/chat.py)."""
    options.check_model_args(args)
    at_least(("-n/--max-tokens", args.max_tokens, 1))
    from .chat import run_chat

    return run_chat(args)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("CLOVER_NATIVE_QUIET", "1")  # llama.cpp's error log would add lines; we print one
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # llama-server's options are its own: no argparse here (clover_cpp/launch.py)
        from . import launch

        return cli_runner.run(PROG, lambda: launch.main(argv[1:]))
    return cli_runner.run(PROG, lambda: _run(build_parser().parse_args(argv)))


def _run(args: argparse.Namespace) -> int:
    if args.command == "imatrix":
        return run_imatrix(args)
    if args.command == "chat":
        return run_chat_command(args)
    return run_generate(args)


if __name__ == "__main__":
    sys.exit(main())
