"""`clover-quantize IN.gguf [OUT.gguf] TYPE`: quantize a Clover GGUF with the patched llama.cpp.

Bad input prints exactly one line (``clover-quantize: error: ...``) and exits with status 2; nothing is
written then. An output that is not a regular file (a device, a directory) or that is one of the inputs is
refused. SIGINT, SIGTERM and SIGHUP print one line and leave no partial output. ``--dry-run`` prints
llama.cpp's per-tensor plan and the resulting size.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TextIO

from clover_common import cli_runner, safe_output
from clover_common.cli_runner import OneLineParser
from clover_common.errors import BadInput

from .run import Plan, QuantizeOptions, imatrix_advice, native_call_running, quantize
from .file_types import FILE_TYPES, UnknownTypeError, file_type, tensor_type

PROG = "clover-quantize"


def _type_list() -> str:
    return "\n".join(f"  {t.name:<7} {t.description}" for t in FILE_TYPES)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage=f"{PROG} IN.gguf [OUT.gguf] TYPE [options]",
        description="Quantize a Clover GGUF (from clover-convert) with llama.cpp's mixes and the Clover rules: "
                    "the Clover tensors, norms, ssm_a, dt, conv, router and shared-expert gate stay F32; "
                    "ssm_alpha/ssm_beta stay at Q8_0 or better.",
        epilog="types:\n" + _type_list())
    parser.add_argument("input", type=Path, metavar="IN.gguf")
    parser.add_argument("args", nargs="*", metavar="[OUT.gguf] TYPE",
                        help="output file (default: IN with the type in its name) and the type, listed below")
    parser.add_argument("--imatrix", type=Path, metavar="FILE", help="importance matrix (clover-cpp imatrix)")
    parser.add_argument("--tensor-type", action="append", default=[], metavar="REGEX=TYPE",
                        help="quantize tensors whose name matches REGEX to TYPE (repeatable; first match wins)")
    parser.add_argument("--output-tensor-type", metavar="T", help="type of output.weight")
    parser.add_argument("--token-embedding-type", metavar="T", help="type of token_embd.weight")
    parser.add_argument("--threads", type=int, default=0, metavar="N", help="threads (default: all cores)")
    parser.add_argument("--dry-run", action="store_true", help="print the per-tensor plan and size; write nothing")
    parser.add_argument("--keep-split", action="store_true", help="write as many shards as the input has")
    parser.add_argument("--allow-requantize", action="store_true", help="accept an already quantized input")
    return parser


def _options(args: argparse.Namespace) -> QuantizeOptions:
    if not args.args:
        raise BadInput("expected IN.gguf [OUT.gguf] TYPE: the TYPE is missing (see --help for the types)")
    if len(args.args) > 2:
        raise BadInput(f"expected IN.gguf [OUT.gguf] TYPE, got {len(args.args) + 1} positional arguments")
    out = Path(args.args[0]) if len(args.args) == 2 else None
    try:
        ft = file_type(args.args[-1])
        overrides = []
        for item in args.tensor_type:
            pattern, sep, name = item.rpartition("=")
            if not sep or not pattern:
                raise BadInput(f"--tensor-type expects REGEX=TYPE, got '{item}'")
            overrides.append((pattern, tensor_type(name)))
        output_t = tensor_type(args.output_tensor_type) if args.output_tensor_type else None
        embd_t = tensor_type(args.token_embedding_type) if args.token_embedding_type else None
    except UnknownTypeError as exc:
        raise BadInput(str(exc)) from None
    if args.threads < 0:
        raise BadInput(f"--threads must be >= 0, got {args.threads}")
    return QuantizeOptions(input=args.input, file_type=ft, output=out, imatrix=args.imatrix,
                           tensor_types=overrides, output_tensor_type=output_t, token_embedding_type=embd_t,
                           threads=args.threads, dry_run=args.dry_run, keep_split=args.keep_split,
                           allow_requantize=args.allow_requantize)


def _shape(shape: tuple[int, ...]) -> str:
    return "{" + ", ".join(str(d) for d in shape) + "}"


def print_plan(plan: Plan, out: TextIO) -> None:
    """One line per tensor (name, ggml shape, type now -> type written, bytes), then the totals."""
    for t in plan.tensors:
        arrow = f"{t.src_type.name:>5} -> {t.dst_type.name:<6}"
        print(f"{t.name:<40} {_shape(t.shape):<22} {arrow} {t.dst_bytes:>15,d}", file=out)
    print(f"{len(plan.tensors)} tensors: {plan.src_bytes:,d} -> {plan.dst_bytes:,d} bytes "
          f"({plan.dst_bytes / 2**30:.2f} GiB, {plan.bits_per_weight:.2f} bits per weight) as {plan.file_type.name}",
          file=out)
    for name, (count, nbytes) in plan.types_by_count().items():
        print(f"  {name:<7} {count:5d} tensors {nbytes:>17,d} bytes", file=out)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("CLOVER_NATIVE_QUIET", "1")  # llama.cpp's error lines are folded into ours
    return cli_runner.run(PROG, lambda: _run(build_parser().parse_args(argv)), writes_output=True,
                          abandon=native_call_running)  # llama.cpp cannot be stopped: leave without waiting


def _run(args: argparse.Namespace) -> int:
    opts = _options(args)
    advice = imatrix_advice(opts.file_type, opts.input) if opts.imatrix is None else None
    if advice:
        print(f"{PROG}: note: {advice}", file=sys.stderr)
    with safe_output.signals_cleanup():  # SIGTERM/SIGHUP unwind and remove the temporary folder
        result = quantize(opts)
    if opts.dry_run:
        print_plan(result.plan, sys.stdout)
    else:
        for path in result.paths:
            print(path)
        plan = result.plan
        print(f"{PROG}: {plan.file_type.name}: "
              f"{plan.src_bytes / 2**20:.1f} MiB -> {plan.dst_bytes / 2**20:.1f} MiB "
              f"({plan.bits_per_weight:.2f} bpw)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

