#!/usr/bin/env python3
"""Clover's drafts inside llama.cpp's speculative framework: llama-server with each --spec-type, and the engine
(`clover-cpp generate`'s loop, through the Python API) in ar and auto, side by side in one run. Not a unit test.

    .venv/bin/python -m bench.bench_spec_server [--workdir build/bench-spec] [--runs 3] [--prompts 10]
        [--tokens 128] [--files f16,Q4_K_M,35b] [--n-gpu-layers 0] [--quick] [--stem NAME]

Models: the trained demo model at f16 and Q4_K_M, and a random `35b-shape` 4-layer slice at Q4_K_M (real
Qwen3.5-35B-A3B layer dims; bench/predict_35b.py's). Prompts, per run (each run its own, since an n-gram
drafter's table keeps what it saw and would draft a prompt asked again from its earlier answer): --prompts
held-out 48-token code prompts (greedy), and as many that repeat nothing (bench/bench_drafts.py's no-history
prompts: prompt and continuation hold no repeated 3-gram, so n-gram drafting has nothing to copy).

Configurations, one llama-server each, all started before the first request and asked in turn on every prompt
(interleaved, in an order shuffled per prompt), greedy, --tokens new tokens (ignore_eos), without
the prompt cache:
- plain (no speculation), ngram-mod, ngram-map-k: llama.cpp's own;
- draft-clover: the model's block pass as the drafter (docs/decoding.md, "draft-clover in llama.cpp");
- ngram-mod,draft-clover: `auto` in llama.cpp (the n-gram draft first, the block draft where it pays);
- engine ar and engine auto: what `clover-cpp generate` runs, in this process, through the Python API (auto drafts
  with the same common/speculative drafters as `ngram-mod,draft-clover`, and verifies with the same
  common_sampler_sample_and_accept_n), with the end-of-generation tokens banned as ignore_eos bans them.
End to end is the wall time of a request at the client (prefill included). Decode counts as llama-server's
`predicted_per_second` does, on both sides: from the first emitted token to the last, over the tokens emitted after
the first pass's (llama-server's first token comes with the prompt's pass; the engine's prefill leaves the prompt's
last token to its first pass, which may also verify a draft), the sampling and the drafting included, the call's
set-up not (the engine's stamps come from its token callback). A ratio is the median over runs of that run's tok/s
over the reference's in the same run. The block pass is reported in ar steps, from the engine's measured pass costs
(Model.measure_pass_costs), on the same device.

Results: bench/results/bench_spec_server.{json,md} (--stem names another pair, one per CPU).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import urllib.request
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
SERVER_TYPES = ["none", "ngram-mod", "ngram-map-k", "draft-clover", "ngram-mod,draft-clover"]
ENGINE_MODES = ["ar", "auto"]
N_CTX = 2048
WARM_UP_TOKENS = 8


def log(msg: str) -> None:
    print(f"[bench_spec_server {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def label(kind: str, name: str) -> str:
    return f"server {'plain' if name == 'none' else name}" if kind == "server" else f"engine {name}"


def model_files(work: Path, files: list[str]) -> dict[str, Path]:
    from clover_dev.convert import clover_convert, quantize

    work.mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}
    f16 = work / "demo-f16.gguf"
    if not f16.exists():
        clover_convert(REPO / "models" / "clover-demo", f16, "f16")
    if "f16" in files:
        out["demo f16"] = f16
    if "Q4_K_M" in files:
        q4 = work / "demo-Q4_K_M.gguf"
        if not q4.exists():
            quantize(f16, q4, "Q4_K_M")
        out["demo Q4_K_M"] = q4
    if "35b" in files:
        from bench.predict_35b import slice_gguf

        out["35b-shape 4-layer slice Q4_K_M"] = slice_gguf(work, 4)
    return out


@contextmanager
def servers(gguf: Path, threads: int, ngl: int, work: Path) -> Iterator[dict[str, tuple[str, Path]]]:
    """One llama-server of the native build per configuration: spec type -> (URL, log file)."""
    from clover_dev.process import llama_server
    from clover_native import loader

    exe = loader.tool_path("llama-server")
    with ExitStack() as stack:
        out = {}
        for spec in SERVER_TYPES:
            log_path = work / f"server-{gguf.stem}-{spec.replace(',', '+')}.log"
            url = stack.enter_context(llama_server(exe, gguf, "-c", str(N_CTX), "-np", "1", "-t", str(threads),
                                                   "-ngl", str(ngl), "--no-warmup", "--spec-type", spec,
                                                   log_path=log_path))
            out[spec] = (url, log_path)
        yield out


def complete(url: str, prompt: list[int], tokens: int, **fields: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "n_predict": tokens, "temperature": 0.0, "ignore_eos": True, "cache_prompt": False,
            **fields}
    req = urllib.request.Request(url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as resp:
        answer = json.loads(resp.read())
    answer["wall_ms"] = (time.perf_counter() - start) * 1e3
    return answer


def ignore_eos(model: Any) -> dict[str, Any]:
    """The engine's fields for llama-server's ``ignore_eos``: no stop token, and the end-of-generation tokens banned
    (llama-server gives them a -inf logit bias), so that both sides generate the same tokens."""
    from clover_native import loader
    lib = loader.llama()
    vocab = lib.llama_model_get_vocab(model.llama_model)
    eog = [t for t in range(lib.llama_vocab_n_tokens(vocab)) if lib.llama_vocab_is_eog(vocab, t)]
    return {"stop_ids": [], "banned_ids": eog}


def one_run(model: Any, urls: dict[str, tuple[str, Path]], prompts: list[list[int]], tokens: int,
            engine_fields: dict[str, Any], first: int = 0) -> dict:
    """Totals per configuration over the prompts, configurations interleaved on each prompt in an order shuffled
    per prompt (seeded by its index, `first` + i), so that no configuration always runs first or right after the
    same one: a server's threads still busy after its answer, or a slow configuration's heat, then falls on each. (A
    rotation keeps each configuration's predecessor; only a shuffle changes it.)"""
    configs = [("server", s) for s in SERVER_TYPES] + [("engine", m) for m in ENGINE_MODES]
    totals = {label(k, n): {"tokens": 0, "decode_tokens": 0, "decode_ms": 0.0, "wall_ms": 0.0, "drafted": 0,
                            "accepted": 0}
              for k, n in configs}
    for i, prompt in enumerate(prompts):
        for kind, name in random.Random(first + i).sample(configs, len(configs)):
            t = totals[label(kind, name)]
            if kind == "server":
                a = complete(urls[name][0], prompt, tokens)
                tm = a["timings"]
                t["tokens"] += tm["predicted_n"]
                t["decode_tokens"] += tm["predicted_n"] - 1  # its first token came with the prompt's pass
                t["decode_ms"] += tm["predicted_ms"]
                t["wall_ms"] += a["wall_ms"]
                t["drafted"] += tm.get("draft_n", 0)
                t["accepted"] += tm.get("draft_n_accepted", 0)
                continue
            model.reset()
            commits: list[tuple[float, int]] = []
            start = time.perf_counter()
            s = model.run(prompt, mode=name, max_tokens=tokens,
                          on_tokens=lambda block: commits.append((time.perf_counter(), len(block))),
                          **engine_fields).stats
            wall_ms = (time.perf_counter() - start) * 1e3
            t["wall_ms"] += wall_ms
            t["tokens"] += s.generated_tokens
            # as llama-server's predicted_per_second: from the first emitted token to the last, over the tokens after
            # the first pass's (the engine's prefill leaves the prompt's last token to that pass)
            t["decode_tokens"] += s.generated_tokens - commits[0][1]
            t["decode_ms"] += (commits[-1][0] - commits[0][0]) * 1e3
            t["drafted"] += s.auto_drafted
            t["accepted"] += s.auto_accepted
    return totals


def rate(r: dict, n: str, key: str) -> float:
    """Configuration n's tok/s in run r by key: decode_ms (the tokens after the first pass's) or wall_ms (all)."""
    return r[n]["decode_tokens" if key == "decode_ms" else "tokens"] / r[n][key] * 1e3


def best_ngram(per_run: list[dict], key: str) -> str:
    """The llama.cpp n-gram type with the higher median tok/s over the runs. Taking the faster of the two run by run
    would compare with the top of two noisy samples even where both do the same work (on the 35b-shape slice's
    held-out prompts neither drafts a token), and put a configuration that does that work too below 1."""
    types = [label("server", t) for t in ("ngram-mod", "ngram-map-k")]
    return max(types, key=lambda n: statistics.median(rate(r, n, key) for r in per_run))


def summarize(per_run: list[dict], name: str, ref: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, tag in (("decode_ms", "decode"), ("wall_ms", "e2e")):
        rates = [rate(r, name, key) for r in per_run]
        ratios = [rate(r, name, key) / rate(r, ref, key) for r in per_run]
        out[f"{tag}_tok_s"] = statistics.median(rates)
        out[f"{tag}_vs_plain"] = statistics.median(ratios)
        out[f"{tag}_vs_plain_runs"] = ratios
    out["drafted"] = sum(r[name]["drafted"] for r in per_run)
    out["accepted"] = sum(r[name]["accepted"] for r in per_run)
    return out


# the goals' comparisons, run by run: (what, over what); "best n-gram" is the n-gram type with the higher median
# (best_ngram). auto is the engine's `--mode auto` and llama-server's `--spec-type ngram-mod,draft-clover`.
PAIRS = [("engine auto", "server ngram-mod"), ("engine auto", "best n-gram"),
         ("server ngram-mod,draft-clover", "best n-gram"),
         ("engine auto", "server ngram-mod,draft-clover"), ("engine ar", "server plain")]


def pairs(per_run: list[dict]) -> dict[str, Any]:
    """Each PAIRS ratio per run, for decode and end-to-end tok/s: the median and the runs' range (and, for "best
    n-gram", which type that was)."""
    out: dict[str, Any] = {}
    for a, b in PAIRS:
        for key, tag in (("decode_ms", "decode"), ("wall_ms", "e2e")):
            over = best_ngram(per_run, key) if b == "best n-gram" else b
            ratios = [rate(r, a, key) / rate(r, over, key) for r in per_run]
            out[f"{a} / {b}, {tag}"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                                        "over": over}
    return out


def bench_model(path: Path, prompts: dict[str, list[list[int]]], tokens: int, runs: int, threads: int, ngl: int,
                work: Path) -> dict[str, Any]:
    from clover_cpp import Model

    res: dict[str, Any] = {}
    with Model(path, n_threads=threads, n_gpu_layers=ngl) as model, servers(path, threads, ngl, work) as urls:
        engine_fields = ignore_eos(model)
        costs, block = model.measure_pass_costs(), model.info.block_size
        for set_name, plist in prompts.items():
            if len(plist) < runs:  # each run needs prompts of its own
                log(f"{path.name}: {set_name}: {len(plist)} prompts qualified, fewer than the {runs} runs; skipped")
                continue
            # each run its own prompts: an n-gram drafter's table keeps what it saw, and a prompt asked again would be
            # drafted from its own earlier answer
            n = len(plist) // runs
            log(f"{path.name}: {set_name}, {n} prompts per run")
            # before anything is timed, each configuration's first graphs and draft-clover's first timed rounds: it
            # drafts until it has timed a block round (on the 35b-shape slice one such round costs 0.6 s), then times
            # a round without a draft, its first round after a prompt not counted; 4 tokens left the block round
            # untimed in llama-server, whose drafts shrink to the tokens a request has left
            for url, _ in urls.values():
                complete(url, plist[0], WARM_UP_TOKENS)
            for mode in ENGINE_MODES:
                model.reset()
                model.run(plist[0], mode=mode, max_tokens=WARM_UP_TOKENS, **engine_fields)
            per_run = [one_run(model, urls, plist[r * n:(r + 1) * n], tokens, engine_fields, first=r * n)
                       for r in range(runs)]
            res[set_name] = {n: summarize(per_run, n, label("server", "none")) for n in per_run[0]}
            res.setdefault("pairs", {})[set_name] = pairs(per_run)
            res.setdefault("prompts_per_run", {})[set_name] = n
    block_ms = costs.block_fixed_ms + block * costs.block_row_ms
    res["block_pass"] = {"block_size": block, "ms": block_ms, "ar_step_ms": costs.ar_ms,
                         "in_ar_steps": block_ms / costs.ar_ms}
    return res


def markdown(res: dict[str, Any]) -> str:
    lines = [f"llama-server's speculative types and the engine ({res['date']}, {res['cpu']}, {res['threads']} threads, "
             f"-ngl {res['ngl']}). Up to {res['prompts']} prompts per set and run (each run its own; fewer where fewer "
             "qualified), "
             f"{res['tokens']} new tokens each (ignore_eos), greedy, configurations interleaved on each prompt, "
             f"in an order shuffled per prompt; ratios are the median over {res['runs']} runs of that run's "
             "tok/s over server plain's. End to end: wall time per request at the client; decode: as the server's "
             "predicted_per_second counts, on both sides: from the first emitted token to the last, over the tokens "
             "after the first pass's.", ""]
    for model, m in res["models"].items():
        bp = m.get("block_pass")
        lines += [f"### {model}", ""]
        if bp:
            lines += [f"A block pass of B = {bp['block_size']} rows (the engine's measured pass costs): "
                      f"{bp['ms']:.2f} ms = {bp['in_ar_steps']:.1f} ar steps of {bp['ar_step_ms']:.3f} ms.", ""]
        for set_name, rows in m.items():
            if set_name in ("block_pass", "pairs", "prompts_per_run"):
                continue
            lines += [f"**{set_name}** ({m['prompts_per_run'][set_name]} prompts per run)", "",
                      "| configuration | e2e tok/s | vs plain | decode tok/s | vs plain | drafted | accepted |",
                      "|---|---:|---:|---:|---:|---:|---:|"]
            for name, r in rows.items():
                lines.append(f"| {name} | {r['e2e_tok_s']:.0f} | {r['e2e_vs_plain']:.2f} | {r['decode_tok_s']:.0f} | "
                             f"{r['decode_vs_plain']:.2f} | {r['drafted']} | {r['accepted']} |")
            lines += ["", "| run by run | median | range |", "|---|---:|---|"]
            for name, p in m["pairs"][set_name].items():
                shown = name.replace("best n-gram", f"best n-gram ({p['over']})")
                lines.append(f"| {shown} | {p['median']:.2f} | {p['min']:.2f}-{p['max']:.2f} |")
            lines.append("")
    return "\n".join(lines)


def add_run_args(parser: argparse.ArgumentParser, stem: str, prompts: int) -> None:
    """The options this bench shares with bench_server_diffusion: files, prompts, runs, threads, where results go."""
    parser.add_argument("--workdir", type=Path, default=REPO / "build" / "bench-spec")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=prompts)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--files", default="f16,Q4_K_M,35b")
    parser.add_argument("--threads", type=int, default=0, help="0: the machine's cores")
    parser.add_argument("--stem", default=stem)
    parser.add_argument("--results", type=Path, default=RESULTS, help="where the .json and .md go")


def write_results(args: argparse.Namespace, res: dict[str, Any], text: str) -> None:
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / f"{args.stem}.json").write_text(json.dumps(res, indent=1))
    (args.results / f"{args.stem}.md").write_text(text + "\n")
    print(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(parser, "bench_spec_server", 10)
    parser.add_argument("--n-gpu-layers", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="demo f16 only, 2 prompts per set, 1 run, 32 tokens")
    args = parser.parse_args()
    import os

    from bench.bench_drafts import no_history_prompts
    from bench.bench_speed import held_out_prompts
    from clover_native import loader

    if args.quick:
        args.files, args.prompts, args.runs, args.tokens = "f16", 2, 1, 32
    threads = args.threads or os.cpu_count() or 1
    files = model_files(args.workdir, args.files.split(","))
    first = next(iter(files.values()))
    fresh, _ = no_history_prompts(first, args.prompts * args.runs, args.tokens)
    prompts = {"held-out": held_out_prompts(args.prompts * args.runs), "no-history": fresh}
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "cpu": loader.machine_summary(), "threads": threads,
                           "ngl": args.n_gpu_layers, "prompts": args.prompts, "tokens": args.tokens,
                           "runs": args.runs, "models": {}}
    for name, path in files.items():
        res["models"][name] = bench_model(path, prompts, args.tokens, args.runs, threads, args.n_gpu_layers,
                                          args.workdir)
    write_results(args, res, markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
