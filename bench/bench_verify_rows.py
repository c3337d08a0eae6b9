#!/usr/bin/env python3
"""What a causal (verification) pass costs by its number of rows, on the demo model. Not a unit test.

    .venv/bin/python -m bench.bench_verify_rows [--reps 300] [--file f16|Q4_K_M] [--widths 1,2,4,8,16]

A pass of w rows over a 64-token history, then its rollback, as a verification that rejects everything leaves the
context; only the last row's logits are read. Each figure is the median of --reps such passes (the minimum beside
it), the widths interleaved, timed through clover_native.bindings. The slope is what auto and spec pay per verified
draft; the 1-row pass is an `ar` step. To see where a row's price goes, run one width under `perf record`
(`--widths 16`; docs/decoding.md, "What a wider verification costs").

Results: bench/results/bench_verify_rows.md (not written for a --widths other than the default).
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from pathlib import Path

from bench.pass_timing import interleaved_times, synthetic_tokens

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
DEFAULT_WIDTHS = (1, 2, 4, 8, 16)
HISTORY = 64
N_RS_SEQ = 31  # rollback snapshots: a pass of up to N_RS_SEQ + 1 rows can be rolled back


def row_times(path: Path, reps: int, widths: tuple[int, ...]) -> dict[int, dict[str, float]]:
    """{w: {median, min}} in ms of a w-row causal pass and its rollback."""
    from clover_native import bindings

    model = bindings.LlamaModel(path)
    ctx = bindings.Context(model, n_ctx=512, n_ubatch=64, n_rs_seq=N_RS_SEQ)
    try:
        ctx.causal(synthetic_tokens(HISTORY, 7, 13))
        drafts = {w: synthetic_tokens(w, 101, 7) for w in widths}

        def verify(w: int) -> None:
            ctx.causal(drafts[w], rows=[w - 1])
            ctx.rollback(HISTORY)

        out = interleaved_times({w: functools.partial(verify, w) for w in widths}, reps)
    finally:
        ctx.close()
        model.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--file", choices=("f16", "Q4_K_M"), default="f16")
    ap.add_argument("--widths", default=",".join(map(str, DEFAULT_WIDTHS)), help=f"rows per pass, 1 to {N_RS_SEQ + 1}")
    args = ap.parse_args()
    widths = tuple(int(w) for w in args.widths.split(","))
    if not all(1 <= w <= N_RS_SEQ + 1 for w in widths):
        ap.error(f"--widths: each width must be 1 to {N_RS_SEQ + 1} (the rollback reaches {N_RS_SEQ} tokens back)")

    from clover_native import loader
    from clover_native.bindings import default_threads
    from clover_dev.convert import clover_convert, quantize

    with tempfile.TemporaryDirectory() as tmp:
        path = clover_convert(REPO / "models" / "clover-demo", Path(tmp) / "demo-f16.gguf", "f16")
        if args.file != "f16":
            path = quantize(path, Path(tmp) / f"demo-{args.file}.gguf", args.file)
        times = row_times(path, args.reps, widths)
    one = times[min(widths)]["median"]
    lines = [f"Verification pass by rows ({time.strftime('%Y-%m-%d')}, {loader.machine_summary()}, "
             f"{default_threads()} threads; demo {args.file}, {HISTORY}-token history, median of {args.reps} "
             "interleaved passes with their rollback, minimum in brackets).", "",
             f"| rows | ms | over {min(widths)} row(s) |", "|---:|---:|---:|"]
    lines += [f"| {w} | {t['median']:.3f} ({t['min']:.3f}) | {t['median'] / one:.2f} |" for w, t in times.items()]
    if len(widths) > 1:
        lo_w, hi_w = min(widths), max(widths)
        lines += ["", f"Per row from {lo_w} to {hi_w} rows: {(times[hi_w]['median'] - one) / (hi_w - lo_w):.3f} ms."]
    print("\n".join(lines))
    if widths == DEFAULT_WIDTHS:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "bench_verify_rows.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
