#!/usr/bin/env python3
"""Block diffusion through llama-server against `clover-cpp generate`'s loop, side by side in one run. Not a unit test.

    .venv/bin/python -m bench.bench_server_diffusion [--workdir build/bench-spec] [--runs 3] [--prompts 8]
        [--tokens 128] [--files f16,Q4_K_M,35b] [--settings 8:0.9,32:0.9,32:0.5] [--quick] [--stem NAME]

Models: the trained demo model at f16 and Q4_K_M, and the random `35b-shape` 4-layer slice at Q4_K_M
(bench_spec_server's files). Prompts: held-out 48-token code prompts. For each (block size, threshold) setting,
on every prompt in turn: one llama-server request (`mode: diffusion`, greedy, at most --tokens new tokens, no
prompt cache) and the engine's run of the same request (the Python API, what `clover-cpp generate --mode
diffusion` runs), interleaved.
End to end is the wall time of a request at the client (prefill included); decode is the server's own
`predicted_per_second` (the engine's decode_ms); TPF is generated tokens per pass of the generation (block and causal
passes), which the two must report alike (they decode the same blocks). A ratio is the median over runs of that run's
server tok/s over the engine's.

Results: bench/results/bench_server_diffusion.{json,md} (--stem names another pair, one per CPU).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.bench_spec_server import N_CTX, add_run_args, complete, model_files, write_results


def log(msg: str) -> None:
    print(f"[bench_server_diffusion {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def one_run(model: Any, url: str, prompts: list[list[int]], tokens: int, block_size: int, threshold: float) -> dict:
    """Totals of the server and the engine over the prompts, interleaved on each prompt."""
    totals = {k: {"tokens": 0, "decode_ms": 0.0, "wall_ms": 0.0, "passes": 0} for k in ("server", "engine")}
    # both stop at an end of generation: a server's ignore_eos bans it from the blocks, the engine's empty stop list
    # would not, and they would decode different blocks
    fields = {"mode": "diffusion", "block_size": block_size, "threshold": threshold, "ignore_eos": False}
    for prompt in prompts:
        a = complete(url, prompt, tokens, **fields)
        t, tm = totals["server"], a["timings"]
        t["tokens"] += tm["predicted_n"]
        t["decode_ms"] += tm["predicted_ms"]
        t["wall_ms"] += a["wall_ms"]
        t["passes"] += tm["block_passes"] + tm["causal_passes"]

        model.reset()
        start = time.perf_counter()
        s = model.run(prompt, mode="diffusion", block_size=block_size, threshold=threshold, max_tokens=tokens).stats
        t = totals["engine"]
        t["wall_ms"] += (time.perf_counter() - start) * 1e3
        t["tokens"] += s.generated_tokens
        t["decode_ms"] += s.decode_ms
        t["passes"] += s.block_passes + s.causal_passes
    return totals


def summarize(per_run: list[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for who in ("server", "engine"):
        out[who] = {
            "decode_tok_s": statistics.median(r[who]["tokens"] / r[who]["decode_ms"] * 1e3 for r in per_run),
            "e2e_tok_s": statistics.median(r[who]["tokens"] / r[who]["wall_ms"] * 1e3 for r in per_run),
            "tpf": sum(r[who]["tokens"] for r in per_run) / sum(r[who]["passes"] for r in per_run),
        }
    for key, tag in (("decode_ms", "decode"), ("wall_ms", "e2e")):
        ratios = [r["engine"][key] / r["server"][key] * r["server"]["tokens"] / r["engine"]["tokens"] for r in per_run]
        out[f"server / engine, {tag}"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    return out


def bench_model(path: Path, prompts: list[list[int]], settings: list[tuple[int, float]], tokens: int, runs: int,
                threads: int, work: Path) -> dict[str, Any]:
    from clover_cpp import Model
    from clover_dev.process import llama_server
    from clover_native import loader

    exe = loader.tool_path("llama-server")
    res: dict[str, Any] = {}
    with Model(path, n_ctx=N_CTX, n_threads=threads) as model, \
            llama_server(exe, path, "-c", str(N_CTX), "-np", "1", "-t", str(threads), "--no-warmup",
                         log_path=work / f"server-{path.stem}-diffusion.log") as url:
        for block_size, threshold in settings:
            name = f"B={block_size}, threshold {threshold}"
            log(f"{path.name}: {name}")
            complete(url, prompts[0], 4, mode="diffusion", block_size=block_size, threshold=threshold)  # first graphs
            n = len(prompts) // runs
            per_run = [one_run(model, url, prompts[r * n:(r + 1) * n], tokens, block_size, threshold)
                       for r in range(runs)]
            res[name] = summarize(per_run)
    return res


def markdown(res: dict[str, Any]) -> str:
    lines = [f"Block diffusion: llama-server (`mode: diffusion`) and the engine (`clover-cpp generate --mode "
             f"diffusion`'s loop) ({res['date']}, {res['cpu']}, {res['threads']} threads). {res['prompts']} held-out "
             f"prompts per run, at most {res['tokens']} new tokens each, greedy, interleaved on each prompt; medians "
             f"over {res['runs']} runs. End to end: wall time per request at the client; decode: the server's "
             "predicted_per_second (the engine's decode time); TPF: tokens per block or causal pass.", ""]
    for model, m in res["models"].items():
        lines += [f"### {model}", "", "| setting | server e2e tok/s | engine e2e tok/s | server decode tok/s | "
                  "engine decode tok/s | server TPF | engine TPF | server / engine e2e | server / engine decode |",
                  "|---|---:|---:|---:|---:|---:|---:|---|---|"]
        for name, r in m.items():
            e2e, dec = r["server / engine, e2e"], r["server / engine, decode"]
            lines.append(f"| {name} | {r['server']['e2e_tok_s']:.0f} | {r['engine']['e2e_tok_s']:.0f} | "
                         f"{r['server']['decode_tok_s']:.0f} | {r['engine']['decode_tok_s']:.0f} | "
                         f"{r['server']['tpf']:.2f} | {r['engine']['tpf']:.2f} | "
                         f"{e2e['median']:.2f} ({e2e['min']:.2f}-{e2e['max']:.2f}) | "
                         f"{dec['median']:.2f} ({dec['min']:.2f}-{dec['max']:.2f}) |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(parser, "bench_server_diffusion", 8)
    parser.add_argument("--settings", default="8:0.9,32:0.9,32:0.5", help="block_size:threshold, comma-separated")
    parser.add_argument("--quick", action="store_true", help="demo f16 only, 2 prompts, 1 run, 32 tokens")
    args = parser.parse_args()
    import os

    from bench.bench_speed import held_out_prompts
    from clover_native import cpu

    if args.quick:
        args.files, args.prompts, args.runs, args.tokens = "f16", 2, 1, 32
    settings = [(int(b), float(t)) for b, t in (s.split(":") for s in args.settings.split(","))]
    threads = args.threads or os.cpu_count() or 1
    files = model_files(args.workdir, args.files.split(","))
    prompts = held_out_prompts(args.prompts * args.runs)
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu.read_cpuinfo().summary(), "threads": threads,
                           "prompts": args.prompts, "tokens": args.tokens, "runs": args.runs, "models": {}}
    for name, path in files.items():
        res["models"][name] = bench_model(path, prompts, settings, args.tokens, args.runs, threads, args.workdir)
    write_results(args, res, markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
