"""``clover-cpp serve``: llama.cpp's llama-server, from the patched tree this toolkit builds, with Clover's defaults.

Every llama-server flag and every ``LLAMA_ARG_*`` variable passes through with its llama-server meaning. The flags
of the earlier FastAPI server keep working where llama-server has their meaning (``FLAGS``: mapped to its name),
and are refused with one line naming the replacement where it has not. What this adds to a launch line, unless the
line or its variables already say (docs/serve.md, "clover-cpp serve"):

- for a Clover GGUF, ``--spec-type ngram-mod,draft-clover`` (``ngram-mod`` for a file without block passes), so that
  ``--mode auto``, llama-server's default, is the speculative policy of docs/decoding.md;
- ``--path`` to the web chat with the live block canvas (``WEBUI``: this package's static files; llama-server's own
  UI is not built), unless the line turns the UI off (``--no-webui``);
- nothing else: the sampling defaults come from the GGUF (llama.cpp's ``general.sampling.*`` keys), and ``-c 0``,
  llama-server's default, is the model's trained context, which llama.cpp's ``-fit`` lowers when memory is short.

The process becomes llama-server (exec): its log, its exit status, and its handling of Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from clover_common.errors import BadInput
from clover_common.input_files import GGUF, check_input_file

PROG = "clover-cpp serve"
LOG_LEVELS = {"critical": "1", "error": "1", "warning": "2", "info": "3", "debug": "4"}  # llama.cpp's -lv


@dataclass(frozen=True)
class Flag:
    """An earlier ``clover-cpp serve`` flag: its names, whether it takes a value, and what it becomes (the
    llama-server arguments for the value given, or BadInput naming the replacement)."""

    names: tuple[str, ...]
    takes_value: bool
    becomes: Callable[[str], list[str]]


def _refused(flag: str, replacement: str) -> Callable[[str], list[str]]:
    def refuse(_: str) -> list[str]:
        raise BadInput(f"{flag} is not a llama-server option: {replacement} (docs/serve.md, \"Flags of the earlier "
                       "server\")")
    return refuse


def _renamed(name: str, *, drop: str | None = None) -> Callable[[str], list[str]]:
    """The value under llama-server's name; ``drop``: the earlier server's value for "the default", left out."""
    return lambda value: [] if value == drop else [name, value]


def _chat_template(value: str) -> list[str]:
    """The earlier server took a file; llama-server takes a built-in name or the template's text, and
    --chat-template-file a file."""
    return ["--chat-template-file", value] if Path(value).is_file() else ["--chat-template", value]


def _cache_ram(value: str) -> list[str]:
    try:
        mib = float(value)
    except ValueError:
        raise BadInput(f"--cache-ram must be a number of MiB, got {value!r}") from None
    if not math.isfinite(mib) or mib < 0:
        raise BadInput(f"--cache-ram must be a finite number of MiB >= 0, got {value!r}")
    return ["--cache-ram", str(math.ceil(mib))]


def _log_level(value: str) -> list[str]:
    if value not in LOG_LEVELS:
        raise BadInput(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {value!r}")
    return ["--log-verbosity", LOG_LEVELS[value]]


def _think(value: str) -> list[str]:
    if value not in ("on", "off"):
        raise BadInput(f"--think must be on or off, got {value!r}")
    return ["--reasoning", value]


FLAGS: tuple[Flag, ...] = (
    Flag(("--think",), True, _think),
    Flag(("--chat-template",), True, _chat_template),
    Flag(("--max-tokens",), True, _renamed("--n-predict")),
    Flag(("--max-block-size",), True, _renamed("--max-block-size", drop="0")),
    Flag(("--cache-ram",), True, _cache_ram),
    Flag(("--log-level",), True, _log_level),
    Flag(("--prefill-chunk",), True, _renamed("--batch-size", drop="0")),
    Flag(("--bd",), True, _refused("--bd", "llama-server reads one GGUF; convert without --bd-sidecar "
                                   "(clover-convert MODEL OUT.gguf), or serve the trunk alone for ar")),
    Flag(("--checkpoint-every",), True, _refused("--checkpoint-every", "llama-server checkpoints at user messages "
                                                 "and where the generation prompt starts; --ctx-checkpoints N caps "
                                                 "how many a slot keeps")),
    Flag(("--max-body-bytes",), True, _refused("--max-body-bytes", "no replacement yet (llama-server's body limit "
                                               "is cpp-httplib's)")),
    Flag(("--max-prompt-chars",), True, _refused("--max-prompt-chars", "-c bounds a prompt's tokens")),
)
_BY_NAME = {name: flag for flag in FLAGS for name in flag.names}
MODEL_FLAGS = ("-m", "--model")
SPEC_TYPE_FLAGS = ("--spec-type",)
PATH_FLAGS = ("--path",)
NO_UI_FLAGS = ("--no-ui", "--no-webui")
WEBUI = Path(__file__).resolve().parent / "webui"


@dataclass
class LaunchLine:
    """llama-server's arguments for a ``clover-cpp serve`` command line, what was added to it, and the model's clover
    settings (None: no model named, or not a Clover GGUF)."""

    args: list[str]
    model: str | None
    added: list[str]
    info: object | None = None


def _split(arg: str) -> tuple[str, str | None]:
    """``--name=value`` -> (name, value); anything else -> (arg, None)."""
    if arg.startswith("--") and "=" in arg:
        name, value = arg.split("=", 1)
        return name, value
    return arg, None


def translate(argv: Sequence[str]) -> tuple[list[str], str | None, set[str]]:
    """(llama-server's arguments, the -m file if the line names one, the flags it gives among those Clover's
    defaults yield to: --spec-type, --path, --no-webui). The earlier server's flags become llama-server's (FLAGS);
    every other argument passes through unchanged, in order."""
    out: list[str] = []
    model: str | None = None
    given: set[str] = set()
    i = 0
    while i < len(argv):
        name, inline = _split(argv[i])
        flag = _BY_NAME.get(name)
        takes_value = flag.takes_value if flag else name in MODEL_FLAGS + SPEC_TYPE_FLAGS + PATH_FLAGS
        value = inline
        if takes_value and value is None:
            if i + 1 >= len(argv):
                raise BadInput(f"{name} needs a value")
            value = argv[i + 1]
            i += 1
        i += 1
        if flag is not None:
            out += flag.becomes(value or "")
            continue
        if name in MODEL_FLAGS:
            model = value
        if name in SPEC_TYPE_FLAGS + PATH_FLAGS + NO_UI_FLAGS:
            given.add(name.removeprefix("--").removeprefix("no-"))
        out += [name, value] if takes_value and inline is None else [argv[i - 1]]
    return out, model, given


def launch_line(argv: Sequence[str], env: Mapping[str, str], read_info: Callable[[str], object | None]
                ) -> LaunchLine:
    """The whole launch line: translate(), then Clover's defaults for what neither the line nor ``env``'s
    LLAMA_ARG_* variables set. ``read_info``: the file's clover settings (libclover's model info), None when it is
    not a Clover GGUF."""
    args, model, given = translate(argv)
    model = model or env.get("LLAMA_ARG_MODEL")
    added: list[str] = []
    info = None
    if model is not None:
        check_input_file(model, GGUF, "-m/--model")
        info = read_info(model)
        if info is not None and "spec-type" not in given and "LLAMA_ARG_SPEC_TYPE" not in env:
            kinds = "ngram-mod,draft-clover" if getattr(info, "has_block_diffusion") else "ngram-mod"
            added += ["--spec-type", kinds]
    ui_off = "webui" in given or "ui" in given or env.get("LLAMA_ARG_UI", "").lower() in ("0", "false", "off")
    if not ui_off and "path" not in given and "LLAMA_ARG_STATIC_PATH" not in env:
        added += ["--path", str(WEBUI)]
    return LaunchLine(args + added, model, added, info)


def _clover_info(path: str) -> object | None:
    from clover_native import libclover, loader

    try:
        return libclover.read_model_info(path)
    except loader.NativeError:
        return None  # not a Clover GGUF: llama-server serves it as it would


def llama_server_path() -> Path:
    from clover_native import loader

    path = loader.tool_path("llama-server")
    if not path.is_file():
        d = loader.lib_dir()
        raise BadInput(f"llama-server is not built: none in {d} or {d.parent / 'bin'} (run `make setup`)")
    return path


def _context_line(line: LaunchLine, env: Mapping[str, str]) -> str:
    """What the context will be, and why: -c as given (also as --ctx-size=N), or the model's trained context."""
    args = line.args
    for i, arg in enumerate(args):
        name, inline = _split(arg)
        value = inline if inline is not None else (args[i + 1] if i + 1 < len(args) else None)
        if name in ("-c", "--ctx-size") and value not in (None, "0"):
            return f"context {value} tokens (-c), shared by the slots (-np)"
    if env.get("LLAMA_ARG_CTX_SIZE", "0") != "0":
        return f"context {env['LLAMA_ARG_CTX_SIZE']} tokens (LLAMA_ARG_CTX_SIZE), shared by the slots (-np)"
    trained = f" of {getattr(line.info, 'n_ctx_train')} tokens" if line.info is not None else ""
    return (f"context: the model's trained context{trained} (-c 0), shared by the slots (-np); llama.cpp's -fit "
            "lowers it when device memory is short and logs what it chose")


def main(argv: Sequence[str]) -> int:
    """Print what is added and chosen, then become llama-server."""
    exe = llama_server_path()
    if any(a in ("-h", "--help", "--usage") for a in argv):
        print(__doc__.strip().split("\n\n")[0], "\nllama-server's options follow; docs/serve.md has the table of "
              "the earlier server's flags.\n", flush=True)
        os.execv(exe, [str(exe), "--help"])
    line = launch_line(argv, os.environ, _clover_info)
    if line.model is not None:
        added = " ".join(line.added) if line.added else "nothing (the line sets it)"
        print(f"{PROG}: {line.model}: Clover's defaults added: {added}; "
              f"{_context_line(line, os.environ)}", file=sys.stderr, flush=True)
    os.execv(exe, [str(exe), *line.args])
