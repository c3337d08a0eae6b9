#!/usr/bin/env python3
"""Aggregate decode speed of concurrent clients over `clover-cpp serve -np N` (llama-server), and the server's memory.

    .venv/bin/python -m bench.bench_parallel [--models mid-Q8_0,demo] [--clients 1,2,4,8] [--modes ar,auto]
                                             [--tokens 64] [--rss-requests 300] [--workdir build/bench-parallel]

1. The bound. What batching can give is set by what a pass of N rows costs against a one-row step: a causal
   pass of N tokens after a 64-token prefill (rolled back after each timing, median of 15, one thread per
   core) bounds the speed-up of N clients at N * t(1) / t(N).
2. For each model, one server with `-np` = the largest client count, driven by the official openai client:
   for each client count and mode, that many clients at once, each streaming --tokens tokens (greedy,
   ignore_eos) of its own prompt. Aggregate decode tok/s = all generated tokens / (last token - first token
   of the run), side by side with one client on the same server. The speed-up is reported with the bound.
3. Memory: 300 mixed requests (modes, streaming or not, some cancelled mid-stream) through 4 concurrent
   clients on the demo model with -np 4; the server's RSS (/proc/PID/status VmRSS) after request 100 and
   after request 300.

Results: bench/results/bench_parallel.md and .json. This 2-core machine is noisy: compare within one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
PROMPTS = ["Write a function that {} a list.", "Explain how {} works in Python.", "Give a loop that {} numbers.",
           "Describe a class that {} items.", "Show a test that {} strings.", "Sketch a parser that {} files.",
           "Write a script that {} logs.", "Draft a module that {} data."]
VERBS = ["sorts", "reverses", "counts", "filters", "merges", "splits", "hashes", "parses"]


def log(msg: str) -> None:
    print(f"[bench_parallel {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def model_path(name: str, work: Path) -> Path:
    """mid-Q8_0 (made like bench_serve's) or demo (the shipped model at Q4_K_M, as `make demo` makes it)."""
    from clover_dev.convert import clover_convert, quantize

    if name == "demo":
        out = work / "clover-demo-Q4_K_M.gguf"
        if not out.exists():
            work.mkdir(parents=True, exist_ok=True)
            f16 = clover_convert(REPO / "models" / "clover-demo", work / "clover-demo-f16.gguf", "f16")
            quantize(f16, out, "Q4_K_M")
        return out
    from bench.bench_serve import make_model

    preset, quant = name.split("-")
    shared = REPO / "build" / "bench-serve" / f"{preset}-{quant}.gguf"
    return shared if shared.exists() else make_model(work, preset, quant)


def bound(gguf: Path, clients: list[int]) -> dict[str, Any]:
    from clover_native import bindings

    model = bindings.LlamaModel(gguf)
    ctx = bindings.Context(model, n_ctx=2048, n_ubatch=64, n_rs_seq=max(clients))
    try:
        ids = list(range(100, 164))
        ctx.causal(ids, rows=[63])
        ms: dict[int, float] = {}
        for w in sorted(set([1] + clients)):
            times = []
            for _ in range(15):
                t0 = time.perf_counter()
                ctx.causal(ids[:w], rows=list(range(w)))
                times.append((time.perf_counter() - t0) * 1e3)
                ctx.rollback(64)
            ms[w] = float(sorted(times)[len(times) // 2])
    finally:
        ctx.close()
        model.close()
    return {"pass_ms": ms, "speedup_bound": {n: n * ms[1] / ms[n] for n in clients}}


class Server:
    """`clover-cpp serve` (llama-server) on ``gguf`` with --metrics, on a free port; stop() ends it."""

    def __init__(self, gguf: Path, n_parallel: int, n_ctx: int, log_path: Path) -> None:
        from clover_dev.process import cli_command, free_port, serving

        port = free_port()
        self._stack = contextlib.ExitStack()
        self.url, self.proc = self._stack.enter_context(serving(
            cli_command("serve", "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-c", str(n_ctx),
                        "-np", str(n_parallel), "--metrics", "--no-webui"), port, log_path=log_path, ready_s=300))
        from openai import OpenAI

        self.client = OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=600)
        self.model = self.client.models.list().data[0].id

    def rss_mib(self) -> float:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024

    def metrics(self) -> dict[str, float]:
        from clover_dev.process import server_metrics

        return server_metrics(self.url)

    def stop(self) -> None:
        self._stack.close()


def stream(server: Server, prompt: str, mode: str, tokens: int, cancel_after: int = 0) -> dict[str, Any]:
    """One streamed chat request: times of its first and last token, tokens generated."""
    t_first = t_last = None
    n = 0
    s = server.client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": prompt}], max_tokens=tokens, temperature=0,
        stream=True, stream_options={"include_usage": True},
        extra_body={"mode": mode, "ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}})
    for chunk in s:
        if chunk.choices and (chunk.choices[0].delta.content
                              or chunk.choices[0].delta.model_extra.get("reasoning_content")):
            now = time.perf_counter()
            t_first = t_first or now
            t_last = now
            n += 1
            if cancel_after and n >= cancel_after:
                s.close()
                break
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
    return {"t_first": t_first, "t_last": t_last, "tokens": n}


def concurrent(server: Server, n_clients: int, mode: str, tokens: int, round_no: int) -> dict[str, Any]:
    results: list[dict[str, Any]] = [{} for _ in range(n_clients)]

    def run(i: int) -> None:
        k = (round_no + i) % len(PROMPTS)
        results[i] = stream(server, PROMPTS[k].format(VERBS[(i + round_no) % len(VERBS)]), mode, tokens)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n_clients)]
    before = server.metrics()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = server.metrics()
    first = min(r["t_first"] for r in results)
    last = max(r["t_last"] for r in results)
    total = sum(r["tokens"] for r in results)
    decodes = after["n_decode_total"] - before["n_decode_total"]
    return {"clients": n_clients, "mode": mode, "tokens": total, "seconds": last - first,
            "tok_s": total / (last - first), "tokens_per_decode": total / decodes if decodes else float("nan")}


def speed(name: str, gguf: Path, clients: list[int], modes: list[str], tokens: int, work: Path) -> dict[str, Any]:
    log(f"{name}: the cost of a pass of N rows")
    res: dict[str, Any] = {"model": name, "bound": bound(gguf, clients), "runs": []}
    server = Server(gguf, max(clients), 1024 * max(clients), work / f"server-{name}.log")
    try:
        for mode in modes:
            concurrent(server, 1, mode, 8, 0)  # warm-up (auto measures its cost table per slot on first use)
            for n in clients:
                r = concurrent(server, n, mode, tokens, n)
                res["runs"].append(r)
                log(f"{name} {mode} x{n}: {r['tok_s']:.1f} tok/s, {r['tokens_per_decode']:.2f} tokens/decode")
    finally:
        server.stop()
    return res


def memory(gguf: Path, n_requests: int, work: Path) -> dict[str, Any]:
    server = Server(gguf, 4, 4096, work / "server-rss.log")
    modes = ["ar", "auto", "spec", "diffusion"]
    rss: dict[int, float] = {0: server.rss_mib()}
    lock = threading.Lock()
    done = [0]
    outcome = {"completed": 0, "cancelled": 0, "failed": 0}

    def client(c: int) -> None:
        while True:
            with lock:
                i = done[0]
                if i >= n_requests:
                    return
                done[0] += 1
            prompt = PROMPTS[i % len(PROMPTS)].format(VERBS[(i * 7 + c) % len(VERBS)]) + f" ({i})"
            cancel = i % 5 != 4 and i % 7 == 3
            try:
                if i % 5 == 4:
                    resp = server.client.chat.completions.create(
                        model=server.model, messages=[{"role": "user", "content": prompt}], max_tokens=16,
                        temperature=0,
                        extra_body={"mode": modes[i % 4], "chat_template_kwargs": {"enable_thinking": False}})
                    assert resp.choices[0].finish_reason
                else:
                    stream(server, prompt, modes[i % 4], 16, cancel_after=4 if cancel else 0)
                kind = "cancelled" if cancel else "completed"
            except Exception as e:  # counted, and the run goes on: the bench measures memory, not errors
                log(f"request {i} failed: {e}")
                kind = "failed"
            with lock:
                outcome[kind] += 1
                if i + 1 in (100, 200, n_requests):
                    rss[i + 1] = server.rss_mib()

    try:
        threads = [threading.Thread(target=client, args=(c,)) for c in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(1.0)
        rss[n_requests] = server.rss_mib()
    finally:
        server.stop()
    growth = (rss[n_requests] - rss[100]) / rss[100] * 100 if 100 in rss else float("nan")
    return {"requests": n_requests, "rss_mib": rss, "growth_100_to_end_pct": growth,
            **outcome}


def render(res: dict[str, Any]) -> str:
    lines = ["# Concurrent clients over `clover-cpp serve -np N` (`bench/bench_parallel.py`)", "",
             f"Machine: {res['machine']}. One server per model with -np = the most clients; each client streams "
             f"{res['tokens']} tokens (greedy, ignore_eos); aggregate tok/s = all tokens / (last - first token).",
             ""]
    for m in res["speed"]:
        b = m["bound"]
        lines += [f"## {m['model']}", "",
                  "A causal pass of w rows (median ms): " + ", ".join(f"w = {w}: {v:.2f}" for w, v in
                                                                       b["pass_ms"].items()) + ".", "",
                  "| mode | clients | tok/s | speed-up vs 1 | bound | share of bound | tokens per decode call |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for mode in dict.fromkeys(r["mode"] for r in m["runs"]):
            runs = [r for r in m["runs"] if r["mode"] == mode]
            one = next(r["tok_s"] for r in runs if r["clients"] == 1)
            for r in runs:
                up = r["tok_s"] / one
                bnd = b["speedup_bound"][str(r["clients"])]  # keys are strings after the JSON round trip
                share = (up - 1) / (bnd - 1) * 100 if bnd > 1.0001 else float("nan")
                lines.append(f"| {mode} | {r['clients']} | {r['tok_s']:.1f} | {up:.2f}x | {bnd:.2f}x | "
                             f"{share:.0f} % | {r['tokens_per_decode']:.2f} |")
        lines.append("")
    lines += ["The bound counts the decode only. Each token also costs the server its own work (sampling, "
              "detokenizing, the SSE event) and the client its own; concurrent clients overlap that work with "
              "other slots' decoding, so where it dominates (the demo model, whose one-row pass takes well under "
              "1 ms) the speed-up can exceed the pass bound. Tokens per decode call: the generated tokens over "
              "llama-server's `llamacpp:n_decode_total` in the run (prompt calls included); that counter leaves "
              "out speculative verification calls, so in auto the column overstates how many tokens a call "
              "carries.", ""]
    if res.get("memory"):
        mem = res["memory"]
        lines += ["## Memory over mixed requests (demo model, -np 4, 4 clients)", "",
                  f"{mem['requests']} requests (ar/auto/spec/diffusion, streamed or not, every 7th stream "
                  f"cancelled after 4 tokens): completed {mem['completed']}, cancelled {mem['cancelled']}, "
                  f"failed {mem['failed']}.", "", "| after request | RSS MiB |", "|---:|---:|"]
        lines += [f"| {k} | {v:.1f} |" for k, v in mem["rss_mib"].items()]
        lines += ["", f"Growth from request 100 to the end: {mem['growth_100_to_end_pct']:.2f} %.", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mid-Q8_0,demo")
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--modes", default="ar,auto")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rss-requests", type=int, default=300, help="0 = skip the memory run")
    ap.add_argument("--workdir", type=Path, default=REPO / "build" / "bench-parallel")
    ap.add_argument("--name", default="bench_parallel")
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    clients = [int(c) for c in args.clients.split(",")]
    modes = args.modes.split(",")
    res: dict[str, Any] = {"tokens": args.tokens, "speed": []}
    for name in args.models.split(","):
        res["speed"].append(speed(name, model_path(name, args.workdir), clients, modes, args.tokens, args.workdir))
    if args.rss_requests:
        log("memory run")
        res["memory"] = memory(model_path("demo", args.workdir), args.rss_requests, args.workdir)
    from clover_native import loader

    res["machine"] = loader.machine_summary()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(res, indent=1, default=str))
    (RESULTS / f"{args.name}.md").write_text(render(json.loads(json.dumps(res, default=str))))
    log(f"wrote bench/results/{args.name}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
