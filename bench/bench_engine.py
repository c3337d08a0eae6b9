#!/usr/bin/env python3
"""Benchmark the native Clover decoding engine (docs/decoding.md). Not a unit test.

    .venv/bin/python -m bench.bench_engine [--workdir build/bench-engine] [--models tiny,mid] [--threads N]

For the `tiny` and `mid` random checkpoints (seed 0), at f32 and q8_0 (llama-quantize):
- prefill tok/s of the engine (a 128-token prompt);
- decode tok/s, ms per pass and TPF of the engine in ar, diffusion and spec (default B and calibrated
  threshold; spec with draft_steps 0), greedy;
- the cost ratio of one B-token block pass (all B rows asked, as in a block's first step) to one 1-token
  causal pass, timed with clover_native.bindings (median of several);
- stock llama.cpp `qwen35moe` AR decode tok/s on the Clover-stripped twin (llama.cpp's own converter), and
  our clover GGUF through the very same llama-cpp-python low-level loop, so the difference is the patch's
  cost to the causal graph (budget: at most 5 %);
- the PyTorch reference's ar tok/s (float32 weights, bf16 checkpoint), once per model.

Results go to bench/results/bench_engine.json and bench/results/bench_engine.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"

DECODE_TOKENS = {"tiny": 128, "mid": 32}
PREFILL_TOKENS = 128
STOCK_TOKENS = {"tiny": 128, "mid": 32}
REF_TOKENS = {"tiny": 48, "mid": 6}
REPS = {"tiny": 2, "mid": 1}  # engine runs per mode (best kept)


def log(msg: str) -> None:
    print(f"[bench_engine {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def prepare(name: str, work: Path, stock: bool = True) -> dict[str, Path]:
    """Checkpoint, clover GGUFs (f32, q8_0) and (with ``stock``) the stock twin GGUFs (f32, q8_0)."""
    from clover_ref.factory import init_checkpoint
    from clover_dev.convert import clover_convert, make_qwen_twin, quantize, vendored_convert

    d = work / name
    ckpt = d / "checkpoint"
    if not (ckpt / "config.json").exists():
        log(f"{name}: checkpoint")
        init_checkpoint(ckpt, name, seed=0)
    files = {"checkpoint": ckpt}
    for kind, make in (
        ("clover-f32", lambda out: clover_convert(ckpt, out, "f32")),
        ("clover-q8_0", lambda out: quantize(files["clover-f32"], out, "Q8_0")),
        ("stock-f32", lambda out: vendored_convert(make_qwen_twin(ckpt, d / "twin") if not (d / "twin").exists()
                                                   else d / "twin", out, "f32")),
        ("stock-q8_0", lambda out: quantize(files["stock-f32"], out, "Q8_0")),
    ):
        out = d / f"{kind}.gguf"
        if kind.startswith("stock") and not stock:
            continue
        if not out.exists():
            log(f"{name}: {kind}")
            make(out)
        files[kind] = out
    return files


def prompt_ids(n: int, seed: int = 1) -> list[int]:
    return np.random.default_rng(seed).integers(0, 3000, size=n).tolist()


def engine_runs(path: Path, name: str, threads: int) -> dict[str, Any]:
    from clover_cpp import Model

    out: dict[str, Any] = {}
    with Model(path, n_ctx=2048, n_threads=threads) as m:
        m.run(prompt_ids(8), mode="ar", max_tokens=4, stop_ids=[])  # warm-up
        prefill = []
        for _ in range(REPS[name]):
            m.reset()
            prefill.append(m.run(prompt_ids(PREFILL_TOKENS), mode="ar", max_tokens=1, stop_ids=[]).stats.prefill_tok_s)
        out["prefill_tok_s"] = max(prefill)
        out["block_size"] = m.info.block_size
        out["threshold"] = m.info.threshold_for(m.info.block_size)
        for mode in ("ar", "diffusion", "spec"):
            runs = []
            for _ in range(REPS[name]):
                m.reset()
                runs.append(m.run(prompt_ids(32, seed=2), mode=mode, max_tokens=DECODE_TOKENS[name], stop_ids=[]))
            s = max(runs, key=lambda r: r.stats.decode_tok_s).stats
            out[mode] = {"tok_s": s.decode_tok_s, "ms_per_pass": s.ms_per_pass, "tpf": s.tokens_per_pass,
                         "ms_per_block_pass": s.ms_per_block_pass, "ms_per_causal_pass": s.ms_per_causal_pass,
                         "tokens": s.generated_tokens, "block_passes": s.block_passes,
                         "causal_passes": s.causal_passes}
    return out


def cost_ratio(path: Path, block: int, threads: int, reps: int = 9) -> dict[str, float]:
    from clover_native import bindings

    model = bindings.LlamaModel(path)
    ctx = bindings.Context(model, n_ctx=1024, n_ubatch=max(64, block), n_threads=threads)
    ids = prompt_ids(64, seed=3)
    ctx.causal(ids, rows=[63])
    mask = model.mask_token()
    window = [ids[-1]] + [mask] * (block - 1)
    t_block, t_causal = [], []
    ctx.block(window)
    for i in range(reps):
        t = time.perf_counter()
        ctx.block(window)
        t_block.append(time.perf_counter() - t)
        t = time.perf_counter()
        ctx.causal([ids[i]])
        t_causal.append(time.perf_counter() - t)
    b, c = statistics.median(t_block) * 1e3, statistics.median(t_causal) * 1e3
    ctx.close()
    model.close()
    return {"block_ms": b, "causal_ms": c, "ratio": b / c}


def lowlevel_ar(paths: dict[str, Path], n_tokens: int, threads: int, rounds: int = 3) -> dict[str, float]:
    """Greedy AR decode tok/s through llama-cpp-python low-level calls, the same loop for every file;
    the files take turns over several rounds (best round each), so a noisy neighbour hits both alike."""
    from clover_native import bindings

    ids = prompt_ids(32, seed=2)
    state = {}
    for key, path in paths.items():
        model = bindings.LlamaModel(path)
        state[key] = (model, bindings.Context(model, n_ctx=2048, n_ubatch=64, n_threads=threads))
    best = {key: 0.0 for key in paths}
    for _ in range(rounds):
        for key, (model, ctx) in state.items():
            ctx.clear()
            tok = int(ctx.causal(ids, rows=[len(ids) - 1])[0].argmax())
            tok = int(ctx.causal([tok])[0].argmax())  # warm
            t = time.perf_counter()
            for _ in range(n_tokens):
                tok = int(ctx.causal([tok])[0].argmax())
            best[key] = max(best[key], n_tokens / (time.perf_counter() - t))
    for model, ctx in state.values():
        ctx.close()
        model.close()
    return best


def reference_ar(ckpt: Path, n_tokens: int) -> float:
    import torch

    from clover_ref.checkpoint import load_model
    from clover_ref.decode import generate

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    model = load_model(ckpt)
    ids = prompt_ids(32, seed=2)
    generate(model, ids[:4], mode="ar", max_new_tokens=2, stop_ids=[])  # warm-up
    from clover_ref.decode import Session

    s = Session(model)
    s.append_prompt(ids)
    t = time.perf_counter()
    r = s.generate([ids[-1]], mode="ar", max_new_tokens=n_tokens, stop_ids=[])
    return len(r.tokens) / (time.perf_counter() - t)


def markdown(results: dict[str, Any]) -> str:
    cols = []
    for name in results["models"]:
        for q in ("f32", "q8_0"):
            key = f"{name}/{q}"
            if key in results["runs"]:
                cols.append(key)
    r = results["runs"]

    def row(label: str, fn: Any) -> str:
        cells = []
        for c in cols:
            try:
                cells.append(fn(r[c]))
            except (KeyError, TypeError):
                cells.append("-")
        return f"| {label} | " + " | ".join(cells) + " |"

    f1 = lambda x: f"{x:.1f}"  # noqa: E731
    f2 = lambda x: f"{x:.2f}"  # noqa: E731
    lines = [
        f"Engine benchmark, {results['host']['cpus']} CPUs, {results['threads']} threads, "
        f"{results.get('n_gpu_layers', 0)} layers offloaded, "
        f"{results['date']}. Random-weight models: diffusion uses the GGUF's B and calibrated threshold, "
        "spec draft_steps 0, greedy.",
        "",
        "| | " + " | ".join(cols) + " |",
        "|---|" + "---|" * len(cols),
        row("B / threshold", lambda x: f"{x['engine']['block_size']} / {x['engine']['threshold']:.2f}"),
        row("prefill tok/s (128-token prompt)", lambda x: f1(x["engine"]["prefill_tok_s"])),
    ]
    for mode in ("ar", "diffusion", "spec"):
        lines.append(row(f"{mode}: decode tok/s", lambda x, m=mode: f1(x["engine"][m]["tok_s"])))
        lines.append(row(f"{mode}: ms per pass", lambda x, m=mode: f2(x["engine"][m]["ms_per_pass"])))
        lines.append(row(f"{mode}: TPF", lambda x, m=mode: f2(x["engine"][m]["tpf"])))
    lines += [
        row("block pass (B rows) ms", lambda x: f2(x["cost"]["block_ms"])),
        row("causal pass (1 token) ms", lambda x: f2(x["cost"]["causal_ms"])),
        row("cost ratio block/causal", lambda x: f2(x["cost"]["ratio"])),
        row("stock qwen35moe AR tok/s (low-level loop)", lambda x: f1(x["stock_ar_tok_s"])),
        row("clover AR tok/s (same loop)", lambda x: f1(x["clover_lowlevel_ar_tok_s"])),
        row("patch cost to AR (same loop)",
            lambda x: f"{100 * (1 - x['clover_lowlevel_ar_tok_s'] / x['stock_ar_tok_s']):+.1f} %"),
        row("PyTorch reference ar tok/s", lambda x: f2(x["reference_ar_tok_s"])),
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=REPO / "build" / "bench-engine")
    parser.add_argument("--models", default="tiny,mid")
    parser.add_argument("--threads", type=int, default=0, help="0 = the engine's default (usable physical cores)")
    parser.add_argument("--n-gpu-layers", type=int, default=0, help="layers offloaded (a GPU build: GPU=cuda)")
    parser.add_argument("--skip-stock", action="store_true", help="leave out the stock qwen35moe comparison "
                        "(it needs the vendored converter and transformers)")
    parser.add_argument("--skip-reference", action="store_true", help="leave out the PyTorch reference's tok/s")
    parser.add_argument("--name", default="bench_engine", help="results file stem in bench/results")
    args = parser.parse_args()
    os.environ["CLOVER_N_GPU_LAYERS"] = str(args.n_gpu_layers)
    os.environ.setdefault("CLOVER_NATIVE_QUIET", "1")
    from clover_native import libclover

    ok, reason = libclover.available()
    if not ok:
        print(f"bench_engine: native engine unavailable: {reason}", file=sys.stderr)
        return 1
    if args.threads == 0:
        args.threads = int(libclover.lib().clover_default_n_threads())
    os.environ["CLOVER_THREADS"] = str(args.threads)
    start = time.time()
    models = [m for m in args.models.split(",") if m]
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "threads": args.threads,
                               "n_gpu_layers": args.n_gpu_layers,
                               "host": {"cpus": os.cpu_count(), "machine": platform.machine(),
                                        "python": platform.python_version()},
                               "models": models, "runs": {}}
    for name in models:
        files = prepare(name, args.workdir, stock=not args.skip_stock)
        ref_tok_s = None
        for q in ("f32", "q8_0"):
            key = f"{name}/{q}"
            log(f"{key}: engine")
            run: dict[str, Any] = {"engine": engine_runs(files[f"clover-{q}"], name, args.threads)}
            log(f"{key}: cost ratio")
            run["cost"] = cost_ratio(files[f"clover-{q}"], run["engine"]["block_size"], args.threads)
            if not args.skip_stock:
                log(f"{key}: stock vs clover AR (low-level loop)")
                ar = lowlevel_ar({"stock": files[f"stock-{q}"], "clover": files[f"clover-{q}"]}, STOCK_TOKENS[name],
                                 args.threads)
                run["stock_ar_tok_s"], run["clover_lowlevel_ar_tok_s"] = ar["stock"], ar["clover"]
            if ref_tok_s is None and not args.skip_reference:
                log(f"{name}: PyTorch reference")
                ref_tok_s = reference_ar(files["checkpoint"], REF_TOKENS[name])
            run["reference_ar_tok_s"] = ref_tok_s
            results["runs"][key] = run
    results["seconds"] = time.time() - start
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(results, indent=1))
    md = markdown(results)
    (RESULTS / f"{args.name}.md").write_text(md)
    print(md)
    log(f"done in {results['seconds']:.0f} s; wrote {RESULTS / args.name}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
