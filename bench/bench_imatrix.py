#!/usr/bin/env python3
"""Does masked calibration help? (docs/quantize.md). Not a unit test.

    .venv/bin/python -m bench.bench_imatrix [--workdir build/bench-imatrix] [--chunks 24]

On the shipped trained model (models/clover-demo, f16): importance matrices from `clover-cpp imatrix`
with and without masked block windows (--no-masked), over the same training-split calibration text; then
Q4_K_M (also without any imatrix) and IQ4_XS from each, and KL(f16 || quantized) with top-1 agreement of
causal logits and of masked block-window logits on held-out standard-library files (the model card's
split). Results: bench/results/bench_imatrix.md and .json.

The demo model's hidden size (128) is below the 256-wide K-quant blocks, so Q4_K_M falls back to Q5_0 and
IQ4_XS to IQ4_NL for most tensors; both still weigh their rounding by the importance matrix.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from clover_dev.metrics import kl_top1
from clover_dev.native import causal_and_block_logits

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
WINDOW = 16


def run(*args: str) -> None:
    subprocess.run([sys.executable, "-m", *args], check=True, stdout=subprocess.DEVNULL)


def eval_windows(docs: list[list[int]], seed: int = 0) -> list[tuple[list[int], list[tuple[int, list[int]]]]]:
    """A masked window every 32 tokens of each document (2..WINDOW of its rows masked, seeded)."""
    rng = np.random.default_rng(seed)
    out = []
    for tokens in docs:
        windows = []
        for p in range(16, len(tokens) - WINDOW, 32):
            k = int(rng.integers(2, WINDOW + 1))
            windows.append((p, sorted(rng.choice(WINDOW, size=k, replace=False).tolist())))
        out.append((tokens, windows))
    return out


def parse_args(description: str, workdir: str) -> argparse.Namespace:
    """The options of the imatrix benchmarks (this one and bench_imatrix_onepass.py)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--workdir", type=Path, default=REPO / "build" / workdir)
    parser.add_argument("--chunks", type=int, default=24, help="calibration chunks of 512 tokens")
    parser.add_argument("--eval-docs", type=int, default=12, help="held-out files evaluated (256 tokens each)")
    return parser.parse_args()


def main() -> int:
    args = parse_args(__doc__.splitlines()[0], "bench-imatrix")
    from clover_native import bindings
    from clover_ref.train import corpus_files

    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    f16 = work / "demo-f16.gguf"
    run("clover_convert", str(REPO / "models" / "clover-demo"), str(f16), "--outtype", "f16")
    train, held = corpus_files()
    calib = work / "calib.txt"
    calib.write_text("\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in train[25::50]))
    imatrices = {"none": None}
    for name, extra in (("ar-only", ["--no-masked"]), ("masked", [])):
        out = work / f"imatrix-{name}.gguf"
        run("clover_cpp.cli", "imatrix", "-m", str(f16), "-f", str(calib), "-o", str(out), "--chunks",
            str(args.chunks), "--no-progress", *extra)
        imatrices[name] = out

    model = bindings.LlamaModel(f16)
    docs = [model.tokenize(p.read_text(encoding="utf-8", errors="replace"))[:256] for p in held[:args.eval_docs]]
    model.close()
    walks = eval_windows(docs)
    ref_c, ref_b = causal_and_block_logits(f16, walks, WINDOW)
    rows: dict[str, dict[str, float]] = {}
    for qtype in ("Q4_K_M", "IQ4_XS"):
        for name, imatrix in imatrices.items():
            if imatrix is None and qtype == "IQ4_XS":
                continue
            out = work / f"{qtype}-{name}.gguf"
            cmd = ["clover_quantize.cli", str(f16), str(out), qtype]
            if imatrix is not None:
                cmd += ["--imatrix", str(imatrix)]
            run(*cmd)
            c, b = causal_and_block_logits(out, walks, WINDOW)
            kc, tc = kl_top1(ref_c, c)
            kb, tb = kl_top1(ref_b, b)
            rows[f"{qtype} / {name}"] = {"kl_causal": kc, "top1_causal": tc, "kl_block": kb, "top1_block": tb}
            print(f"{qtype:7s} {name:8s} KL causal {kc:.3e} block {kb:.3e}  top-1 {tc:.3f} / {tb:.3f}", flush=True)
    lines = ["# Importance matrix: masked vs AR-only calibration (`bench/bench_imatrix.py`)", "",
             f"Trained demo model (f16 reference), {args.chunks} calibration chunks of 512 tokens from the training "
             f"split, evaluated on {len(docs)} held-out files ({len(ref_c)} causal rows, {len(ref_b)} masked "
             "block rows)."]
    save_kl_table("bench_imatrix", lines, rows)
    return 0


def save_kl_table(stem: str, header: list[str], rows: dict[str, dict[str, float]]) -> None:
    """bench/results/{stem}.md (``header``, then one table row per key) and {stem}.json (``rows``)."""
    lines = [*header, "", "| type / imatrix | KL causal | KL block | top-1 causal | top-1 block |",
             "|---|---:|---:|---:|---:|"]
    for key, r in rows.items():
        lines.append(f"| {key} | {r['kl_causal']:.3e} | {r['kl_block']:.3e} | {r['top1_causal']:.3f} | "
                     f"{r['top1_block']:.3f} |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (RESULTS / f"{stem}.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
