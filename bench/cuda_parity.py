#!/usr/bin/env python3
"""The same GGUF on the GPU and on the CPU of one build: how far apart are the logits? (scripts/device_check.sh)

    python -m bench.cuda_parity GGUF --label LABEL --out DIR [--engine]

Run once per environment variant (NVIDIA_TF32_OVERRIDE, GGML_CUDA_DISABLE_TF32, GGML_CUDA_PDL, ... are read
once per process). The CPU logits are computed on the first call and cached in DIR. Cases follow
tests/native/test_native_clover.py: causal prompts of 1, 7, 64 and 300 tokens in one pass (n_ubatch 64), 24
single-token steps after a 64-token prefill, and for clover files block passes (masked windows of 4 and B
at positions 0, 37 and 300). ``--engine`` also compares greedy ar/spec/auto tokens of the engine.

Each call appends one JSON line to DIR/parity.jsonl: per case the max |diff| and the relative difference
max|diff| / max(1, max|cpu|) (the tests' scale), and a hash of the GPU logits to show that runs repeat.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

PROMPTS = (1, 7, 64, 300)
BLOCK_POSITIONS = (0, 37, 300)
ENGINE_PROMPTS = ("def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main(argv):\n",
                  "class Point:\n    def __init__(self, x, y):\n")


def cases(path: Path, n_gpu_layers: int, flash_attn: bool | None = None) -> dict[str, np.ndarray]:
    from clover_native import bindings

    model = bindings.LlamaModel(path, n_gpu_layers=n_gpu_layers)
    out: dict[str, np.ndarray] = {}
    try:
        vocab = model.n_vocab
        ids = np.random.default_rng(1234).integers(0, min(vocab, 3000), size=340).tolist()
        is_clover = model.meta("general.architecture") in ("clover_moe", "clover-moe", "clovermoe")
        # The CPU side must stay on the CPU: with op offload on (llama.cpp's default), a CUDA build runs every
        # ubatch of 32 tokens or more of host weights on the GPU, which made the first device run compare the
        # GPU with itself for the 64- and 300-token cases.
        ctx = bindings.Context(model, n_ctx=512, n_ubatch=64, flash_attn=flash_attn, op_offload=n_gpu_layers > 0)
        try:
            for n in PROMPTS:
                ctx.clear()
                out[f"prompt{n}"] = ctx.causal(ids[:n])
            ctx.clear()
            rows = [ctx.causal(ids[:64], rows=[63])]
            rows += [ctx.causal([t]) for t in ids[64:88]]
            out["token_by_token"] = np.concatenate(rows)
            if is_clover:
                mask = model.mask_token()
                b_max = int(model.meta(model.meta("general.architecture") + ".block_size"))
                for p in BLOCK_POSITIONS:
                    ctx.clear()
                    if p:
                        ctx.causal(ids[:p], rows=[p - 1])
                    for b in sorted({4, b_max}):
                        out[f"block/p{p}/B{b}"] = ctx.block([ids[p]] + [mask] * (b - 1))
        finally:
            ctx.close()
    finally:
        model.close()
    return out


def engine_tokens(path: Path, n_gpu_layers: int) -> dict[str, list[int]]:
    from clover_cpp import Model

    out: dict[str, list[int]] = {}
    with Model(str(path), n_ctx=1024, n_gpu_layers=n_gpu_layers) as m:
        for i, text in enumerate(ENGINE_PROMPTS):
            for mode in ("ar", "spec", "auto"):
                m.reset()
                out[f"{mode}/{i}"] = list(m.run(m.tokenize(text), mode=mode, max_tokens=64).tokens)
    return out


def compare(gpu: dict[str, np.ndarray], cpu: dict[str, np.ndarray]) -> dict[str, Any]:
    """Per case the native parity tests' metric (clover_dev.metrics.parity at 1e-3) and a hash of the GPU logits."""
    from clover_dev.metrics import parity

    return {k: parity(g, cpu[k], 1e-3) | {"sha256": hashlib.sha256(np.ascontiguousarray(g).tobytes()).hexdigest()[:16]}
            for k, g in gpu.items()}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--n-gpu-layers", type=int, default=99)
    ap.add_argument("--flash-attn", choices=["auto", "on", "off"], default="auto",
                    help="flash attention of the GPU run (the CPU reference run keeps llama.cpp's auto)")
    ap.add_argument("--engine", action="store_true", help="also greedy ar/spec/auto tokens of the engine")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cache = args.out / f"{args.gguf.stem}.cpu.npz"
    if not cache.exists():
        t0 = time.time()
        np.savez(cache, **cases(args.gguf, 0))
        print(f"{args.gguf.name}: CPU logits in {time.time() - t0:.1f} s", flush=True)
    cpu = dict(np.load(cache))
    fa = {"auto": None, "on": True, "off": False}[args.flash_attn]
    t0 = time.time()
    record: dict[str, Any] = {"gguf": args.gguf.name, "label": args.label,
                              "env": {k: v for k, v in os.environ.items() if k.startswith(("GGML_", "NVIDIA_TF32"))},
                              "flash_attn": args.flash_attn,
                              "cases": compare(cases(args.gguf, args.n_gpu_layers, fa), cpu)}
    if args.engine:
        tok_cache = args.out / f"{args.gguf.stem}.cpu-tokens.json"
        if not tok_cache.exists():
            tok_cache.write_text(json.dumps(engine_tokens(args.gguf, 0)))
        want = json.loads(tok_cache.read_text())
        got = engine_tokens(args.gguf, args.n_gpu_layers)
        record["engine"] = {k: first_divergence(got[k], want[k]) for k in want}
    record["seconds"] = round(time.time() - t0, 1)
    with open(args.out / "parity.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    worst = max(record["cases"].items(), key=lambda kv: kv[1]["rel"])
    summary = " ".join(f"{k}={v['rel']:.2g}" for k, v in record["cases"].items() if not k.startswith("block/p37"))
    print(f"{args.gguf.name} [{args.label}] worst {worst[0]} rel {worst[1]['rel']:.3g}; {summary}", flush=True)
    if args.engine:
        bad = {k: v for k, v in record["engine"].items() if v is not None}
        print(f"{args.gguf.name} [{args.label}] engine tokens: "
              + ("all equal to the CPU" if not bad else f"first divergence {bad}"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
