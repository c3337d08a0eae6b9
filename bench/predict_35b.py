#!/usr/bin/env python3
"""A prediction, not a measurement: decode speed of the full Clover-35B-A3B (Q4_K_M) per mode.

    .venv/bin/python -m bench.predict_35b [--workdir build/bench-35b] [--keep]

Inputs, both measured here:
1. **Pass cost against width on real-dims layers.** A random `35b-shape --layers 4` checkpoint (3 Gated
   DeltaNet layers and 1 attention layer, the real interval), converted and quantized to Q4_K_M, runs causal
   passes of w rows (all rows asked; a run of same-width passes, so graphs are reused, each followed by a
   rollback) and block passes of w rows over 64 tokens of history, engine default threads, once with every
   row's logits asked and once with none (which skips the output head). The 40-layer model is predicted as
   head(w) + 10 L4_none(w), head(w) = L4_all(w) - L4_none(w). This takes a GDN and an attention layer to cost the
   same: both carry the same MoE block, which dominates at this context length. The embedding lookup and
   the final norm are counted 10 times (small). (Slices of fewer than 4 layers have no attention layer, and llama.cpp's
   hybrid memory aborts on a KV cache without layers: GGML_ASSERT(buffer) in set_input_k_idxs.)
2. **What the decoding modes achieve on the trained demo model** (bench/results/bench_speed.json and a run
   here): tokens per pass of auto's chains at each width, spec's tokens per round, diffusion's TPF.
   Routing in the random checkpoints is near-uniform, so the union of experts that w rows touch is at
   its largest: an upper bound on the cost of wide passes.

GPU rows: bandwidth-bound estimates from the bytes a pass reads (the Q4_K_M tensors of the 40 layers; routed
experts scaled by the expected union of 8-of-256 choices over w rows) at an assumed fraction of peak
bandwidth, plus an assumed fixed cost per pass. The assumptions are printed with the table.

Results: bench/results/predict_35b.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
WIDTHS = (1, 2, 3, 4, 6, 8)
BLOCK_WIDTHS = (4, 8, 16, 32)
GPUS = {"RTX 4090 (1008 GB/s)": 1008e9, "H200 (4800 GB/s)": 4800e9}
GPU_EFFICIENCY = 0.30       # share of peak bandwidth reached at batch 1 (llama.cpp: 25-33 % on GPUs)
GPU_PASS_FIXED_MS = 1.0     # launches and synchronisation per pass of 40 layers (assumed)
N_EXPERTS, TOP_K, LAYERS = 256, 8, 40


def log(msg: str) -> None:
    print(f"[predict_35b {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def slice_gguf(work: Path, layers: int) -> Path:
    """A Q4_K_M GGUF of a random 35b-shape checkpoint with `layers` layers (the bf16 files are removed)."""
    from clover_ref.factory import init_checkpoint_streaming
    from clover_dev.convert import clover_convert, quantize

    out = work / f"35b-{layers}L-Q4_K_M.gguf"
    if out.exists():
        return out
    ckpt, bf16 = work / f"35b-{layers}L", work / f"35b-{layers}L-bf16.gguf"
    log(f"{layers}-layer checkpoint")
    init_checkpoint_streaming(ckpt, "35b-shape", seed=0, layers=layers, max_shard_bytes=4 * 10**9)
    clover_convert(ckpt, bf16, "bf16")
    shutil.rmtree(ckpt)
    log(f"{layers}-layer Q4_K_M")
    quantize(bf16, out, "Q4_K_M")
    bf16.unlink()
    return out


def pass_costs(path: Path, reps: int = 5) -> dict[str, Any]:
    """ms per causal pass of w rows (all / one row asked) and per block pass of w rows; the minimum of the
    repetitions (noise on a shared machine only adds time)."""
    from clover_native import bindings

    model = bindings.LlamaModel(path)
    ctx = bindings.Context(model, n_ctx=512, n_ubatch=64, n_rs_seq=max(WIDTHS))
    history = [int(t) % 3000 + 1 for t in range(64)]
    ctx.causal(history)
    mask = model.mask_token()
    out: dict[str, Any] = {"causal_all": {}, "causal_none": {}, "block_all": {}, "block_none": {}}
    try:
        for w in WIDTHS:
            for key, rows in (("causal_all", list(range(w))), ("causal_none", [])):
                times = []
                for i in range(reps + 1):
                    t0 = time.perf_counter()
                    ctx.causal(history[:w], rows=rows)
                    times.append((time.perf_counter() - t0) * 1e3)
                    ctx.rollback(64)
                out[key][w] = min(times[1:])  # the first pass builds the graph
        for w in BLOCK_WIDTHS:
            for key, rows in (("block_all", list(range(w))), ("block_none", [])):
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    ctx.block([history[-1]] + [mask] * (w - 1), rows=rows)
                    times.append((time.perf_counter() - t0) * 1e3)
                out[key][w] = min(times)
    finally:
        ctx.close()
        model.close()
    return out


def chain_tokens_per_pass(prompts: int = 24) -> dict[int, float]:
    """Tokens per pass of auto's chains at fixed widths on the demo model: its greedy continuations of
    held-out code, replayed against the n-gram drafts auto would verify (padded drafts included)."""
    import tempfile

    from bench.bench_speed import held_out_prompts
    from clover_cpp import Model
    from clover_dev.convert import clover_convert

    with tempfile.TemporaryDirectory() as tmp:
        gguf = clover_convert(REPO / "models" / "clover-demo", Path(tmp) / "demo.gguf", "f16")
        with Model(gguf) as m:
            runs = []
            for p in held_out_prompts(prompts):
                m.reset()
                runs.append((p, m.run(p, mode="ar", max_tokens=64, stop_ids=[]).tokens))

    def draft(hist: list[int], k: int) -> list[int]:
        out: list[int] = []
        seq = list(hist)
        while len(out) < k:
            for n in (3, 2, 1):
                key = seq[-n:]
                hit = next((i for i in range(len(seq) - n - 1, -1, -1) if seq[i:i + n] == key), None)
                if hit is not None:
                    more = seq[hit + n: hit + n + k - len(out)]
                    break
            else:
                more = []
            if not more:
                break
            out += more
            seq += more
        return out

    result = {}
    for w in (2, 3, 4, 6, 8):
        tokens = passes = 0
        for prompt, out in runs:
            hist, i = list(prompt), 0
            while i < len(out):
                d = draft(hist, w - 1)
                c = next((k for k, (x, y) in enumerate(zip(d, out[i:])) if x != y), min(len(d), len(out) - i))
                step = min(c + 1, w, len(out) - i)
                hist += out[i:i + step]
                i += step
                tokens += step
                passes += 1
        result[w] = tokens / passes
    return result


def tensor_bytes(path: Path) -> dict[str, float]:
    """Per-layer bytes of the routed experts and of everything else, and the output head's bytes."""
    from gguf import GGUFReader

    experts = other = head = 0.0
    layers = set()
    for t in GGUFReader(path).tensors:
        if t.name.startswith("blk."):
            layers.add(int(t.name.split(".")[1]))
            if "_exps" in t.name:
                experts += t.n_bytes
            else:
                other += t.n_bytes
        elif t.name == "output.weight":
            head += t.n_bytes
    n = len(layers)
    return {"experts_per_layer": experts / n, "other_per_layer": other / n, "head": head}


def union(w: int) -> float:
    """Expected distinct experts of 8-of-256 routing over w rows (uniform routing)."""
    return N_EXPERTS * (1 - (1 - TOP_K / N_EXPERTS) ** w)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=REPO / "build" / "bench-35b")
    ap.add_argument("--keep", action="store_true", help="keep the Q4_K_M slices")
    args = ap.parse_args()
    import os

    os.environ.setdefault("CLOVER_NATIVE_QUIET", "1")
    from clover_native import libclover, loader

    args.workdir.mkdir(parents=True, exist_ok=True)
    l4 = slice_gguf(args.workdir, 4)
    log("pass costs")
    c4 = pass_costs(l4)
    bytes_ = tensor_bytes(l4)
    def predict(kind: str, widths: tuple[int, ...]) -> dict[int, float]:
        """the output head (all rows asked against none) plus 10 times the 4 layers"""
        return {w: (c4[f"{kind}_all"][w] - c4[f"{kind}_none"][w]) + LAYERS / 4 * c4[f"{kind}_none"][w] for w in widths}

    causal40, block40 = predict("causal", WIDTHS), predict("block", BLOCK_WIDTHS)
    head = {w: c4["causal_all"][w] - c4["causal_none"][w] for w in WIDTHS}

    speed = json.loads((RESULTS / "bench_speed.json").read_text())["models"]["demo f16"]["rows"]

    def gpu_ms(w: int, bw: float) -> float:
        """A pass of w rows, causal or block: the same weights are read."""
        read = (LAYERS * (bytes_["other_per_layer"] + bytes_["experts_per_layer"] * union(w) / N_EXPERTS)
                + bytes_["head"])
        return read / (bw * GPU_EFFICIENCY) * 1e3 + GPU_PASS_FIXED_MS

    rows = []
    # ar: one row per pass
    rows.append({"mode": "ar", "tokens_per_pass": 1.0, "cpu_ms": causal40[1],
                 **{gpu: gpu_ms(1, bw) for gpu, bw in GPUS.items()}})
    # auto: chains of w-row verifications of n-gram drafts, yielding what they yield on the demo model
    for w, tpp in chain_tokens_per_pass().items():
        rows.append({"mode": f"auto, chain width {w}", "tokens_per_pass": tpp, "cpu_ms": causal40[w],
                     **{gpu: gpu_ms(w, bw) for gpu, bw in GPUS.items()}})
    for b in (4, 8):  # a round is a block pass and a verification of B rows; TPF counts both
        r = speed[f"spec B={b}"]
        rows.append({"mode": f"spec B={b}", "tokens_per_pass": r["tpf"], "cpu_ms": (block40[b] + causal40[b]) / 2,
                     **{gpu: gpu_ms(b, bw) for gpu, bw in GPUS.items()}})
    for b in (8, 16, 32):  # commits are counted in TPF; their cost is taken as a block pass's
        r = speed[f"diffusion B={b}"]
        rows.append({"mode": f"diffusion B={b}, tau 0.9", "tokens_per_pass": r["tpf"], "cpu_ms": block40[b],
                     **{gpu: gpu_ms(b, bw) for gpu, bw in GPUS.items()}})
    for r in rows:
        r["cpu_tok_s"] = r["tokens_per_pass"] / r["cpu_ms"] * 1e3
        for gpu in GPUS:
            r[f"{gpu} tok/s"] = r["tokens_per_pass"] / r[gpu] * 1e3
    res = {"cpu": loader.machine_summary(), "threads": int(libclover.lib().clover_default_n_threads()),
           "measured_4_layers": c4, "head_ms": head, "causal40_ms": causal40,
           "block40_ms": block40, "bytes": bytes_, "rows": rows,
           "assumptions": {"gpu_efficiency": GPU_EFFICIENCY, "gpu_pass_fixed_ms": GPU_PASS_FIXED_MS,
                           "routing": "uniform 8 of 256 (random weights)",
                           "layers": "40, each costing a quarter of the 4-layer slice (3 GDN + 1 attention)"}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "predict_35b.json").write_text(json.dumps(res, indent=1, default=str))
    lines = [f"**A prediction**, not a measurement, for Clover-35B-A3B at Q4_K_M (`bench/predict_35b.py`). CPU: "
             f"{res['cpu']}, {res['threads']} threads. 40-layer pass costs scaled from a 4-layer real-dims slice; "
             f"tokens per pass from the demo model (bench_speed, f16). GPU: bytes read per pass at "
             f"{GPU_EFFICIENCY:.0%} of peak bandwidth + {GPU_PASS_FIXED_MS} ms per pass (assumed).", "",
             "| mode | tokens per pass | CPU ms per pass | CPU tok/s | "
             + " | ".join(f"{g} tok/s" for g in GPUS) + " |",
             "|---|---:|---:|---:|" + "---:|" * len(GPUS)]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['tokens_per_pass']:.2f} | {r['cpu_ms']:.0f} | {r['cpu_tok_s']:.2f} | "
                     + " | ".join(f"{r[f'{g} tok/s']:.0f}" for g in GPUS) + " |")
    lines += ["", "40-layer causal pass, ms by rows: " + ", ".join(f"{w}: {v:.0f}" for w, v in causal40.items())
              + "; block pass: " + ", ".join(f"{w}: {v:.0f}" for w, v in block40.items())
              + "; output head by rows asked: " + ", ".join(f"{w}: {v:.0f}" for w, v in head.items()) + " ms."]
    (RESULTS / "predict_35b.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if not args.keep:
        l4.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
