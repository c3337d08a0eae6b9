#!/usr/bin/env python3
"""An imatrix without a full-precision GGUF: collected on a Q8_0 made in one pass, against one collected on
the bf16 GGUF. Not a unit test.

    .venv/bin/python -m bench.bench_imatrix_onepass [--workdir build/bench-imatrix-onepass] [--chunks 24]

On the shipped trained model (models/clover-demo): `clover-convert --outtype bf16` (the reference) and
`clover-convert --outtype Q8_0` (one pass); `clover-cpp imatrix` over the same training-split text on each;
then one-pass IQ4_XS and Q4_K_M with each matrix, and KL(bf16 || quantized) with top-1 agreement of causal
and masked block-window logits on held-out files (the walk of bench/bench_imatrix.py). Results:
bench/results/bench_imatrix_onepass.md and .json.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.bench_imatrix import WINDOW, eval_windows, parse_args, save_kl_table
from clover_dev.metrics import kl_top1
from clover_dev.native import causal_and_block_logits

REPO = Path(__file__).resolve().parent.parent

DEMO = REPO / "models" / "clover-demo"


def run(*args: str) -> None:
    subprocess.run([sys.executable, "-m", *args], check=True, stdout=subprocess.DEVNULL)


def main() -> int:
    args = parse_args(__doc__.splitlines()[0], "bench-imatrix-onepass")
    from clover_native import bindings
    from clover_ref.train import corpus_files

    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    train, held = corpus_files()
    calib = work / "calib.txt"
    calib.write_text("\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in train[25::50]))
    sources = {"bf16": work / "demo-bf16.gguf", "Q8_0": work / "demo-Q8_0.gguf"}
    imatrices = {}
    for name, path in sources.items():
        run("clover_convert", str(DEMO), str(path), "--outtype", name)
        imatrices[name] = work / f"imatrix-from-{name}.gguf"
        run("clover_cpp.cli", "imatrix", "-m", str(path), "-f", str(calib), "-o", str(imatrices[name]),
            "--chunks", str(args.chunks), "--no-progress")
    model = bindings.LlamaModel(sources["bf16"])
    docs = [model.tokenize(p.read_text(encoding="utf-8", errors="replace"))[:256] for p in held[:args.eval_docs]]
    model.close()
    walks = eval_windows(docs)
    ref_c, ref_b = causal_and_block_logits(sources["bf16"], walks, WINDOW)
    rows: dict[str, dict[str, float]] = {}
    for qtype in ("Q4_K_M", "IQ4_XS"):
        for name, imatrix in imatrices.items():
            out = work / f"{qtype}-{name}.gguf"
            run("clover_convert", str(DEMO), str(out), "--outtype", qtype, "--imatrix", str(imatrix))
            c, b = causal_and_block_logits(out, walks, WINDOW)
            kc, tc = kl_top1(ref_c, c)
            kb, tb = kl_top1(ref_b, b)
            rows[f"{qtype} / imatrix from {name}"] = {"kl_causal": kc, "top1_causal": tc, "kl_block": kb,
                                                      "top1_block": tb}
            print(f"{qtype:7s} from {name:5s} KL causal {kc:.3e} block {kb:.3e}  top-1 {tc:.3f} / {tb:.3f}",
                  flush=True)
    save_kl_table("bench_imatrix_onepass", [
        "# An imatrix from a one-pass Q8_0 against one from the bf16 GGUF (`bench/bench_imatrix_onepass.py`)", "",
        f"Trained demo model (bf16 reference), {args.chunks} calibration chunks of 512 tokens from the training "
        f"split, evaluated on {len(docs)} held-out files ({len(ref_c)} causal rows, {len(ref_b)} masked block "
        "rows). Quantized files made in one pass (`clover-convert --outtype T --imatrix F`)."], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
