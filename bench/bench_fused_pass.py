#!/usr/bin/env python3
"""What a fused verify + draft pass costs against the two passes it replaces, per model size. Not a unit test.

    .venv/bin/python -m bench.bench_fused_pass [--reps 200] [--workdir build/bench-35b] [--no-slice] [--stem NAME]

A spec round of block size B is, unfused, a B-row verification (causal rows [seed, d_1 .. d_{B-1}]) and a B-row
block pass that drafts the next round. A fused round (GenParams.spec_fused; docs/native.md, "The fused pass") is
one pass of B - 1 causal rows and a B-row window (2B - 1 rows in one ubatch). Timed here through
clover_native.bindings over a 64-token history, for B = 4 and 8, with every row's logits read as the engine reads
them; the three passes are interleaved, repetition by repetition, so a slow spell on a shared machine touches
each alike, and each figure is the median (the minimum beside it). Files:
- the demo model (models/clover-demo) at f16 and Q4_K_M: a pass is mostly fixed per-op cost;
- a random `35b-shape --layers 4` slice at Q4_K_M (3 GDN layers and 1 attention layer at the real 35B-A3B's
  dims, 256 experts top-8; bench/predict_35b.py's, cached in --workdir; --no-slice leaves it out): a pass is
  mostly weight reads, and its rows route to different experts.
The ratio fused / (verification + block) is what a fused round pays in passes; it gives up the free token of a
round whose drafts were all accepted (1 of B tokens), so it pays when the ratio is below about (B - 1) / B of the
pair, less the saved fixed cost of one round of host work.

Results: bench/results/bench_fused_pass.{json,md} (--stem names another pair, one per CPU).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.pass_timing import interleaved_times, synthetic_tokens

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
BLOCKS = (4, 8)
HISTORY = 64


def log(msg: str) -> None:
    print(f"[bench_fused_pass {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pass_times(path: Path, reps: int) -> dict[str, Any]:
    """{B: {verify, block, fused: {median, min}}} in ms for one GGUF."""
    from clover_native import bindings

    model = bindings.LlamaModel(path)
    ctx = bindings.Context(model, n_ctx=512, n_ubatch=64, n_rs_seq=2 * max(BLOCKS))
    mask = model.mask_token()
    history = synthetic_tokens(HISTORY, 7, 13)
    out: dict[str, Any] = {}
    try:
        ctx.causal(history[:-1], rows=[HISTORY - 2])  # the seed, history[-1], opens every pass
        kept = HISTORY - 1
        for b in BLOCKS:
            drafts = synthetic_tokens(b, 101, 7)
            seed, window = history[-1], [drafts[-1]] + [mask] * (b - 1)

            def verify(b: int = b, drafts: list[int] = drafts) -> None:
                ctx.causal([seed] + drafts[:b - 1])
                ctx.rollback(kept)

            def block(window: list[int] = window) -> None:
                ctx.block(window)

            def fused(b: int = b, drafts: list[int] = drafts, window: list[int] = window) -> None:
                ctx.fused([seed] + drafts[:b - 2], window, keep=kept)

            row = out[str(b)] = interleaved_times({"verify": verify, "block": block, "fused": fused}, reps)
            log(f"{path.name} B={b}: " + ", ".join(f"{k} {v['median']:.3f} ms" for k, v in row.items()))
    finally:
        ctx.close()
        model.close()
    return out


def demo_files(work: Path) -> dict[str, Path]:
    from clover_dev.convert import clover_convert, quantize

    f16 = clover_convert(REPO / "models" / "clover-demo", work / "demo-f16.gguf", "f16")
    return {"demo f16": f16, "demo Q4_K_M": quantize(f16, work / "demo-Q4_K_M.gguf", "Q4_K_M")}


def write_markdown(result: dict[str, Any], path: Path) -> None:
    lines = [f"Fused pass cost ({result['date']}, {result['cpu']}, {result['threads']} threads). Median of "
             f"{result['reps']} interleaved repetitions over a {HISTORY}-token history (minimum in brackets); every "
             "row's logits read. Verification: B causal rows; block: a B-row window; fused: B - 1 causal rows and "
             "a B-row window in one ubatch.", "",
             "| file | B | verification ms | block ms | fused ms | fused / (verification + block) | "
             "fused / verification |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, by_b in result["files"].items():
        for b, row in by_b.items():
            v, k, f = (row[x]["median"] for x in ("verify", "block", "fused"))
            mins = {x: row[x]["min"] for x in row}
            lines.append(f"| {name} | {b} | {v:.3f} ({mins['verify']:.3f}) | {k:.3f} ({mins['block']:.3f}) | "
                         f"{f:.3f} ({mins['fused']:.3f}) | {f / (v + k):.2f} | {f / v:.2f} |")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--workdir", type=Path, default=REPO / "build" / "bench-35b")
    ap.add_argument("--no-slice", action="store_true", help="time the demo model only")
    ap.add_argument("--stem", default="bench_fused_pass", help="results file name, without .json/.md")
    args = ap.parse_args()

    from clover_native import loader
    from clover_native.bindings import default_threads

    with tempfile.TemporaryDirectory() as tmp:
        files = demo_files(Path(tmp))
        if not args.no_slice:
            from bench.predict_35b import slice_gguf

            args.workdir.mkdir(parents=True, exist_ok=True)
            files["35b-shape 4-layer slice Q4_K_M"] = slice_gguf(args.workdir, 4)
        result = {"date": time.strftime("%Y-%m-%d"), "cpu": loader.machine_summary(), "threads": default_threads(),
                  "reps": args.reps, "files": {name: pass_times(path, args.reps) for name, path in files.items()}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    write_markdown(result, RESULTS / f"{args.stem}.md")
    print((RESULTS / f"{args.stem}.md").read_text())


if __name__ == "__main__":
    main()
