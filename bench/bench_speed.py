#!/usr/bin/env python3
"""Decode speed of every mode, side by side, with the defaults a user gets. Not a unit test.

    .venv/bin/python -m bench.bench_speed [--workdir build/bench-speed] [--runs 3] [--prompts 12] [--quick]

- The trained demo model (models/clover-demo) at f16, Q8_0 and Q4_K_M: ar, spec at B = 2, 4, 8, 16, 32,
  diffusion at B = 4, 8, 16, 32 (threshold 0.9) and auto, on held-out standard-library code (the prompts
  the model card uses: 48 tokens each, 64 new tokens, greedy, no stop ids).
- The random-weight `tiny` and `mid` presets (mid at Q8_0): ar, spec at B = 4 and auto, where auto must fall
  back to ar's speed (drafts are almost never accepted).

Every model is loaded once with the engine's defaults (threads = the physical cores this process may use;
auto measures its cost table at its first call). Within a run, the configurations take turns on each prompt;
a run is repeated --runs times, and every ratio to ar is the median over the runs of that run's ratio. Per row:
decode tok/s, ratio to ar, TPF (tokens per decode-time pass), ms per pass. Per model: auto's cost table
(fixed and per-row cost of a causal and of a block pass, the rebuild cost of a pass whose shape changed).

Results: bench/results/bench_speed.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"

DEMO_CONFIGS = ([("ar", None)] + [("spec", b) for b in (2, 4, 8, 16, 32)] + [("diffusion", b) for b in (4, 8, 16, 32)]
                + [("auto", None)])
RANDOM_CONFIGS = [("ar", None), ("spec", 4), ("auto", None)]
LOSSLESS = ("ar", "spec", "auto")


def log(msg: str) -> None:
    print(f"[bench_speed {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def held_out_prompts(n: int, length: int = 48) -> list[list[int]]:
    from clover_ref.train import corpus_files, encode_files

    _, held = corpus_files()
    stream = encode_files(held, max_bytes=1 << 20)
    starts = np.linspace(0, len(stream) - length - 1, n).astype(int)
    return [stream[s: s + length].tolist() for s in starts]


def models(work: Path, quick: bool) -> dict[str, tuple[Path, list[tuple[str, int | None]], int]]:
    """name -> (GGUF, configurations, new tokens per prompt)."""
    from clover_ref.factory import init_checkpoint
    from clover_dev.convert import clover_convert, quantize

    work.mkdir(parents=True, exist_ok=True)
    out: dict[str, tuple[Path, list[tuple[str, int | None]], int]] = {}
    f16 = work / "demo-f16.gguf"
    if not f16.exists():
        clover_convert(REPO / "models" / "clover-demo", f16, "f16")
    out["demo f16"] = (f16, DEMO_CONFIGS, 64)
    for q in ([] if quick else ["Q8_0", "Q4_K_M"]):
        path = work / f"demo-{q}.gguf"
        if not path.exists():
            quantize(f16, path, q)
        out[f"demo {q}"] = (path, DEMO_CONFIGS, 64)
    for preset, q, tokens in (("tiny", "f16", 64), ("mid", "Q8_0", 24)):
        if quick and preset == "mid":
            continue
        ckpt = work / f"{preset}-ckpt"
        if not (ckpt / "config.json").exists():
            init_checkpoint(ckpt, preset, seed=0)
        path = work / f"{preset}-{q}.gguf"
        if not path.exists():
            src = clover_convert(ckpt, work / f"{preset}-f16.gguf", "f16")
            if q != "f16":
                quantize(src, path, q)
        out[f"{preset} {q}"] = (path, RANDOM_CONFIGS, tokens)
    return out


def label(mode: str, b: int | None) -> str:
    return mode if b is None else f"{mode} B={b}"


def one_run(model: Any, prompts: list[list[int]], configs: list[tuple[str, int | None]], tokens: int) -> dict:
    """Totals per configuration over all prompts, configurations interleaved on each prompt."""
    totals = {label(m, b): {"tokens": 0, "ms": 0.0, "passes": 0} for m, b in configs}
    for prompt in prompts:
        for mode, b in configs:
            model.reset()
            opts: dict[str, Any] = {"block_size": b} if b else {}
            if mode == "diffusion":
                opts["threshold"] = 0.9
            s = model.run(prompt, mode=mode, max_tokens=tokens, stop_ids=[], **opts).stats
            t = totals[label(mode, b)]
            t["tokens"] += s.generated_tokens
            t["ms"] += s.decode_ms
            t["passes"] += s.passes
    return totals


def bench_model(path: Path, configs: list[tuple[str, int | None]], tokens: int, prompts: list[list[int]],
                runs: int) -> dict[str, Any]:
    from clover_cpp import Model

    with Model(path) as model:
        threads = model.n_threads
        costs = model.measure_pass_costs()  # what the passes cost (a measurement; no mode reads it)
        per_run = [one_run(model, prompts, configs, tokens) for _ in range(runs)]
    rows = {name: summarize(per_run, name) for name in per_run[0]}
    return {"threads": threads, "costs": vars(costs) if costs else None, "rows": rows}


def summarize(per_run: list[dict[str, dict[str, float]]], name: str) -> dict[str, Any]:
    """One configuration over interleaved runs of per-configuration totals (tokens, ms, passes): median tok/s, the
    median of each run's tok/s over ar's, TPF and ms per pass."""
    rates = [r[name]["tokens"] / r[name]["ms"] * 1e3 for r in per_run]
    ratios = [r[name]["tokens"] / r[name]["ms"] / (r["ar"]["tokens"] / r["ar"]["ms"]) for r in per_run]
    agg = {k: sum(r[name][k] for r in per_run) for k in ("tokens", "ms", "passes")}
    return {"tok_s": statistics.median(rates), "ratio": statistics.median(ratios), "ratios": ratios,
            "tpf": agg["tokens"] / agg["passes"], "ms_per_pass": agg["ms"] / agg["passes"]}


def markdown(res: dict[str, Any]) -> str:
    lines = [f"Decode speed by mode ({res['date']}, {res['cpu']}; engine defaults: {res['threads']} threads). "
             f"{res['prompts']} held-out code prompts of 48 tokens, greedy, no stop ids; configurations interleaved "
             f"on each prompt; ratio = median over {res['runs']} runs of that run's tok/s over ar's.", ""]
    for name, m in res["models"].items():
        c = m["costs"]
        lines += [f"### {name} ({m['tokens']} new tokens per prompt)", "",
                  "| mode | tok/s | vs ar | TPF | ms per pass |", "|---|---:|---:|---:|---:|"]
        for row, r in m["rows"].items():
            lines.append(f"| {row} | {r['tok_s']:.1f} | {r['ratio']:.2f} | {r['tpf']:.2f} | {r['ms_per_pass']:.3f} |")
        if c:
            lines += ["", f"Pass costs (measured, ms): ar step {c['ar_ms']:.3f}; causal pass of w rows in a run "
                          f"{c['causal_fixed_ms']:.3f} + {c['causal_row_ms']:.3f} w; a pass whose graph is rebuilt "
                          f"+{c['rebuild_ms']:.3f}; block pass {c['block_fixed_ms']:.3f} + {c['block_row_ms']:.3f} w."]
        lossless = {k: v["ratio"] for k, v in m["rows"].items() if k.split()[0] in LOSSLESS and k != "ar"}
        best = max(lossless, key=lossless.get)
        lines += ["", f"Best lossless: **{best}, {lossless[best]:.2f}x ar** (runs: "
                      f"{', '.join(f'{x:.2f}' for x in m['rows'][best]['ratios'])}); auto "
                      f"{m['rows']['auto']['ratio']:.2f}x.", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=REPO / "build" / "bench-speed")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--quick", action="store_true", help="demo f16 and tiny only, 1 run (a smoke test)")
    args = ap.parse_args()
    import os

    os.environ.setdefault("CLOVER_NATIVE_QUIET", "1")
    from clover_native import loader

    runs = 1 if args.quick else args.runs
    prompts = held_out_prompts(args.prompts)
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "cpu": loader.machine_summary(),
                           "runs": runs, "prompts": len(prompts), "models": {}}
    for name, (path, configs, tokens) in models(args.workdir, args.quick).items():
        log(f"{name}: {len(configs)} configurations x {len(prompts)} prompts x {runs} runs")
        res["models"][name] = bench_model(path, configs, tokens, prompts, runs) | {"tokens": tokens}
        res["threads"] = res["models"][name]["threads"]
        log(f"{name}: " + ", ".join(f"{k} {v['ratio']:.2f}" for k, v in res["models"][name]["rows"].items()))
    text = markdown(res)
    if not args.quick:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "bench_speed.json").write_text(json.dumps(res, indent=1))
        (RESULTS / "bench_speed.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
