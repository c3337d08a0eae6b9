#!/usr/bin/env python3
"""`clover-cpp serve` against the llama-server it runs: the launcher must cost nothing per request. Not a unit test.

    .venv/bin/python -m bench.bench_serve_launch [--rounds 5] [--runs 3] [--prompts 10] [--tokens 128]
        [--files f16,Q4_K_M] [--stem NAME]

Four servers on the same GGUF, all started before the first request and asked in turn on every prompt
(interleaved, in an order rotated from prompt to prompt), greedy, --tokens new tokens (ignore_eos), without the
prompt cache, one slot, the same -c and threads, started anew for each of --rounds rounds:
- `llama-server` plain (no --spec-type);
- llama-server with the line `clover-cpp serve --mode ar` runs (Clover's drafters loaded, requests decode ar);
- `clover-cpp serve --mode ar`;
- `clover-cpp serve` with its defaults (auto: ngram-mod, then draft-clover).
The second and third differ only by the launcher. Held-out code prompts (bench_speed's). End to end is the wall
time of a request at the client; decode is the server's own predicted_per_second. A ratio is the median over runs
of that run's tok/s over plain's in the same run.

Results: bench/results/bench_serve_launch.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bench.bench_spec_server import N_CTX, add_run_args, complete, log, model_files, write_results

# name -> (program, extra arguments); llama-server's second line is what `clover-cpp serve --mode ar` runs
CONFIGS = {"llama-server plain": ("llama-server", ()),
           "llama-server --mode ar --spec-type ngram-mod,draft-clover": ("llama-server", (
               "--mode", "ar", "--spec-type", "ngram-mod,draft-clover")),
           "clover-cpp serve --mode ar": ("clover-cpp", ("--mode", "ar")),
           "clover-cpp serve (auto)": ("clover-cpp", ())}


def start(stack: ExitStack, name: str, gguf: Path, threads: int, work: Path) -> str:
    from clover_dev.process import cli_command, free_port, llama_server, serving
    from clover_native import loader

    common = ("-c", str(N_CTX), "-np", "1", "-t", str(threads), "--no-warmup")
    program, extra = CONFIGS[name]
    log_path = work / f"launch-{gguf.stem}-{list(CONFIGS).index(name)}.log"
    if program == "llama-server":
        return stack.enter_context(llama_server(loader.tool_path("llama-server"), gguf, *common,
                                                *extra, log_path=log_path))
    port = free_port()
    argv = cli_command("serve", "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), *common, *extra)
    return stack.enter_context(serving(argv, port, log_path=log_path))[0]


def one_round(gguf: Path, prompts: list[list[int]], tokens: int, runs: int, threads: int, work: Path) -> list[dict]:
    """Fresh server processes; per run, the totals of each over its prompts, the order rotated from prompt to
    prompt."""
    with ExitStack() as stack:
        urls = {name: start(stack, name, gguf, threads, work) for name in CONFIGS}
        for url in urls.values():
            complete(url, prompts[0], 4)  # first graphs, before anything is timed
        n = len(prompts) // runs
        per_run = []
        for r in range(runs):
            totals = {name: {"tokens": 0, "decode_ms": 0.0, "wall_ms": 0.0} for name in CONFIGS}
            for i, prompt in enumerate(prompts[r * n:(r + 1) * n]):
                names = list(CONFIGS)
                for name in names[i % len(names):] + names[:i % len(names)]:
                    a = complete(urls[name], prompt, tokens)
                    t = totals[name]
                    t["tokens"] += a["timings"]["predicted_n"]
                    t["decode_ms"] += a["timings"]["predicted_ms"]
                    t["wall_ms"] += a["wall_ms"]
            per_run.append(totals)
    return per_run


def bench_model(gguf: Path, prompts: list[list[int]], tokens: int, runs: int, rounds: int, threads: int,
                work: Path) -> dict:
    """Each round starts the servers anew (a process's speed varies by a few percent from start to start);
    the ratios are over every run of every round."""
    per_run = [run for _ in range(rounds) for run in one_round(gguf, prompts, tokens, runs, threads, work)]
    out: dict[str, Any] = {}
    for name in CONFIGS:
        row: dict[str, Any] = {}
        for key, tag in (("wall_ms", "e2e"), ("decode_ms", "decode")):
            rate = [r[name]["tokens"] / r[name][key] * 1e3 for r in per_run]
            ratio = [x / (r["llama-server plain"]["tokens"] / r["llama-server plain"][key] * 1e3)
                     for x, r in zip(rate, per_run)]
            row |= {f"{tag}_tok_s": statistics.median(rate), f"{tag}_vs_plain": statistics.median(ratio),
                    f"{tag}_vs_plain_range": [min(ratio), max(ratio)]}
        out[name] = row
    return out


def markdown(res: dict[str, Any]) -> str:
    lines = [f"`clover-cpp serve` and the llama-server it runs ({res['date']}, {res['cpu']}, {res['threads']} "
             f"threads). {res['rounds']} rounds, each starting the servers anew, of {res['runs']} runs of "
             f"{res['prompts']} held-out prompts, {res['tokens']} new tokens each (ignore_eos), greedy, servers "
             "interleaved on each prompt in a "
             "rotating order; ratios: the median (and range) over all runs of that run's tok/s over llama-server "
             "plain's. End to end: wall time per request at the client; decode: the server's "
             "predicted_per_second.", ""]
    for model, rows in res["models"].items():
        lines += [f"### {model}", "", "| server | e2e tok/s | vs plain | decode tok/s | vs plain |",
                  "|---|---:|---|---:|---|"]
        for name, r in rows.items():
            e, d = r["e2e_vs_plain_range"], r["decode_vs_plain_range"]
            lines.append(f"| {name} | {r['e2e_tok_s']:.0f} | {r['e2e_vs_plain']:.2f} ({e[0]:.2f}-{e[1]:.2f}) | "
                         f"{r['decode_tok_s']:.0f} | {r['decode_vs_plain']:.2f} ({d[0]:.2f}-{d[1]:.2f}) |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(parser, "bench_serve_launch", 10)
    parser.add_argument("--rounds", type=int, default=5, help="times the servers are started anew")
    parser.set_defaults(files="f16,Q4_K_M")
    args = parser.parse_args()
    from bench.bench_speed import held_out_prompts
    from clover_native import loader

    threads = args.threads or os.cpu_count() or 1
    files = model_files(args.workdir, args.files.split(","))
    prompts = held_out_prompts(args.prompts * args.runs)
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "cpu": loader.machine_summary(), "threads": threads,
                           "prompts": args.prompts, "tokens": args.tokens, "runs": args.runs, "rounds": args.rounds,
                           "models": {}}
    for name, path in files.items():
        log(f"{name}")
        res["models"][name] = bench_model(path, prompts, args.tokens, args.runs, args.rounds, threads, args.workdir)
    write_results(args, res, markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
