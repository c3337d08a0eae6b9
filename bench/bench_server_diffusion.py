#!/usr/bin/env python3
"""Block diffusion through llama-server against `clover-cpp generate`'s loop, side by side in one run. Not a unit test.

    .venv/bin/python -m bench.bench_server_diffusion [--workdir build/bench-spec] [--runs 3] [--prompts 8]
        [--tokens 128] [--files f16,Q4_K_M,35b] [--settings 8:0.9,32:0.9,32:0.5] [--quick] [--stem NAME]

Models: the trained demo model at f16 and Q4_K_M, and the random `35b-shape` 4-layer slice at Q4_K_M
(bench_spec_server's files). Prompts: held-out 48-token code prompts. For each (block size, threshold) setting,
on every prompt in turn: one request to each of two llama-servers (`mode: diffusion`, greedy, at most --tokens new
tokens, no prompt cache), as llama.cpp starts it and with `--graph-cache 6` (the engine's default: block passes and
commits alternate shapes), and the engine's run of the same request (the Python API, what `clover-cpp generate
--mode diffusion` runs), interleaved in an order shuffled per prompt.
End to end is the wall time of a request at the client (prefill included). Decode counts as llama-server's own
`predicted_per_second` does, on both sides: the tokens after the first over the time from the prompt's end (the
first block's start) to the last token; the engine's window runs from its call's start plus its prefill time to its
last token callback, so it also carries the call's set-up (about 0.2 ms on the demo model). TPF is generated tokens
per pass of the generation (block and causal passes), which the two must report alike (they decode the same
blocks). A ratio is the median over runs of that run's server tok/s over the engine's, for each server.

Results: bench/results/bench_server_diffusion.{json,md} (--stem names another pair, one per CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.bench_spec_server import N_CTX, add_run_args, complete, model_files, write_results


def log(msg: str) -> None:
    print(f"[bench_server_diffusion {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# llama-server's configurations: as llama.cpp starts it, and with the graphs of several pass shapes kept (block
# passes and commits alternate; `clover-cpp serve` adds --graph-cache, docs/serve.md)
SERVERS = {"server": (), "server --graph-cache 6": ("--graph-cache", "6")}
WHO = (*SERVERS, "engine")


def server_request(url: str, prompt: list[int], tokens: int, fields: dict[str, Any], t: dict[str, Any]) -> None:
    a = complete(url, prompt, tokens, **fields)
    tm = a["timings"]
    t["tokens"] += tm["predicted_n"]
    t["decode_tokens"] += tm["predicted_n"] - 1  # predicted_per_second's count (n_gen_steps)
    t["decode_ms"] += tm["predicted_ms"]
    t["wall_ms"] += a["wall_ms"]
    t["passes"] += tm["block_passes"] + tm["causal_passes"]


def engine_request(model: Any, prompt: list[int], tokens: int, block_size: int, threshold: float,
                   t: dict[str, Any]) -> None:
    model.reset()
    stamps: list[float] = []
    start = time.perf_counter()
    s = model.run(prompt, mode="diffusion", block_size=block_size, threshold=threshold, max_tokens=tokens,
                  on_tokens=lambda _: stamps.append(time.perf_counter())).stats
    t["wall_ms"] += (time.perf_counter() - start) * 1e3
    t["tokens"] += s.generated_tokens
    t["decode_tokens"] += s.generated_tokens - 1
    t["decode_ms"] += (stamps[-1] - start) * 1e3 - s.prefill_ms
    t["passes"] += s.block_passes + s.causal_passes


def one_run(model: Any, urls: dict[str, str], prompts: list[list[int]], tokens: int, block_size: int,
            threshold: float, first: int) -> dict:
    """Totals of each server and the engine over the prompts, interleaved on each prompt in an order shuffled per
    prompt (seeded by its index, first + i): a process that runs right after another finds the caches holding the
    other's weights, so a fixed order would favour one side."""
    totals = {k: {"tokens": 0, "decode_tokens": 0, "decode_ms": 0.0, "wall_ms": 0.0, "passes": 0} for k in WHO}
    # both stop at an end of generation: a server's ignore_eos bans it from the blocks, the engine's empty stop list
    # would not, and they would decode different blocks
    fields = {"mode": "diffusion", "block_size": block_size, "threshold": threshold, "ignore_eos": False}
    for i, prompt in enumerate(prompts):
        for name in random.Random(first + i).sample(WHO, len(WHO)):
            if name == "engine":
                engine_request(model, prompt, tokens, block_size, threshold, totals["engine"])
            else:
                server_request(urls[name], prompt, tokens, fields, totals[name])
    return totals


def summarize(per_run: list[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for who in WHO:
        out[who] = {
            "decode_tok_s": statistics.median(r[who]["decode_tokens"] / r[who]["decode_ms"] * 1e3 for r in per_run),
            "e2e_tok_s": statistics.median(r[who]["tokens"] / r[who]["wall_ms"] * 1e3 for r in per_run),
            "tpf": sum(r[who]["tokens"] for r in per_run) / sum(r[who]["passes"] for r in per_run),
        }
    for server in SERVERS:
        for key, count, tag in (("decode_ms", "decode_tokens", "decode"), ("wall_ms", "tokens", "e2e")):
            ratios = [r["engine"][key] / r[server][key] * r[server][count] / r["engine"][count] for r in per_run]
            out[f"{server} / engine, {tag}"] = {"median": statistics.median(ratios), "min": min(ratios),
                                                "max": max(ratios)}
    return out


def bench_model(path: Path, prompts: list[list[int]], settings: list[tuple[int, float]], tokens: int, runs: int,
                threads: int, work: Path) -> dict[str, Any]:
    from clover_cpp import Model
    from clover_dev.process import llama_server
    from clover_native import loader

    exe = loader.tool_path("llama-server")
    res: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        model = stack.enter_context(Model(path, n_ctx=N_CTX, n_threads=threads))
        urls = {name: stack.enter_context(llama_server(
                    exe, path, "-c", str(N_CTX), "-np", "1", "-t", str(threads), "--no-warmup", *extra,
                    log_path=work / f"server-{path.stem}-diffusion{'-graph-cache' if extra else ''}.log"))
                for name, extra in SERVERS.items()}
        for block_size, threshold in settings:
            name = f"B={block_size}, threshold {threshold}"
            log(f"{path.name}: {name}")
            # the first graphs of the setting, on every side
            for url in urls.values():
                complete(url, prompts[0], 4, mode="diffusion", block_size=block_size, threshold=threshold)
            model.reset()
            model.run(prompts[0], mode="diffusion", block_size=block_size, threshold=threshold, max_tokens=4)
            n = len(prompts) // runs
            per_run = [one_run(model, urls, prompts[r * n:(r + 1) * n], tokens, block_size, threshold, r * n)
                       for r in range(runs)]
            res[name] = summarize(per_run)
    return res


def markdown(res: dict[str, Any]) -> str:
    lines = [f"Block diffusion: llama-server (`mode: diffusion`), as llama.cpp starts it and with `--graph-cache 6`, "
             f"and the engine (`clover-cpp generate --mode diffusion`'s loop) ({res['date']}, {res['cpu']}, "
             f"{res['threads']} threads). {res['prompts']} held-out prompts per run, at most {res['tokens']} new "
             f"tokens each, greedy, interleaved on each prompt; medians over {res['runs']} runs. End to end: wall "
             "time per request at the client; decode: the server's predicted_per_second, the engine's counted alike "
             "(the tokens after the first, from the prompt's end to the last token); TPF: tokens per block or causal "
             "pass (the same on every side: they decode the same blocks).", ""]
    cache = "server --graph-cache 6"
    for model, m in res["models"].items():
        lines += [f"### {model}", "", "| setting | TPF | e2e tok/s: server, with cache, engine | "
                  "decode tok/s: server, with cache, engine | server / engine, e2e | server / engine, decode | "
                  "with cache / engine, e2e | with cache / engine, decode |",
                  "|---|---:|---|---|---|---|---|---|"]
        for name, r in m.items():
            def ratio(key: str) -> str:
                v = r[key]
                return f"{v['median']:.2f} ({v['min']:.2f}-{v['max']:.2f})"
            lines.append(f"| {name} | {r['engine']['tpf']:.2f} | "
                         + ", ".join(f"{r[w]['e2e_tok_s']:.0f}" for w in WHO) + " | "
                         + ", ".join(f"{r[w]['decode_tok_s']:.0f}" for w in WHO) + " | "
                         f"{ratio('server / engine, e2e')} | {ratio('server / engine, decode')} | "
                         f"{ratio(cache + ' / engine, e2e')} | {ratio(cache + ' / engine, decode')} |")
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
    from clover_native import loader

    if args.quick:
        args.files, args.prompts, args.runs, args.tokens = "f16", 2, 1, 32
    settings = [(int(b), float(t)) for b, t in (s.split(":") for s in args.settings.split(","))]
    threads = args.threads or os.cpu_count() or 1
    files = model_files(args.workdir, args.files.split(","))
    prompts = held_out_prompts(args.prompts * args.runs)
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "cpu": loader.machine_summary(), "threads": threads,
                           "prompts": args.prompts, "tokens": args.tokens, "runs": args.runs, "models": {}}
    for name, path in files.items():
        res["models"][name] = bench_model(path, prompts, settings, args.tokens, args.runs, threads, args.workdir)
    write_results(args, res, markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
