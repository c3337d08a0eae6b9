"""`clover-cpp`: the native Clover engine from the command line.

    clover-cpp generate -m MODEL.gguf -p TEXT [--mode auto|ar|diffusion|spec] [--block-size B] [--threshold T]
                        [-n N] [--draft-steps S] [--temp T --top-k K --top-p P -s S] [--json]
    generate, chat and serve also take llama.cpp's names for the common options, as aliases of the same option:
    --temp (--temperature), -s/--seed, -n/--n-predict (--max-tokens), --top-k, --top-p, -c, -t, -ngl.
    generate, chat and serve take llama.cpp's offload flags: -ngl N, -ncmoe/--n-cpu-moe N, -cmoe/--cpu-moe,
    -ot/--override-tensor REGEX=BUFT, -sm/--split-mode none|layer|row, -ts/--tensor-split N0,N1, -mg/--main-gpu I,
    -fitt/--fit-target MiB (clover_cpp/offload.py)
    clover-cpp imatrix -m F16.gguf -f CALIB.txt [-o imatrix.gguf] [--chunk-size 512] [--chunks N]
                       [--block-size B] [--no-masked] [--seed S] [-t N] [-ngl N]       (clover_cpp/imatrix.py)
    clover-cpp chat -m MODEL.gguf [--mode M] [--think on|off] [--visual] ...   (clover_cpp/chat.py)
    clover-cpp serve -m MODEL.gguf [--host H] [--port P] ...                   (clover_cpp/server.py)

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

from .model import DEFAULT_CACHE_RAM_MIB, DEFAULT_CHECKPOINT_EVERY
from .offload import add_offload_args, offload_from_args

PROG = "clover-cpp"
BD_HELP = ("block-diffusion sidecar (NAME.bd.gguf, from clover-convert --bd-sidecar or --bd-only) for a trunk-only "
           "-m file, such as llama.cpp's Clover GGUFs; the block modes need it (docs/gguf-format.md)")
CORESET_HELP = ("the block expert coreset's top_p in (0, 1] for block passes (spec 3.3; default: the GGUF's; "
                "1 = per-row routing)")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description="Clover native decoding engine (llama.cpp + libclover).")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    gen = sub.add_parser("generate", help="continue a prompt with the native engine")
    gen.add_argument("-m", "--model", required=True, help="Clover GGUF file")
    gen.add_argument("--bd", metavar="FILE", default=None, help=BD_HELP)
    gen.add_argument("-p", "--prompt", required=True)
    gen.add_argument("--mode", choices=["ar", "diffusion", "spec", "auto"], default="auto",
                     help="auto (default): lossless, faster than ar where drafts are accepted; "
                          "diffusion changes the output")
    gen.add_argument("--block-size", type=int, default=None)
    gen.add_argument("--threshold", type=float, default=None)
    gen.add_argument("--coreset-top-p", type=float, default=None, metavar="P", help=CORESET_HELP)
    gen.add_argument("--draft-steps", type=int, default=0)
    _add_temperature(gen)
    gen.add_argument("-n", "--n-predict", "--max-tokens", dest="max_tokens", type=int, default=64)
    _add_sampling_args(gen, seed_default=0)
    gen.add_argument("-c", "--ctx-size", type=int, default=0, help="context size (0 = min(n_ctx_train, 4096))")
    gen.add_argument("-t", "--threads", type=int, default=0, help="0 = the physical cores this process may use")
    gen.add_argument("-ngl", "--n-gpu-layers", type=int, default=0)
    add_offload_args(gen)
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
    _add_serve(sub)
    return parser


def _add_sampling_args(p: argparse.ArgumentParser, seed_default: int | None) -> None:
    """--top-k, --top-p and -s/--seed with llama.cpp's names (generate, chat, serve)."""
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("-s", "--seed", type=int, default=seed_default)


def _add_temperature(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temp", "--temperature", dest="temperature", type=float, default=0.0, help="0 = greedy")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """Loading and decoding options shared by chat and serve."""
    p.add_argument("-m", "--model", required=True, help="Clover GGUF file")
    p.add_argument("--bd", metavar="FILE", default=None, help=BD_HELP)
    p.add_argument("-c", "--ctx-size", type=int, default=0, help="context size (0 = min(n_ctx_train, 4096))")
    p.add_argument("-t", "--threads", type=int, default=0, help="0 = the physical cores this process may use")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=0)
    add_offload_args(p)
    p.add_argument("--max-block-size", type=int, default=0, help="largest block size a turn/request may use "
                   "(0 = the largest of the model's block size and calibrated sizes)")
    p.add_argument("--mode", choices=["ar", "diffusion", "spec", "auto"], default="auto",
                   help="auto (default): lossless, faster than ar where drafts are accepted; "
                        "diffusion changes the output")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--threshold", type=float, default=None, help="default: the calibrated threshold for B")
    p.add_argument("--coreset-top-p", type=float, default=None, metavar="P", help=CORESET_HELP)
    _add_temperature(p)
    p.add_argument("--think", choices=["on", "off"], default="on", help="enable_thinking by default")
    p.add_argument("--chat-template", default=None, metavar="FILE", help="Jinja template instead of the GGUF's")
    p.add_argument("--cache-ram", type=float, default=DEFAULT_CACHE_RAM_MIB, metavar="MiB",
                   help="host memory for the prefix-reuse checkpoints of the recurrent state "
                        f"(default {DEFAULT_CACHE_RAM_MIB}; 0 = only reuse a prompt that extends the history)")
    p.add_argument("--checkpoint-every", type=int, default=DEFAULT_CHECKPOINT_EVERY, metavar="N",
                   help=f"also checkpoint every N prefilled tokens (default {DEFAULT_CHECKPOINT_EVERY}; 0 = only "
                        "where each prompt ends and where it left the previous history)")


def _add_chat(sub: argparse._SubParsersAction) -> None:
    chat = sub.add_parser("chat", help="interactive multi-turn chat with the model's chat template")
    _add_engine_args(chat)
    chat.add_argument("-n", "--n-predict", "--max-tokens", dest="max_tokens", type=int, default=1024,
                      help="most tokens per answer")
    _add_sampling_args(chat, seed_default=0)
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--reasoning", choices=["show", "hide"], default="show",
                      help="show the <think> reasoning dimmed, or hide it")
    chat.add_argument("--visual", action="store_true", help="show the canvas filling step by step")
    chat.add_argument("--color", choices=["auto", "always", "never"], default="auto")
    chat.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-generation tokens")


def _add_serve(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (docs/serve.md)")
    _add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8080, help="TCP port (0 = any free port, printed at start)")
    serve.add_argument("--alias", default=None, help="model id clients send (default: the file name without .gguf)")
    serve.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"], default="info")
    serve.add_argument("-np", "--parallel", type=int, default=1, metavar="N",
                       help="slots: requests decoded at once, their passes batched (default 1); -c is divided among "
                            "them, as in llama-server (docs/serve.md, \"Slots\")")
    sec = serve.add_argument_group("security (docs/serve.md, \"Security\")")
    sec.add_argument("--api-key", action="append", default=[], metavar="KEY",
                     help="accept requests to /v1 only with 'Authorization: Bearer KEY' "
                          "(repeatable; /health stays open)")
    sec.add_argument("--api-key-file", default=None, metavar="FILE", help="read API keys from FILE, one per line")
    lim = serve.add_argument_group("limits (0 = none; docs/serve.md, \"Limits\")")
    lim.add_argument("--max-body-bytes", type=int, default=8 * 2**20, metavar="N",
                     help="largest request body (default 8 MiB; larger: 413)")
    lim.add_argument("--max-messages", type=int, default=1024, metavar="N",
                     help="most messages in a chat (default 1024)")
    lim.add_argument("--max-prompt-chars", type=int, default=0, metavar="N",
                     help="most characters of a prompt, checked before tokenizing (default 0: 64 x n_ctx)")
    lim.add_argument("--max-queue", type=int, default=64, metavar="N",
                     help="most requests waiting for the engine (default 64; more: 429)")
    lim.add_argument("--template-timeout", type=float, default=10.0, metavar="S",
                     help="seconds to render the chat template and tokenize one request (default 10)")
    # llama-server's sampling options: defaults for what a request leaves out
    serve.add_argument("-n", "--n-predict", "--max-tokens", dest="max_tokens", type=int, default=None,
                       help="max_tokens of a chat request that sets none (default: what the context leaves)")
    _add_sampling_args(serve, seed_default=None)


def _check(args: argparse.Namespace) -> None:
    _check_files(args)
    if args.block_size is not None and args.block_size < 1:
        raise BadInput(f"--block-size must be at least 1, got {args.block_size}")
    if args.max_tokens < 0:
        raise BadInput(f"-n/--max-tokens must be >= 0, got {args.max_tokens}")
    if args.draft_steps < 0:
        raise BadInput(f"--draft-steps must be >= 0, got {args.draft_steps}")
    _check_threshold(args)
    if args.temperature < 0:
        raise BadInput(f"--temperature must be >= 0, got {args.temperature}")
    _check_top(args)


def _check_threshold(args: argparse.Namespace) -> None:
    """--threshold (generate, chat, serve): a probability; left out, the calibrated one for B. --coreset-top-p: in
    (0, 1]; left out, the GGUF's."""
    if args.threshold is not None and not 0.0 <= args.threshold <= 1.0:
        raise BadInput(f"--threshold must be in [0, 1], got {args.threshold}")
    if args.coreset_top_p is not None and not 0.0 < args.coreset_top_p <= 1.0:  # NaN fails too
        raise BadInput(f"--coreset-top-p must be in (0, 1], got {args.coreset_top_p}")


def _check_top(args: argparse.Namespace) -> None:
    """--top-p, --top-k and -s/--seed (generate, chat and serve)."""
    if args.seed is not None and not 0 <= args.seed < 2**32:
        raise BadInput(f"-s/--seed must be in [0, 2^32), got {args.seed}")
    if not 0.0 < args.top_p <= 1.0:
        raise BadInput(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        raise BadInput(f"--top-k must be >= 0, got {args.top_k}")


def _at_least(*checks: tuple[str, int | None, int]) -> None:
    """(flag, value, lowest allowed) triples; a None value is an option left at its default."""
    for flag, value, low in checks:
        if value is not None and value < low:
            raise BadInput(f"{flag} must be at least {low}, got {value}")


def run_generate(args: argparse.Namespace) -> int:
    from .model import Model

    _check(args)
    with Model(args.model, **model_kwargs(args)) as model:
        prompt_ids = model.tokenize(args.prompt)
        if not prompt_ids:
            raise BadInput("the prompt is empty after tokenization (--prompt)")
        gen = model.generate(prompt_ids, mode=args.mode, block_size=args.block_size, threshold=args.threshold,
                             draft_steps=args.draft_steps, max_tokens=args.max_tokens,
                             temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                             coreset_top_p=args.coreset_top_p)
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

    extra = {"threads": stats.threads, "seconds": seconds, "block_ms": stats.block_ms, "causal_ms": stats.causal_ms}
    if stats.mode == "auto":
        extra |= {"auto_rounds": dict(stats.auto_rounds), "auto_drafted": stats.auto_drafted,
                  "auto_accepted": stats.auto_accepted, "costs": vars(stats.costs) if stats.costs else None}
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

    from . import libclover, loader, bindings
    from .imatrix import collect

    _at_least(("--chunk-size", args.chunk_size, 1), ("--chunks", args.chunks, 1),
              ("--block-size", args.block_size, 1), ("-t/--threads", args.threads, 0),
              ("-ngl/--n-gpu-layers", args.n_gpu_layers, -1), ("--seed", args.seed, 0))
    for flag, path in (("-m/--model", args.model), ("-f/--file", args.file), ("--bd", args.bd)):
        if path is not None and not os.path.isfile(path):
            raise BadInput(f"{path}: no such file ({flag})")
    out = Path(args.output)
    if out.is_dir() or not out.resolve().parent.is_dir():
        raise BadInput(f"{out}: cannot write there (-o/--output needs a file in an existing folder)")
    try:
        info = libclover.read_model_info(args.model, args.bd)
    except loader.NativeError as exc:
        raise BadInput(f"{args.model} is not a clover GGUF: {exc}") from None
    if args.chunk_size > info.n_ctx_train:
        raise BadInput(f"--chunk-size {args.chunk_size} exceeds the model's training context {info.n_ctx_train}")
    try:
        text = Path(args.file).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise BadInput(f"{args.file}: not UTF-8 text (byte {exc.start})") from None
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


def model_kwargs(args: argparse.Namespace) -> dict:
    """Model(path, **these) for generate, chat and serve: loading options, offload (llama.cpp's flags) included."""
    kwargs = {"n_ctx": args.ctx_size, "n_threads": args.threads, "n_gpu_layers": args.n_gpu_layers,
              "offload": offload_from_args(args), "bd_path": args.bd}
    if getattr(args, "max_block_size", 0):
        kwargs["max_block_size"] = args.max_block_size
    return kwargs


def _check_files(args: argparse.Namespace) -> None:
    """-m and --bd name existing files."""
    if not os.path.isfile(args.model):
        raise BadInput(f"{args.model}: no such file")
    if args.bd is not None and not os.path.isfile(args.bd):
        raise BadInput(f"{args.bd}: no such file (--bd)")


def _check_engine_args(args: argparse.Namespace) -> None:
    """Checks for _add_engine_args (chat and serve)."""
    _check_files(args)
    _at_least(("-c/--ctx-size", args.ctx_size, 0), ("--max-block-size", args.max_block_size, 0),
              ("--block-size", args.block_size, 1), ("-t/--threads", args.threads, 0),
              ("--cache-ram", args.cache_ram, 0), ("--checkpoint-every", args.checkpoint_every, 0))
    _check_threshold(args)
    if args.temperature < 0:
        raise BadInput(f"--temperature must be >= 0, got {args.temperature}")
    if args.chat_template and not os.path.isfile(args.chat_template):
        raise BadInput(f"{args.chat_template}: no such file (--chat-template)")


def run_chat_command(args: argparse.Namespace) -> int:
    """The interactive chat (clover_cpp/chat.py)."""
    _check_engine_args(args)
    _at_least(("-n/--max-tokens", args.max_tokens, 1))
    _check_top(args)
    from .chat import run_chat

    return run_chat(args)


def run_serve_command(args: argparse.Namespace) -> int:
    """The OpenAI-compatible server (clover_cpp/server.py)."""
    _check_engine_args(args)
    if not 0 <= args.port <= 65535:
        raise BadInput(f"--port must be in 0..65535, got {args.port}")
    _at_least(("--max-body-bytes", args.max_body_bytes, 0), ("--max-messages", args.max_messages, 0),
              ("--max-prompt-chars", args.max_prompt_chars, 0), ("--max-queue", args.max_queue, 0),
              ("-np/--parallel", args.parallel, 1))
    if not args.template_timeout >= 0:
        raise BadInput(f"--template-timeout must be >= 0, got {args.template_timeout}")
    for key in args.api_key:
        if not key or key != key.strip() or not key.isprintable() or not key.isascii():
            raise BadInput("--api-key: a key must be printable ASCII without surrounding spaces")
    if args.api_key_file:
        try:
            lines = open(args.api_key_file, encoding="utf-8").read().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise BadInput(f"{args.api_key_file}: cannot read the API keys "
                           f"({getattr(exc, 'strerror', None) or exc}) (--api-key-file)") from None
        keys = [line.strip() for line in lines if line.strip()]
        if not keys:
            raise BadInput(f"{args.api_key_file}: holds no API key (--api-key-file: one key per line)")
        bad = [i + 1 for i, line in enumerate(lines) if line.strip() and not (line.strip().isprintable()
                                                                           and line.strip().isascii())]
        if bad:
            raise BadInput(f"{args.api_key_file}: line {bad[0]} is not a printable ASCII key (--api-key-file)")
        args.api_key += keys
    _at_least(("-n/--n-predict", args.max_tokens, 1))
    _check_top(args)
    from .server import run_serve

    return run_serve(args)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("CLOVER_NATIVE_QUIET", "1")  # llama.cpp's error log would add lines; we print one
    return cli_runner.run(PROG, lambda: _run(build_parser().parse_args(argv)))


def _run(args: argparse.Namespace) -> int:
    if args.command == "imatrix":
        return run_imatrix(args)
    if args.command == "chat":
        return run_chat_command(args)
    if args.command == "serve":
        return run_serve_command(args)
    return run_generate(args)


if __name__ == "__main__":
    sys.exit(main())
