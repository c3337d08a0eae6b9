"""``clover-convert``: convert a Clover Hugging Face checkpoint to GGUF (architecture ``clover_moe``).

    clover-convert MODEL_DIR [OUT.gguf | --outfile OUT.gguf] [--outtype f32|f16|bf16|q8_0|auto|TYPE]
        [--imatrix FILE] [--split-max-size N(K|M|G)] [--split-max-tensors N] [--dry-run] [--metadata FILE]
        [--threads N] [--mask-token ID|TEXT] [--block-size N] [--threshold X] [--bd-sidecar]
    clover-convert MODEL_DIR --bd-only OUT.bd.gguf [block-diffusion settings]

TYPE is one of clover-quantize's types (Q4_K_M, Q8_0, IQ4_XS, ...): the checkpoint is converted and
quantized in one pass (clover_convert.onepass), with the file clover-quantize would write.

Bad input or an output that cannot be written ends with a one-line message and exit code 2, and leaves
no output file behind. An output that is not a regular file (a device such as /dev/null, a directory) or
that is one of the inputs is refused (symlinks resolved). SIGINT, SIGTERM and SIGHUP end with one line and
remove the temporary directory; one a killed run left is swept by the next run of the same output.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from pathlib import Path
from typing import Callable, Sequence, TextIO

from clover_common import cli_runner, safe_output
from clover_common.block_settings import Overrides
from clover_common.layout import ARCH_SPELLINGS, CONV_RIGHT_ORDERS, GGUF_ARCH
from clover_common.cli_runner import OneLineParser
from clover_common.errors import BadInput

from clover_quantize.file_types import FILE_TYPES

from .converter import UNQUANTIZED_FILE_TYPES, ConvertOptions, ConvertResult, convert, quantization_type
from .tensor_plan import OutType

PROG = "clover-convert"


def split_size(text: str) -> int:
    """llama.cpp's --split-max-size: a number of bytes, optionally with a decimal K, M or G suffix."""
    units = {"K": 1000, "M": 1000**2, "G": 1000**3}
    number, unit = (text[:-1], units[text[-1]]) if text[-1:] in units else (text, 1)
    if not number.isdigit() or int(number) <= 0:
        raise argparse.ArgumentTypeError(f"invalid split size {text!r}: expected a positive number, "
                                         "optionally followed by K, M or G")
    return int(number) * unit


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _float_option(text: str, ok: Callable[[float], bool], expected: str) -> float:
    """An option's number; argparse's one-line error naming ``expected`` when it is not one or ``ok`` refuses it."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not ok(value):  # NaN fails every range check
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def arch_name(text: str) -> str:
    """--arch-name: a GGUF key prefix (letters, digits, '_' and '-')."""
    if not text or not all(c.isalnum() or c in "_-" for c in text):
        raise argparse.ArgumentTypeError(f"expected an architecture name of letters, digits, '_' or '-', got {text!r}")
    return text


def unit_float(text: str) -> float:
    return _float_option(text, lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]")


def coreset_float(text: str) -> float:
    return _float_option(text, lambda v: 0.0 < v <= 1.0, "a number in (0, 1]")


def finite_float(text: str) -> float:
    return _float_option(text, math.isfinite, "a finite number")


QUANT_TYPES = [t.name for t in FILE_TYPES if t.name not in UNQUANTIZED_FILE_TYPES]


def out_type(text: str) -> str:
    if text in [t.label for t in OutType] + ["auto"] or quantization_type(text) is not None:
        return text
    raise argparse.ArgumentTypeError(f"unknown type {text!r}: choose one of "
                                     f"{', '.join([t.label for t in OutType] + ['auto'] + QUANT_TYPES)}")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description="Convert a Clover Hugging Face checkpoint to GGUF "
                     "(spec v2, architecture 'clover_moe'), streaming with bounded memory; or convert and quantize it "
                     "in one "
                     "pass (--outtype Q4_K_M and the other clover-quantize types).")
    parser.add_argument("model", type=Path, help="the Hugging Face checkpoint directory")
    parser.add_argument("outfile_arg", type=Path, nargs="?", metavar="OUT.gguf",
                        help="output file (same as --outfile)")
    parser.add_argument("--outfile", type=Path, help="output file or directory; default: "
                        "{Name}-{SizeLabel}-{Type}.gguf in the model directory; '{ftype}' is replaced by the type")
    parser.add_argument("--outtype", default="auto", type=out_type, metavar="TYPE",
                        help="f32, f16, bf16, q8_0 (the converter's own), auto (default: bf16 for BF16 sources, "
                             "f16 for F16/F32), or a clover-quantize type, written in one pass: "
                             + ", ".join(QUANT_TYPES) + " (Q8_0 in capitals is llama.cpp's Q8_0 mix)")
    parser.add_argument("--imatrix", type=Path, metavar="FILE",
                        help="importance matrix for a quantization type (as clover-quantize --imatrix)")
    parser.add_argument("--split-max-size", type=split_size, default=0, metavar="N(K|M|G)",
                        help="start a new shard before a shard would exceed this size")
    parser.add_argument("--split-max-tensors", type=positive_int, default=0, metavar="N",
                        help="at most N tensors per shard")
    parser.add_argument("--dry-run", action="store_true",
                        help="print every tensor's name, shape, type and bytes and the total; read no tensor data")
    parser.add_argument("--skeleton", action="store_true",
                        help="with --dry-run: also write OUT.gguf with the real header and a sparse all-zero data "
                             "region (full size, almost no disk), for planning tools such as "
                             "`clover-quantize --dry-run`; never run it")
    parser.add_argument("--metadata", type=Path, metavar="FILE", help="JSON file overriding general.* keys")
    parser.add_argument("--threads", type=positive_int, default=None, metavar="N",
                        help="threads that read and encode chunks ahead of the writer; each adds one chunk "
                             "(about 100 MiB) of memory (default: min(2, CPUs)); with a quantization type, the "
                             "threads that quantize each chunk's rows (default: all CPUs; memory does not grow)")
    settings = parser.add_argument_group("block-diffusion settings (spec 2.2; override config.json and "
                                         "generation_config.json)")
    settings.add_argument("--mask-token", metavar="ID|TEXT",
                          help="the mask token, by id or by its text (default: mask_token_id or mask_id, else the "
                               "one added special token whose text contains 'mask')")
    settings.add_argument("--block-size", type=positive_int, metavar="N",
                          help="the block size (default: block_size, block_length or diffusion_block_size; 32)")
    settings.add_argument("--threshold", type=unit_float, metavar="X",
                          help="the LowConfidence threshold in [0, 1] (default: confidence_threshold, threshold "
                               "or diffusion_threshold; 0.95)")
    settings.add_argument("--coreset-top-p", type=coreset_float, metavar="P",
                          help="the block expert coreset's top_p in (0, 1] (default: coreset_top_p or "
                               "block_coreset_top_p; 1 = off, per-row routing)")
    settings.add_argument("--history-rows", type=positive_int, metavar="N",
                          help="the rows of a full window, the history slot's normaliser (default: history_rows; 32)")
    settings.add_argument("--history-readout-scale", type=finite_float, metavar="X",
                          help="the scale of the history readout S^T q (default: 1/sqrt(linear_key_head_dim))")
    settings.add_argument("--conv-right-order", choices=CONV_RIGHT_ORDERS, default="cd",
                          help="the layout of a flat conv_right_weight [conv_dim*K_r]: cd = [channel][tap] "
                               "(default, cortiq's), dc = [tap][channel]")
    forms = parser.add_argument_group("where the block-diffusion tensors go (spec 5, docs/gguf-format.md)")
    form = forms.add_mutually_exclusive_group()
    form.add_argument("--bd-sidecar", action="store_true",
                      help="write a trunk-only OUT.gguf (what llama.cpp's converter writes) and the block-diffusion "
                           "keys and tensors in OUT.bd.gguf beside it; load both with --bd OUT.bd.gguf")
    form.add_argument("--bd-only", type=Path, metavar="OUT.bd.gguf",
                      help="write only the sidecar, for a trunk made elsewhere (llama.cpp's Clover GGUFs): reads "
                           "only the block-diffusion tensors of the checkpoint")
    parser.add_argument("--arch-name", type=arch_name, default=GGUF_ARCH, metavar="NAME",
                        help=f"the GGUF architecture string (default {GGUF_ARCH}; the loader also takes "
                             f"{', '.join(a for a in ARCH_SPELLINGS if a != GGUF_ARCH)})")
    parser.add_argument("--allow-nonfinite", action="store_true",
                        help="convert weights that hold NaN or inf (a warning names each tensor and the count); "
                             "without it they are an error")
    return parser


def print_plan(result: ConvertResult, out: TextIO) -> None:
    for tensor in result.plan.tensors:
        ne = "{" + ", ".join(str(n) for n in reversed(tensor.shape)) + "}"
        print(f"{tensor.name:<40} {ne:<24} {tensor.ggml_type.name:<5} {tensor.nbytes:>14,d}", file=out)
    total = result.plan.nbytes
    print(f"{len(result.plan.tensors)} tensors, {total:,d} bytes ({total / 2**30:.2f} GiB) of tensor data, "
          f"--outtype {result.out_type.label}", file=out)
    for path, (count, nbytes) in zip(result.paths, result.shard_sizes):
        print(f"would write {path}: {count} tensors, {nbytes:,d} bytes", file=out)


def main(argv: Sequence[str] | None = None) -> int:
    return cli_runner.run(PROG, lambda: _run(build_parser().parse_args(argv)), writes_output=True)


def _run(args: argparse.Namespace) -> int:
    if args.outfile_arg is not None and args.outfile is not None:
        raise BadInput("give the output file either as OUT.gguf or as --outfile, not both")
    if args.skeleton and not args.dry_run:
        raise BadInput("--skeleton goes with --dry-run")
    if args.bd_only is not None and (args.outfile_arg is not None or args.outfile is not None):
        raise BadInput("--bd-only OUT.bd.gguf names the only output: leave out OUT.gguf and --outfile")
    _log_warnings_to_stderr()
    quant = quantization_type(args.outtype)
    threads = args.threads or ((os.cpu_count() or 1) if quant is not None else min(2, os.cpu_count() or 1))
    options = ConvertOptions(
        model_dir=args.model, outfile=args.outfile or args.outfile_arg, outtype=args.outtype,
        split_max_size=args.split_max_size, split_max_tensors=args.split_max_tensors, dry_run=args.dry_run,
        skeleton=args.skeleton,
        metadata=args.metadata, threads=threads, allow_nonfinite=args.allow_nonfinite, imatrix=args.imatrix,
        block_settings=Overrides(args.mask_token, args.block_size, args.threshold, args.coreset_top_p,
                                 args.history_rows, args.history_readout_scale),
        conv_right_order=args.conv_right_order, arch=args.arch_name,
        bd_form="only" if args.bd_only is not None else "sidecar" if args.bd_sidecar else "single",
    )
    if args.bd_only is not None:
        options.outfile = args.bd_only
    with safe_output.signals_cleanup():  # SIGTERM/SIGHUP unwind and remove the temporary directory
        result = convert(options)
    if args.dry_run:
        print_plan(result, sys.stdout)
        if args.skeleton:
            for path in result.paths:
                print(f"wrote skeleton {path} (sparse; zero weights, for planning only)")
    else:
        for path in result.paths:
            print(path)
        if result.quantized is not None:
            plan, t = result.quantized.plan, result.quantized.timings
            print(f"{PROG}: {plan.file_type.name}: {plan.src_bytes / 2**20:.1f} MiB -> {plan.dst_bytes / 2**20:.1f} "
                  f"MiB ({plan.bits_per_weight:.2f} bpw) in {t.wall:.1f} s (thread-seconds: read {t.read:.1f}, "
                  f"convert {t.convert:.1f}, quantize {t.quantize:.1f}, write {t.write:.1f}; {t.threads} threads)",
                  file=sys.stderr)
    return 0


class _StderrHandler(logging.Handler):
    """Writes to whatever sys.stderr is at the time of the record."""

    def emit(self, record: logging.LogRecord) -> None:
        print(f"{PROG}: {record.levelname.lower()}: {record.getMessage()}", file=sys.stderr)


def _log_warnings_to_stderr() -> None:
    """Warnings of the converter and the gguf library as ``clover-convert: warning: ...`` lines."""
    for name in ("clover_convert", "clover_common.block_settings", "gguf"):
        logger = logging.getLogger(name)
        for handler in [h for h in logger.handlers if isinstance(h, _StderrHandler)]:
            logger.removeHandler(handler)
        logger.addHandler(_StderrHandler(logging.WARNING))
        logger.setLevel(logging.WARNING)
        logger.propagate = False


if __name__ == "__main__":
    sys.exit(main())
