#!/usr/bin/env python3
"""What the distribution stage costs (spec 4; docs/decoding.md, "Constrained decoding"): decode speed of ar, auto
and spec with penalties, a JSON-schema grammar and logprobs on, against the same mode with none. Not a unit test.

    .venv/bin/python -m bench.bench_constrained [--workdir build/bench-constrained] [--runs 3] [--prompts 8]
                                                [--tokens 64]

The trained demo model (models/clover-demo) at f16, on held-out 48-token code prompts, greedy, no stop ids (a
grammar run stops when its JSON is complete, so tok/s, not time, is compared). Each configuration has an engine
of its own. Within a run every configuration runs on each prompt in turn; a ratio is the median over the runs of
that run's tok/s over the same mode's plain tok/s. Results: bench/results/bench_constrained.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.bench_speed import held_out_prompts

REPO = Path(__file__).resolve().parent.parent
SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "priority": {"enum": ["low", "medium", "high"]},
    "labels": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    "assignee": {"type": "object", "properties": {"name": {"type": "string"}, "id": {"type": "integer"}},
                 "required": ["name", "id"]}},
    "required": ["title", "priority", "labels", "assignee"]}
EXTRAS: dict[str, dict[str, Any]] = {
    "plain": {},
    "penalties": {"repeat_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.5},
    "logprobs": {"logprobs": 5},
    "grammar": {},  # filled in main: the schema's GBNF
}
MODES = ("ar", "auto", "spec")


def run_config(model: Any, prompts: list[list[int]], mode: str, extra: dict[str, Any], tokens: int
               ) -> dict[str, float]:
    out = {"tokens": 0.0, "ms": 0.0, "passes": 0.0}
    for p in prompts:
        model.reset()
        r = model.run(p, mode=mode, max_tokens=tokens, stop_ids=() if "grammar" not in extra else None, **extra)
        out["tokens"] += r.stats.generated_tokens
        out["ms"] += r.stats.decode_ms
        out["passes"] += r.stats.passes
    return out


def markdown(res: dict[str, Any]) -> str:
    lines = [f"Cost of the distribution stage ({res['date']}, {res['cpu']}, {res['threads']} threads): demo f16, "
             f"{res['prompts']} held-out prompts, {res['tokens']} tokens, greedy, median of {res['runs']} runs. "
             "Ratio = tok/s over the same mode's plain tok/s in the same run.", "",
             "| mode | configuration | tok/s | ratio to plain | TPF |", "|---|---|---|---|---|"]
    for mode in MODES:
        for name in EXTRAS:
            r = res["results"][f"{mode}/{name}"]
            lines.append(f"| {mode} | {name} | {r['tok_s']:.1f} | {r['ratio']:.2f}x | {r['tpf']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--workdir", type=Path, default=REPO / "build" / "bench-constrained")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()

    from clover_native import libclover, loader
    from clover_cpp.model import Model
    from clover_dev.convert import clover_convert

    args.workdir.mkdir(parents=True, exist_ok=True)
    f16 = args.workdir / "clover-demo-f16.gguf"
    if not f16.exists():
        clover_convert(REPO / "models" / "clover-demo", f16, "f16")
    EXTRAS["grammar"] = {"grammar": libclover.json_schema_to_grammar(json.dumps(SCHEMA))}
    prompts = held_out_prompts(args.prompts)
    engines = {f"{m}/{n}": Model(str(f16)) for m in MODES for n in EXTRAS}
    per_run: list[dict[str, dict[str, float]]] = []
    for run in range(args.runs):
        per_run.append({key: run_config(engines[key], prompts, key.split("/")[0], EXTRAS[key.split("/")[1]],
                                        args.tokens) for key in engines})
        print(f"run {run + 1}/{args.runs} done", file=sys.stderr)
    results = {}
    for key in engines:
        plain = f"{key.split('/')[0]}/plain"
        rates = [r[key]["tokens"] / r[key]["ms"] * 1e3 for r in per_run]
        ratios = [(r[key]["tokens"] / r[key]["ms"]) / (r[plain]["tokens"] / r[plain]["ms"]) for r in per_run]
        agg = {k: sum(r[key][k] for r in per_run) for k in ("tokens", "passes")}
        results[key] = {"tok_s": statistics.median(rates), "ratio": statistics.median(ratios), "ratios": ratios,
                        "tpf": agg["tokens"] / agg["passes"]}
    res = {"date": time.strftime("%Y-%m-%d"), "cpu": loader.machine_summary(),
           "threads": engines["ar/plain"].n_threads, "prompts": args.prompts, "tokens": args.tokens,
           "runs": args.runs, "results": results}
    out = REPO / "bench" / "results"
    (out / "bench_constrained.json").write_text(json.dumps(res, indent=2))
    (out / "bench_constrained.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
