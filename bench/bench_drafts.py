#!/usr/bin/env python3
"""Whether the model's own drafts pay: every mode against ar, with the graph cache on and off, and auto's rounds
by the kind of draft. Not a unit test.

    .venv/bin/python -m bench.bench_drafts [--workdir build/bench-drafts] [--runs 3] [--prompts 10] [--tokens 64]
                                           [--files f16,Q4_K_M] [--quick] [--stem NAME]

The trained demo model (models/clover-demo) at f16 and Q4_K_M, on three prompt sets, each a list of 48-token
prompts of held-out standard-library code (the model card's split):
- **greedy**: the first --prompts held-out prompts, greedy;
- **sampled**: the same prompts at temperature 0.8 (seeded per prompt and run; the same seed for every mode);
- **no-history**: prompts whose own tokens and whose continuation hold no repeated 3-gram, so copying the
  history cannot draft. The demo model loops under greedy decoding, so their continuations are sampled
  (temperature 0.8, seed 0): a prompt qualifies when prompt + the 64 tokens ar samples hold no 3-gram twice.
  The candidates are taken in order from 400 held-out prompts until --prompts qualify.
Configurations: ar, spec at B = 2, 4, 8 (unfused: a block pass and a verification per round), spec at B = 4 and 8
with fused verify + draft passes (GenParams.spec_fused; docs/native.md, "The fused pass"), diffusion at B = 8
(threshold 0.9), auto (llama.cpp's ngram-mod and draft-clover drafters, docs/decoding.md "auto"); and auto and
spec B = 4 again with the graph cache off ($CLOVER_GRAPH_CACHE's 0). Each
configuration has an engine of its own (the graphs it keeps are its own, as for a user who runs one mode). Within
a run every configuration runs on each prompt in turn; a run is repeated --runs times and a ratio is the median
over the runs of that run's tok/s over ar's.

Per configuration: decode tok/s, ratio to ar, TPF, ms per pass, graph builds per pass, and the rebuild share:
graph builds x the rebuild cost measured with the cache off, over the decode time. For auto: rounds by kind
(none / n-gram / block), draft tokens accepted, and the share of them that block passes drafted. For spec B = 2
and 4: the ceiling of a fused verify + draft pass (`fused_ceiling`), from the same run's rounds and pass times.

Results: bench/results/bench_drafts.{json,md} (--stem names another pair, one per CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.bench_speed import held_out_prompts, summarize
from clover_ref.train import corpus_files, encode_files

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
SAMPLED_TEMP = 0.8
# (label, mode, block size, graph cache: None = the engine's default); spec runs unfused unless the label says fused
CONFIGS = [("ar", "ar", None, None), ("spec B=2", "spec", 2, None), ("spec B=4", "spec", 4, None),
           ("spec B=8", "spec", 8, None), ("spec B=4, fused", "spec", 4, None), ("spec B=8, fused", "spec", 8, None),
           ("diffusion B=8", "diffusion", 8, None), ("auto", "auto", None, None), ("spec B=4, cache off", "spec", 4, 0),
           ("auto, cache off", "auto", None, 0)]

def log(msg: str) -> None:
    print(f"[bench_drafts {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def has_repeated_3gram(tokens: list[int]) -> bool:
    grams = [tuple(tokens[i:i + 3]) for i in range(len(tokens) - 2)]
    return len(set(grams)) < len(grams)


def no_history_prompts(path: Path, n: int, tokens: int) -> tuple[list[list[int]], int]:
    """Prompts whose tokens and sampled ar continuation hold no repeated 3-gram (and how many were tried).

    The held-out stream is searched at 400 evenly spaced starts; when those give fewer than n, at up to 7 more sets
    of 400, each shifted by another eighth of the spacing, so that a larger n neither changes the first prompts nor
    crowds them into one file."""
    from clover_cpp import Model

    _, held = corpus_files()
    stream = encode_files(held, max_bytes=1 << 20)
    step = max(1, (len(stream) - 48) // 400)
    starts = (start for k in range(8) for start in range(k * step // 8, len(stream) - 48, step))
    out: list[list[int]] = []
    tried = 0
    with Model(path) as model:
        for start in starts:
            prompt = stream[start:start + 48].tolist()
            tried += 1
            if has_repeated_3gram(prompt):
                continue
            model.reset()
            cont = model.run(prompt, mode="ar", max_tokens=tokens, stop_ids=[], temperature=SAMPLED_TEMP,
                             seed=0).tokens
            if not has_repeated_3gram(prompt + cont):
                out.append(prompt)
                if len(out) == n:
                    break
    return out, tried


MEMORY_PROBE = """
import sys
from clover_cpp import Model
def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
with Model(sys.argv[1], graph_cache=int(sys.argv[2])) as model:
    loaded = rss_mib()
    prompt = list(range(40, 88))
    for mode, b in (("ar", None), ("spec", 2), ("spec", 4), ("spec", 8), ("diffusion", 8), ("auto", None)):
        model.reset()
        model.run(prompt, mode=mode, max_tokens=64, stop_ids=[], **({"block_size": b} if b else {}))
    print(rss_mib() - loaded)
"""


def memory_growth_mib(path: Path, cache: int) -> float:
    """RSS growth of a process from its load to the end of one run of every configuration (the compute buffers
    of the graphs it built and kept), with the given graph cache."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(path), str(cache)], capture_output=True, text=True,
                          check=True, cwd=REPO)
    return float(done.stdout.strip().splitlines()[-1])


def one_run(models: dict[Any, Any], prompts: list[list[int]], tokens: int, temperature: float,
            run: int) -> dict[str, dict[str, float]]:
    totals: dict[str, dict[str, float]] = {}
    for i, prompt in enumerate(prompts):
        for name, mode, b, _ in CONFIGS:
            model = models[name]
            model.reset()
            opts: dict[str, Any] = {"block_size": b} if b else {}
            if mode == "diffusion":
                opts["threshold"] = 0.9
            if mode == "spec":
                opts["spec_fused"] = "fused" in name
            s = model.run(prompt, mode=mode, max_tokens=tokens, stop_ids=[], temperature=temperature,
                          seed=1000 * run + i, **opts).stats
            t = totals.setdefault(name, {"tokens": 0, "ms": 0.0, "passes": 0, "builds": 0, "none": 0, "ngram": 0,
                                         "block": 0, "accepted": 0, "accepted_block": 0, "block_ms": 0.0,
                                         "block_passes": 0, "causal_ms": 0.0, "causal_passes": 0, "rounds": 0,
                                         "full_rounds": 0})
            t["tokens"] += s.generated_tokens
            t["ms"] += s.decode_ms
            t["block_ms"] += s.block_ms
            t["block_passes"] += s.block_passes
            t["causal_ms"] += s.causal_ms
            t["causal_passes"] += s.causal_passes
            t["fused_passes"] = t.get("fused_passes", 0) + s.fused_passes
            if mode == "spec":  # accepted_lengths[m]: rounds that kept m tokens; m == B: every draft accepted
                t["rounds"] += sum(s.accepted_lengths)
                t["full_rounds"] += s.accepted_lengths[b] if b < len(s.accepted_lengths) else 0
            t["passes"] += s.passes
            t["builds"] += s.passes - s.graph_reuses
            for kind, n in s.auto_rounds.items():
                t[kind] += n
            t["accepted"] += s.auto_accepted
            t["accepted_block"] += s.auto_accepted_block
    return totals


def bench_set(models: dict[Any, Any], prompts: list[list[int]], tokens: int, temperature: float, runs: int,
              rebuild_ms: float) -> dict[str, Any]:
    per_run = [one_run(models, prompts, tokens, temperature, r) for r in range(runs)]
    rows = {}
    for name, *_ in CONFIGS:
        agg = {k: sum(r[name][k] for r in per_run) for k in per_run[0][name]}
        rows[name] = summarize(per_run, name) | {
            "builds_per_pass": agg["builds"] / agg["passes"],
            "rebuild_share": agg["builds"] * rebuild_ms / agg["ms"],
            "rounds": {k: agg[k] for k in ("none", "ngram", "block")}, "accepted": agg["accepted"],
            "block_share": agg["accepted_block"] / agg["accepted"] if agg["accepted"] else 0.0,
        }
    ceilings = {b: fused_ceiling(per_run, b) for b in (2, 4)}
    return {"rows": rows, "fused_ceiling": {f"spec B={b}": c for b, c in ceilings.items() if c}}


def fused_ceiling(per_run: list[dict[str, dict[str, float]]], b: int) -> dict[str, float] | None:
    """What `spec` B would reach if a round's verification and the next round's block draft were one pass (not
    implemented; docs/decoding.md): per run, the measured rounds of spec B (tokens per round, and the share of
    rounds that accepted every draft, whose fused draft of the next window stays valid), each charged one causal
    pass of 2B rows (timed in the same run as spec 2B's verifications) plus, after a round that rejected a draft,
    a block pass of B rows (timed as spec B's). The fused pass is taken to cost no more than a causal pass of the
    same rows and its draft to be as good as a separate one's: a ceiling, against ar's tok/s of the same run."""
    name, wide = f"spec B={b}", f"spec B={2 * b}"
    ratios = []
    for r in per_run:
        if name not in r or wide not in r or not r[name]["rounds"] or not r[wide]["causal_passes"]:
            return None
        spec, ar = r[name], r["ar"]
        tokens_per_round = spec["tokens"] / spec["rounds"]
        full = spec["full_rounds"] / spec["rounds"]
        fused_ms = r[wide]["causal_ms"] / r[wide]["causal_passes"]
        block_ms = spec["block_ms"] / spec["block_passes"]
        round_ms = fused_ms + (1.0 - full) * block_ms
        ratios.append(tokens_per_round / round_ms / (ar["tokens"] / ar["ms"]))
    agg = {k: sum(r[name][k] for r in per_run) for k in ("tokens", "rounds", "full_rounds")}
    return {"ratio": statistics.median(ratios), "tokens_per_round": agg["tokens"] / agg["rounds"],
            "full_share": agg["full_rounds"] / agg["rounds"]}


def markdown(res: dict[str, Any]) -> str:
    out = [f"Drafts ({res['date']}, {res['cpu']}, {res['threads']} threads). {res['prompts']} prompts of 48 tokens, "
           f"{res['tokens']} new tokens; ratio = median over {res['runs']} interleaved runs of tok/s over ar's. "
           "Rebuild share: graph builds x the rebuild cost measured with the graph cache off, over the decode "
           f"time. No-history prompts: {res['no_history_note']}.", ""]
    for file, sets in res["files"].items():
        mem = sets["memory_growth_mib"]
        out += [f"## demo {file} (rebuild cost with the cache off: {sets['rebuild_ms']:.3f} ms; with it: "
                f"{sets['rebuild_ms_cached']:.3f} ms; RSS growth over one run of every mode: {mem[0]:.1f} MiB with "
                f"the cache off, {mem[6]:.1f} MiB with 6 graphs kept)", ""]
        for set_name, measured in sets["sets"].items():
            rows = measured["rows"]
            out += [f"### {set_name}", "", "| configuration | tok/s | vs ar | TPF | ms/pass | builds/pass | rebuild "
                    "share | auto rounds none/n-gram/block | accepted drafts (from block passes) |",
                    "|---|---:|---:|---:|---:|---:|---:|---|---|"]
            for name, r in rows.items():
                rounds = "/".join(str(r["rounds"][k]) for k in ("none", "ngram", "block")) if "auto" in name else ""
                acc = f"{r['accepted']} ({100 * r['block_share']:.0f} %)" if "auto" in name else ""
                out.append(f"| {name} | {r['tok_s']:.1f} | {r['ratio']:.2f} | {r['tpf']:.2f} | {r['ms_per_pass']:.3f} "
                           f"| {r['builds_per_pass']:.2f} | {100 * r['rebuild_share']:.1f} % | {rounds} | {acc} |")
            for name, c in measured["fused_ceiling"].items():
                out.append(f"\nCeiling of a fused verify + draft pass for {name} (`fused_ceiling`): "
                           f"{c['ratio']:.2f}x ar ({c['tokens_per_round']:.2f} tokens per round, "
                           f"{100 * c['full_share']:.0f} % of rounds accept every draft).")
            out.append("")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=REPO / "build" / "bench-drafts")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--files", default="f16,Q4_K_M")
    ap.add_argument("--quick", action="store_true", help="f16 only, 1 run, 3 prompts (a smoke test)")
    ap.add_argument("--stem", default="bench_drafts", help="results file name, without .json/.md")
    args = ap.parse_args()
    if args.quick:
        args.files, args.runs, args.prompts = "f16", 1, 3
    from clover_native import loader
    from clover_cpp import Model
    from clover_dev.convert import clover_convert, quantize

    args.workdir.mkdir(parents=True, exist_ok=True)
    f16 = args.workdir / "demo-f16.gguf"
    if not f16.exists():
        clover_convert(REPO / "models" / "clover-demo", f16, "f16")
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "cpu": loader.machine_summary(), "runs": args.runs,
                           "prompts": args.prompts, "tokens": args.tokens, "files": {}}
    held = held_out_prompts(args.prompts)
    for file in args.files.split(","):
        path = f16 if file == "f16" else args.workdir / f"demo-{file}.gguf"
        if not path.exists():
            quantize(f16, path, file)
        log(f"{file}: the no-history prompts")
        fresh, tried = no_history_prompts(path, args.prompts, args.tokens)
        res["no_history_note"] = (f"{len(fresh)} of {tried} held-out candidates qualified on {file} (prompt + "
                                  f"{args.tokens} tokens sampled by ar at T {SAMPLED_TEMP}, seed 0, hold no "
                                  "repeated 3-gram)")
        # one engine per configuration, as a user runs one mode: the graphs a configuration keeps are its own
        models = {name: Model(path, graph_cache=cache) for name, _, _, cache in CONFIGS}
        try:
            res["threads"] = models["ar"].n_threads
            rebuild_ms = models["auto, cache off"].measure_pass_costs().rebuild_ms
            rebuild_cached = models["auto"].measure_pass_costs().rebuild_ms
            sets = {}
            for set_name, prompts, temp in (("greedy", held, 0.0), (f"sampled, T {SAMPLED_TEMP}", held, SAMPLED_TEMP),
                                            (f"no-history, T {SAMPLED_TEMP}", fresh, SAMPLED_TEMP),
                                            ("no-history, greedy", fresh, 0.0)):
                log(f"{file}: {set_name}")
                sets[set_name] = bench_set(models, prompts, args.tokens, temp, args.runs, rebuild_ms)
        finally:
            for model in models.values():
                model.close()
        memory = {cache: memory_growth_mib(path, cache) for cache in (0, 6)}
        res["files"][file] = {"rebuild_ms": rebuild_ms, "rebuild_ms_cached": rebuild_cached, "sets": sets,
                              "memory_growth_mib": memory}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.stem}.json").write_text(json.dumps(res, indent=1) + "\n")
    (RESULTS / f"{args.stem}.md").write_text(markdown(res) + "\n")
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
