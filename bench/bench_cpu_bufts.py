#!/usr/bin/env python3
"""What the CPU's extra buffer types bring: prefill and decode speed of quantized models with and without
them, side by side in one run. Not a unit test.

    .venv/bin/python -m bench.bench_cpu_bufts [--workdir build/bench-bufts] [--types Q8_0,Q4_K_M] [--reps 3]

At load llama.cpp moves quantized weights into AMX tiles (CPUs with AMX-INT8) or repacked interleaved
layouts (CPU_REPACK, e.g. Q4_0/Q4_K with AVX2); ``use_extra_bufts=False`` (llama.cpp's --no-repack) keeps
plain buffers. For the demo model and `mid` (random weights, real 35B-A3B layer dims) at each type: prefill
tok/s of a 256-token prompt and ar decode tok/s over 64 tokens, engine defaults otherwise (threads = usable
physical cores). Settings alternate within each repetition; the median is kept.

Results: bench/results/bench_cpu_bufts.{json,md}, with the CPU's features in the header.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"


def log(msg: str) -> None:
    print(f"[bench_cpu_bufts {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def f16_models(work: Path) -> dict[str, Path]:
    from clover_ref.factory import init_checkpoint
    from clover_dev.convert import clover_convert

    out = {}
    demo = work / "demo-f16.gguf"
    if not demo.exists():
        clover_convert(REPO / "models" / "clover-demo", demo, "f16")
    out["demo"] = demo
    ckpt, mid = work / "mid-ckpt", work / "mid-f16.gguf"
    if not mid.exists():
        if not (ckpt / "config.json").exists():
            init_checkpoint(ckpt, "mid", seed=0)
        clover_convert(ckpt, mid, "f16")
    out["mid"] = mid
    return out


def measure(path: Path, extra: bool, prompt: list[int]) -> dict[str, float]:
    from clover_cpp import Model

    with Model(path, n_ctx=1024, use_extra_bufts=extra) as model:
        s = model.run(prompt, mode="ar", max_tokens=64, stop_ids=[]).stats
    return {"prefill_tok_s": s.prefill_tok_s, "decode_tok_s": s.decode_tok_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=REPO / "build" / "bench-bufts")
    ap.add_argument("--types", default="Q8_0,Q4_0,Q4_K_M")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    from clover_native import bindings, loader
    from clover_dev.convert import quantize
    from clover_dev.native import buffer_types

    args.workdir.mkdir(parents=True, exist_ok=True)
    text = (REPO / "clover_ref" / "decode.py").read_text()
    rows = []
    for name, f16 in f16_models(args.workdir).items():
        m = bindings.LlamaModel(f16)
        prompt = m.tokenize(text)[:256]
        m.close()
        for qtype in args.types.split(","):
            gguf = args.workdir / f"{name}-{qtype}.gguf"
            if not gguf.exists():
                quantize(f16, gguf, qtype)
            runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
            for _ in range(args.reps):
                for extra in (True, False):
                    runs[extra].append(measure(gguf, extra, prompt))
            extra_types = [b for b in buffer_types(gguf, True) if b != "CPU_Mapped"]
            row = {"model": name, "type": qtype, "buffers": ",".join(extra_types) or "plain"}
            for extra, tag in ((True, "extra"), (False, "plain")):
                for key in ("prefill_tok_s", "decode_tok_s"):
                    row[f"{tag}_{key}"] = statistics.median(float(r[key]) for r in runs[extra])
            rows.append(row)
            log(f"{name} {qtype}: {row}")
    cpu_line = loader.machine_summary()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_cpu_bufts.json").write_text(json.dumps({"cpu": cpu_line, "rows": rows}, indent=1))
    lines = [f"CPU: {cpu_line}; engine default threads; median of {args.reps} alternating repetitions.", "",
             "| model | type | extra buffers | prefill tok/s extra / plain | ratio | decode tok/s extra / plain "
             "| ratio |", "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['type']} | {r['buffers']} | {r['extra_prefill_tok_s']:.0f} / "
                     f"{r['plain_prefill_tok_s']:.0f} | {r['extra_prefill_tok_s'] / r['plain_prefill_tok_s']:.2f} | "
                     f"{r['extra_decode_tok_s']:.0f} / {r['plain_decode_tok_s']:.0f} | "
                     f"{r['extra_decode_tok_s'] / r['plain_decode_tok_s']:.2f} |")
    (RESULTS / "bench_cpu_bufts.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
