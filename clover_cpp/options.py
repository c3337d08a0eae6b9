"""The options of ``clover-cpp generate`` and ``chat``, and what they open: the one home of the engine,
offload and generation arguments (llama.cpp's names and meanings where llama.cpp has the option).

- ``add_model_args``: the GGUF, its sidecar, the context, threads and llama.cpp's offload flags;
  ``add_engine_args`` adds what chat keeps across turns (largest block size, prefix cache, template).
- ``add_generation_args``: mode, block settings and sampling; for generate and chat also llama.cpp's penalty and
  grammar flags (spec 4's distribution stage).
- ``check_model_args`` / ``gen_params``: each value is checked once, here or by ``GenParams``, whose errors are
  turned into the option's name; ``check_grammar`` checks a grammar against the loaded vocabulary.
- ``open_model``: the ``Model`` generate and chat run on.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from clover_common.config_numbers import I32_MAX, I32_MIN
from clover_common.errors import BadInput
from clover_common.input_files import CHAT_TEMPLATE, GGUF, GRAMMAR, JSON_SCHEMA, check_input_file, read_input_text

from .gen_params import MODES, PARAMS, GenParamError, GenParams
from .model import DEFAULT_CACHE_RAM_MIB, DEFAULT_CHECKPOINT_EVERY, Model
from .offload import add_offload_args, offload_from_args

BD_HELP = ("block-diffusion sidecar (NAME.bd.gguf, from clover-convert --bd-sidecar or --bd-only) for a trunk-only "
           "-m file, such as llama.cpp's Clover GGUFs; the block modes need it (docs/gguf-format.md)")
# the option that sets each GenParams field, for the messages of GenParamError (the table: gen_params.PARAMS)
FLAGS = {name: spec.flag for name, spec in PARAMS.items() if spec.flags}

def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model and where it runs (generate, chat)."""
    p.add_argument("-m", "--model", required=True, help="Clover GGUF file")
    p.add_argument("--bd", metavar="FILE", default=None, help=BD_HELP)
    p.add_argument("-c", "--ctx-size", type=int, default=0, help="context size (0 = min(n_ctx_train, 4096))")
    p.add_argument("-t", "--threads", type=int, default=0, help="0 = the physical cores this process may use")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=0)
    p.add_argument("--graph-cache", type=int, default=None, metavar="N",
                   help="compute graphs kept besides the last one, so that alternating pass shapes are built once "
                        "(default 6; 0 = llama.cpp's reuse of the last graph only; each costs one compute buffer)")
    add_offload_args(p)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """add_model_args, and what a chat keeps across turns."""
    add_model_args(p)
    p.add_argument("--max-block-size", type=int, default=0, help="largest block size a turn may use "
                   "(0 = the largest of the model's block size and calibrated sizes)")
    p.add_argument("--think", choices=["on", "off"], default="on", help="enable_thinking by default")
    p.add_argument("--chat-template", "--chat-template-file", dest="chat_template", default=None, metavar="FILE",
                   help="Jinja template instead of the GGUF's")
    p.add_argument("--cache-ram", type=float, default=DEFAULT_CACHE_RAM_MIB, metavar="MiB",
                   help="host memory for the prefix-reuse checkpoints of the recurrent state "
                        f"(default {DEFAULT_CACHE_RAM_MIB}; 0 = only reuse a prompt that extends the history)")
    p.add_argument("--checkpoint-every", type=int, default=DEFAULT_CHECKPOINT_EVERY, metavar="N",
                   help=f"also checkpoint every N prefilled tokens (default {DEFAULT_CHECKPOINT_EVERY}; 0 = only "
                        "where each prompt ends and where it left the previous history)")


def add_generation_args(p: argparse.ArgumentParser, *, max_tokens: int | None, max_tokens_help: str,
                        seed: int | None, draft_steps: bool = False, distribution: bool = False) -> None:
    """Mode, block settings and sampling, with llama.cpp's names for the common ones (--temp, -s/--seed,
    -n/--n-predict, --top-k, --top-p). ``max_tokens`` and ``seed`` are the command's defaults. ``distribution``:
    llama.cpp's penalty and grammar flags too (add_distribution_args)."""
    add_param(p, "mode", choices=MODES)
    for name in ("block_size", "threshold", "coreset_top_p"):
        add_param(p, name, default=None)
    if draft_steps:
        add_param(p, "draft_steps")
        add_param(p, "spec_fused")
    add_param(p, "temperature")
    add_param(p, "max_tokens", default=max_tokens, help=max_tokens_help)
    add_param(p, "top_k")
    add_param(p, "top_p")
    add_param(p, "seed", default=seed)
    if distribution:
        add_distribution_args(p)


def add_param(p: Any, name: str, **overrides: Any) -> None:
    """The option of a GenParams field from its table row (gen_params.PARAMS): its flags, type, default and help;
    ``overrides`` are a command's own (its default, its help)."""
    spec = PARAMS[name]
    field = GenParams.__dataclass_fields__[name]
    kind_name = str(field.type).split(" ")[0]  # "int | None" -> int
    if kind_name == "bool":  # --flag / --no-flag; None (not given) keeps GenParams' default
        kwargs: dict[str, Any] = {"dest": name, "action": argparse.BooleanOptionalAction, "default": None}
    else:
        kind = {"str": str, "int": int, "float": float}[kind_name]
        kwargs = {"dest": name, "type": kind, "default": field.default}
    if spec.help:
        kwargs["help"] = spec.help
    if name == "coreset_top_p":
        kwargs["metavar"] = "P"
    p.add_argument(*spec.flags, **(kwargs | overrides))


def add_distribution_args(p: argparse.ArgumentParser) -> None:
    """llama.cpp's penalty and grammar flags (common/arg.cpp's names): spec 4's distribution
    stage. The penalties count the answer's tokens only, with no last-n window (docs/decoding.md, "Constrained
    decoding")."""
    g = p.add_argument_group("penalties and constrained decoding (spec 4; docs/decoding.md, \"Constrained decoding\")")
    for name in ("repeat_penalty", "presence_penalty", "frequency_penalty"):
        add_param(g, name, default=None, metavar="N")
    one = g.add_mutually_exclusive_group()
    one.add_argument("--grammar", default=None, metavar="GRAMMAR",
                     help="GBNF grammar the answer must match (llama.cpp's grammars/README.md)")
    one.add_argument("--grammar-file", default=None, metavar="FNAME", help="read the GBNF grammar from a file")
    one.add_argument("-j", "--json-schema", default=None, metavar="SCHEMA",
                     help="JSON schema the answer must match, e.g. '{\"type\": \"object\"}' for any JSON object "
                          "(converted to GBNF as llama.cpp converts it)")
    one.add_argument("-jf", "--json-schema-file", default=None, metavar="FILE",
                     help="read the JSON schema from a file")


@contextmanager
def _native_stderr() -> Iterator[list[str]]:
    """What native code writes to stderr (fd 2) inside the body, as a list of lines after it; sys.stderr is left
    alone. llama.cpp's JSON-schema converter prints its warnings with fprintf, past its log callback: caught here,
    they become warnings of their own."""
    lines: list[str] = []
    sys.stderr.flush()
    with tempfile.TemporaryFile() as tmp:
        saved = os.dup(2)
        try:
            os.dup2(tmp.fileno(), 2)
            yield lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines.extend(line for line in tmp.read().decode("utf-8", "replace").splitlines() if line.strip())


def grammar_flag(args: argparse.Namespace) -> str | None:
    """The option that gives the grammar, with its file: --grammar, --grammar-file F, -j/--json-schema or
    -jf/--json-schema-file F; None without one."""
    if getattr(args, "grammar", None):
        return "--grammar"
    if getattr(args, "grammar_file", None):
        return f"--grammar-file {args.grammar_file}"
    if getattr(args, "json_schema", None) is not None:
        return "-j/--json-schema"
    if getattr(args, "json_schema_file", None):
        return f"-jf/--json-schema-file {args.json_schema_file}"
    return None


def grammar_arg(args: argparse.Namespace) -> str | None:
    """The GBNF of --grammar, --grammar-file, -j/--json-schema or -jf/--json-schema-file (a schema converted as
    llama.cpp converts it); None without one. An unreadable file or a schema the converter refuses is a BadInput
    naming the option."""
    flag = grammar_flag(args)
    if flag is None:
        return None
    if flag == "--grammar":
        return str(args.grammar)
    if args.grammar_file:
        return read_input_text(args.grammar_file, GRAMMAR, "--grammar-file")
    schema = args.json_schema if args.json_schema is not None else \
        read_input_text(args.json_schema_file, JSON_SCHEMA, "-jf/--json-schema-file")
    from clover_native import libclover

    with _native_stderr() as printed:
        try:
            grammar = libclover.json_schema_to_grammar(schema)
        except libclover.NativeError as exc:
            raise BadInput(f"{flag}: {exc}") from None
    for line in dict.fromkeys(printed):  # the converter's warnings (a pattern it cannot enforce, say), once each
        print(f"clover-cpp: warning: {flag}: {line.removeprefix('WARNING: ')}", file=sys.stderr)
    return grammar


def check_grammar(model: Model, args: argparse.Namespace, params: GenParams) -> None:
    """The grammar parses against the model's vocabulary and allows some token at its start (Model.check_grammar);
    a BadInput naming the option and, for a syntax error, llama.cpp's reason."""
    if not params.grammar:
        return
    try:
        model.check_grammar(params.grammar)
    except BadInput as exc:
        raise BadInput(f"{grammar_flag(args) or 'grammar'}: {str(exc).removeprefix('grammar: ')}") from None


def at_least(*checks: tuple[str, int | float | None, int]) -> None:
    """(flag, value, lowest allowed) triples; a None value is an option left at its default. A value must also be
    finite and at most 2^31 - 1: the engine holds these counts in 32-bit ints (a larger one would wrap)."""
    for flag, value, low in checks:
        if value is None:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise BadInput(f"{flag} must be a finite number, got {value}")
        if value < low:
            raise BadInput(f"{flag} must be at least {low}, got {value}")
        if value > I32_MAX:
            raise BadInput(f"{flag} must be at most {I32_MAX} (a 32-bit integer), got {value}")


def check_model_args(args: argparse.Namespace) -> None:
    """-m, --bd and --chat-template name regular files (clover_common.input_files); -c, -t and the engine options
    are not negative."""
    check_input_file(args.model, GGUF, "-m/--model")
    if args.bd is not None:
        check_input_file(args.bd, GGUF, "--bd")
    at_least(("-c/--ctx-size", args.ctx_size, 0), ("-t/--threads", args.threads, 0),
             ("-ngl/--n-gpu-layers", args.n_gpu_layers, I32_MIN),
             ("--max-block-size", getattr(args, "max_block_size", None), 0),
             ("--cache-ram", getattr(args, "cache_ram", None), 0),
             ("--checkpoint-every", getattr(args, "checkpoint_every", None), 0),
             ("--prefill-chunk", getattr(args, "prefill_chunk", None), 0),
             ("--graph-cache", args.graph_cache, 0))
    template = getattr(args, "chat_template", None)
    if template:
        check_input_file(template, CHAT_TEMPLATE, "--chat-template")


def gen_params(args: argparse.Namespace, **fields: Any) -> GenParams:
    """The GenParams the options ask for (``fields`` replace some: a command's own max_tokens or seed); a bad value
    is a BadInput naming the option."""
    if args.seed is not None and not 0 <= args.seed < 2**32:
        raise BadInput(f"-s/--seed must be in [0, 2^32), got {args.seed}")
    # every option of the table that was given (None: the field's default, or the GGUF's value)
    values: dict[str, Any] = {name: getattr(args, name) for name in FLAGS if getattr(args, name, None) is not None}
    grammar = grammar_arg(args)
    if grammar:
        values["grammar"] = grammar
    values.update(fields)
    try:
        return GenParams(**values)
    except GenParamError as exc:
        raise BadInput(f"{FLAGS[exc.field]} {exc.rule}, got {exc.shown}") from None


def model_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine's load arguments (``engine_params``): context, threads, offload (llama.cpp's flags), sidecar and,
    for chat, the largest block size."""
    kwargs: dict[str, Any] = {"n_ctx": args.ctx_size, "n_threads": args.threads, "n_gpu_layers": args.n_gpu_layers,
                              "offload": offload_from_args(args), "bd_path": args.bd, "graph_cache": args.graph_cache}
    if getattr(args, "max_block_size", 0):
        kwargs["max_block_size"] = args.max_block_size
    return kwargs


def open_model(args: argparse.Namespace, **extra: Any) -> Model:
    """The Model for generate and chat: ``model_kwargs``, the prefix cache of chat, and ``extra``. With
    --max-block-size (chat), a --block-size above the engine's largest is refused here;
    generate leaves that to the engine."""
    kwargs = model_kwargs(args)
    if hasattr(args, "cache_ram"):
        kwargs |= {"cache_ram_mib": args.cache_ram, "checkpoint_every": args.checkpoint_every}
    model = Model(args.model, **kwargs, **extra)
    if hasattr(args, "max_block_size") and args.block_size is not None and args.block_size > model.max_block_size:
        model.close()
        raise BadInput(f"--block-size {args.block_size} exceeds --max-block-size {model.max_block_size}")
    return model
