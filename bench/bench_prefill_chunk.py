#!/usr/bin/env python3
"""A long prompt on one slot against the decoding of another (serve -np 2, --prefill-chunk). Not a unit test.

    .venv/bin/python -m bench.bench_prefill_chunk [--workdir build/bench-prefill] [--prompt-tokens 4000]
                                                  [--chunks 0,128,32] [--tokens 160]

The random-weight `mid` preset (real Qwen3.5-35B-A3B layer dims, 4 layers) at Q8_0, one engine with two slots,
slot 1 decoding in ar mode; its time per token is measured from the commits' arrival times. For each chunk size
(0 = the batch size, 512):
- **idle**: slot 1 decodes --tokens tokens alone; then slot 2 prefills a prompt of --prompt-tokens tokens alone
  (the chunk applies only while another slot generates, so this is the unchunked prefill);
- **busy**: slot 1 decodes for as long as slot 2 prefills the same prompt.
Slot 1's slowdown is its median and its mean time per token during the prefill (the prefill's span over the
tokens slot 1 committed in it) over its idle median; the TTFT cost is slot 2's
busy prefill time over its idle prefill time (the median of the rows' idle runs).

Results: bench/results/bench_prefill_chunk.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"


def log(msg: str) -> None:
    print(f"[bench_prefill_chunk {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def decode_times(slot: Any, prompt: list[int], tokens: int, started: threading.Event | None = None,
                 stop: threading.Event | None = None) -> list[tuple[float, float]]:
    """(when, ms since the previous commit) of slot 1's successive commits (ar: one token each), until ``tokens``
    or until ``stop`` is set."""
    stamps: list[float] = []

    def on_tokens(_block: list[int]) -> bool:
        stamps.append(time.perf_counter())
        if started is not None and len(stamps) == 2:
            started.set()
        return stop is None or not stop.is_set()

    slot.reset()
    slot.run(prompt, mode="ar", max_tokens=tokens, stop_ids=[], on_tokens=on_tokens)
    return [(b, 1e3 * (b - a)) for a, b in zip(stamps, stamps[1:])]


def prefill_ms(slot: Any, prompt: list[int]) -> float:
    slot.reset()
    return slot.run(prompt, mode="ar", max_tokens=1, stop_ids=[]).stats.prefill_ms


def one_chunk(path: Path, chunk: int, short: list[int], long: list[int], tokens: int, n_ctx: int) -> dict[str, Any]:
    from clover_cpp import Model

    with Model(path, n_ctx=n_ctx, n_parallel=2, prefill_chunk=chunk) as model:
        s1, s2 = model.slot(0), model.slot(1)
        idle = [ms for _, ms in decode_times(s1, short, tokens)]
        ttft_idle = prefill_ms(s2, long)
        started, stop = threading.Event(), threading.Event()
        busy: list[tuple[float, float]] = []
        # slot 1 decodes for as long as slot 2 prefills (its budget is its share of the context)
        worker = threading.Thread(target=lambda: busy.extend(decode_times(s1, short, n_ctx // 2 - len(short) - 8,
                                                                          started, stop)))
        worker.start()
        started.wait(60)
        t0 = time.perf_counter()
        ttft_busy = prefill_ms(s2, long)
        prefill_end = time.perf_counter()
        stop.set()
        worker.join()
        # slot 1's tokens that arrived while slot 2 was prefilling
        during = [ms for when, ms in busy if t0 < when <= prefill_end] or [ms for _, ms in busy]
    mean_ms = (prefill_end - t0) * 1e3 / max(1, len(during))  # the prefill's span over slot 1's tokens in it
    return {"chunk": chunk or 512, "idle_ms": statistics.median(idle), "busy_ms": statistics.median(during),
            "busy_mean_ms": mean_ms, "mean_slowdown": mean_ms / statistics.median(idle),
            "busy_max_ms": max(during), "slowdown": statistics.median(during) / statistics.median(idle),
            "ttft_idle_ms": ttft_idle, "ttft_busy_ms": ttft_busy}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=REPO / "build" / "bench-prefill")
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--chunks", default="0,128,32")
    ap.add_argument("--tokens", type=int, default=160)
    args = ap.parse_args()
    from clover_native import loader

    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    gguf = work / "mid-Q8_0.gguf"
    if not gguf.exists():  # torch (the reference) only to build the model once
        from clover_ref.factory import init_checkpoint
        from clover_dev.convert import clover_convert, quantize

        init_checkpoint(work / "mid-ckpt", "mid", seed=0)
        quantize(clover_convert(work / "mid-ckpt", work / "mid-f16.gguf", "f16"), gguf, "Q8_0")
    rng = np.random.default_rng(0)
    short = rng.integers(10, 3000, 32).tolist()
    long = rng.integers(10, 3000, args.prompt_tokens).tolist()
    n_ctx = 2 * (2 * args.prompt_tokens + 2 * args.tokens + 64)  # slot 1 may decode a token per prompt token
    rows = []
    for chunk in (int(c) for c in args.chunks.split(",")):
        log(f"chunk {chunk or 512}")
        rows.append(one_chunk(gguf, chunk, short, long, args.tokens, n_ctx))
    base = statistics.median(r["ttft_idle_ms"] for r in rows)  # the idle prefill is unchunked in every row
    for r in rows:
        r["ttft_cost"] = r["ttft_busy_ms"] / base
    res = {"date": time.strftime("%Y-%m-%d"), "cpu": loader.machine_summary(), "prompt_tokens": args.prompt_tokens,
           "tokens": args.tokens, "rows": rows}
    md = [f"A {args.prompt_tokens}-token prompt on slot 2 while slot 1 decodes (mid Q8_0, -np 2, ar; {res['date']}, "
          f"{res['cpu']}). Slowdown: slot 1's median and mean ms per token during the prefill over its idle median. "
          "TTFT cost: slot 2's prefill time with slot 1 decoding, over its idle (unchunked) prefill time. The default "
          "chunk is 128.", "",
          "| prefill chunk | slot 1 idle ms/token | during the prefill: median | mean | worst token | slowdown "
          "(median / mean) | prefill alone s | prefill with slot 1 s | TTFT cost |",
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        md.append(f"| {r['chunk']} | {r['idle_ms']:.1f} | {r['busy_ms']:.1f} | {r['busy_mean_ms']:.1f} | "
                  f"{r['busy_max_ms']:.0f} | {r['slowdown']:.2f}x / {r['mean_slowdown']:.2f}x | "
                  f"{r['ttft_idle_ms'] / 1e3:.1f} | {r['ttft_busy_ms'] / 1e3:.1f} | "
                  f"{r['ttft_cost']:.2f}x |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_prefill_chunk.json").write_text(json.dumps(res, indent=1) + "\n")
    (RESULTS / "bench_prefill_chunk.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
