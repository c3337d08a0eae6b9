#!/usr/bin/env python3
"""Does the GPU's arithmetic explain the CUDA parity gap? The reference, with and without emulated CUDA
rounding (clover_ref.precision), under the native parity tests' protocol. No GPU needed.

    .venv/bin/python -m bench.gpu_precision [--models tiny mid demo] [--presets ...] [--workdir build/gpu-precision]

For each model and arithmetic preset: the max |logit difference| against the exact reference of the
causal passes of tests/native/test_native_clover.py (prompts of 1, 7, 64 and 300 tokens in one pass with
n_ubatch 64, 24 single-token steps after a 64-token prefill) and of its block passes (positions 0, 1, 37
and 300; B = 1, 4, 8, 32; three canvases), next to the tolerance the tests use and the H200 figures of
bench/results/cuda_tests.md. Then the MoE routing near-ties of those prompts: the gap between the k-th
and (k+1)-th router probability per token and layer, and which top-k sets the emulated arithmetic flips.

With ``--native-cpu``: the same causal prompts on the CPU build (f32 GGUF), flash attention on and off,
with n_ubatch 1, 7, 64 and 300, against the exact reference.

Results: bench/results/gpu_precision.md and .json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
REF_TOL = 1e-3  # tests/native/test_native_clover.py
N_IDS = 340
PROMPTS = (1, 7, 64, 300)
BLOCK_POSITIONS = (0, 1, 37, 300)
BLOCK_SIZES = (1, 4, 8, 32)
CANVASES = ("masked", "partly", "filled")
# bench/results/cuda_tests.md (H200, 2026-11-29): max|diff| of the failing native parity tests
H200 = {
    "tiny": {"prompt7": 0.0661, "prompt64": 0.0582, "prompt300": 0.612, "token_by_token": 0.0101,
             "block_worst": 0.00396},
    "mid": {"prompt7": 0.0049, "prompt300": 0.242, "block_worst": 0.00531},
}


def load(name: str, workdir: Path) -> Any:
    from clover_ref.checkpoint import load_model
    from clover_ref.factory import init_checkpoint

    if name == "demo":
        return load_model(REPO / "models" / "clover-demo")
    path = workdir / name
    if not (path / "config.json").exists():
        init_checkpoint(path, name, seed=0)  # the test fixtures' checkpoints (tests/conftest.py)
    return load_model(path)


def test_ids(model: Any) -> list[int]:
    vocab = model.config.vocab_size
    return np.random.default_rng(1234).integers(0, min(vocab, 3000), size=N_IDS).tolist()


class RouterTrace:
    """Router probabilities of every MoE call, per layer, while attached."""

    def __init__(self, model: Any) -> None:
        self.calls: dict[int, list[torch.Tensor]] = {}
        self.handles = [layer.mlp.gate.register_forward_hook(self._hook(i))
                        for i, layer in enumerate(model.model.layers)]

    def _hook(self, layer: int):
        def hook(module: Any, inputs: Any, output: torch.Tensor) -> None:
            self.calls.setdefault(layer, []).append(output.detach().softmax(-1))
        return hook

    def probs(self) -> np.ndarray:
        """[layers, tokens, experts]."""
        return np.stack([torch.cat(self.calls[i]).numpy() for i in sorted(self.calls)])

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def causal_logits(model: Any, ids: list[int], n: int, trace: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    tracer = RouterTrace(model) if trace else None
    try:
        logits = model.forward_causal(ids[:n], model.new_history()).numpy()
        return logits, (tracer.probs() if tracer else None)
    finally:
        if tracer:
            tracer.close()


def token_by_token(model: Any, ids: list[int]) -> np.ndarray:
    h = model.new_history()
    rows = [model.forward_causal(ids[:64], h)[-1:]]
    for t in ids[64:88]:
        rows.append(model.forward_causal([t], h))
    return torch.cat(rows).numpy()


def block_logits(model: Any, ids: list[int], mask: int) -> dict[str, np.ndarray]:
    from clover_dev.native import block_window

    out = {}
    for p in BLOCK_POSITIONS:
        h = model.new_history()
        if p:
            model.forward_causal(ids[:p], h)
        for b in BLOCK_SIZES:
            for canvas in CANVASES:
                window = block_window(ids, p, b, canvas, mask)
                out[f"p{p}/B{b}/{canvas}"] = model.forward_block(window, h.clone()).numpy()
    return out


def diff(got: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    """The native parity tests' metric (clover_dev.metrics.parity), and how many tolerances the difference is."""
    from clover_dev.metrics import parity

    m = parity(got, ref, REF_TOL)
    return m | {"over_tol": m["max_abs_diff"] / m["tol"]}


def run_preset(model: Any, ids: list[int], mask: int, exact: dict[str, Any], quick: bool) -> dict[str, Any]:
    res: dict[str, Any] = {}
    long_n = 64 if quick else 300
    full, probs = causal_logits(model, ids, long_n, trace=True)
    for n in PROMPTS:
        if n > long_n:
            continue
        got = full[:n] if n in (64, 300) else causal_logits(model, ids, n)[0]  # 64 = the first ubatch of 300
        res[f"prompt{n}"] = diff(got, exact["causal"][:n])
    res["token_by_token"] = diff(token_by_token(model, ids), exact["tbt"])
    if not quick:
        blocks = block_logits(model, ids, mask)
        per = {k: diff(v, exact["blocks"][k]) for k, v in blocks.items()}
        worst = max(per, key=lambda k: per[k]["over_tol"])
        res["block_worst"] = per[worst] | {"case": worst}
        res["block_over_tol"] = sum(v["over_tol"] > 1 for v in per.values())
    res["_probs"] = probs
    return res


def near_ties(probs: np.ndarray, top_k: int) -> dict[str, Any]:
    s = np.sort(probs, axis=-1)[..., ::-1]
    margin = s[..., top_k - 1] - s[..., top_k]  # [layers, tokens]
    return {"min": float(margin.min()), "median": float(np.median(margin)),
            "below_1e-3": int((margin < 1e-3).sum()), "below_1e-4": int((margin < 1e-4).sum()),
            "cells": int(margin.size), "_margin": margin}


def flips(exact_probs: np.ndarray, probs: np.ndarray, top_k: int, margin: np.ndarray) -> dict[str, Any]:
    a = np.sort(np.argsort(-exact_probs, axis=-1)[..., :top_k], axis=-1)
    b = np.sort(np.argsort(-probs, axis=-1)[..., :top_k], axis=-1)
    changed = (a != b).any(-1)  # [layers, tokens]
    where = np.argwhere(changed)
    first = int(where[:, 1].min()) if len(where) else None
    return {"flipped": int(changed.sum()), "first_token": first,
            "max_margin_flipped": float(margin[changed].max()) if changed.any() else None}


def native_cpu(name: str, model: Any, ids: list[int], exact: np.ndarray, workdir: Path) -> dict[str, Any]:
    """Causal prompts on the CPU build, flash attention x n_ubatch, against the exact reference."""
    import subprocess

    from clover_native import bindings

    src = REPO / "models" / "clover-demo" if name == "demo" else workdir / name
    gguf = workdir / f"{name}-f32.gguf"
    if not gguf.exists():
        subprocess.run([sys.executable, "-m", "clover_convert", str(src), str(gguf), "--outtype", "f32"],
                       check=True, stdout=subprocess.DEVNULL)
    m = bindings.LlamaModel(gguf)
    out: dict[str, Any] = {}
    try:
        for fa in (True, False):
            for ub in (1, 7, 64, 300):
                ctx = bindings.Context(m, n_ctx=512, n_batch=512, n_ubatch=ub, flash_attn=fa)
                try:
                    row = {}
                    for n in PROMPTS:
                        ctx.clear()
                        row[f"prompt{n}"] = diff(ctx.causal(ids[:n]), exact[:n])
                    out[f"fa={'on' if fa else 'off'}/ubatch={ub}"] = row
                finally:
                    ctx.close()
                print(f"[{name}] native CPU fa={fa} ubatch={ub}: "
                      + " ".join(f"{k}={v['max_abs_diff']:.3g}" for k, v in row.items()), flush=True)
    finally:
        m.close()
    return out


def study(name: str, args: argparse.Namespace) -> dict[str, Any]:
    from clover_ref import precision

    model = load(name, args.workdir)
    ids = test_ids(model)
    mask = int(model.config.mask_token_id)
    top_k = int(model.config.num_experts_per_tok)
    t0 = time.time()
    exact: dict[str, Any] = {}
    exact["causal"], exact_probs = causal_logits(model, ids, 64 if args.quick else 300, trace=True)
    exact["tbt"] = token_by_token(model, ids)
    if not args.quick:
        exact["blocks"] = block_logits(model, ids, mask)
    ties = near_ties(exact_probs, top_k)
    out: dict[str, Any] = {"top_k": top_k, "experts": int(model.config.num_experts),
                           "near_ties": {k: v for k, v in ties.items() if not k.startswith("_")}, "presets": {}}
    print(f"[{name}] exact reference in {time.time() - t0:.0f} s; router top-{top_k} margin min "
          f"{ties['min']:.2e}, {ties['below_1e-3']}/{ties['cells']} below 1e-3", flush=True)
    for preset in args.presets:
        t0 = time.time()
        with precision.emulate(precision.PRESETS[preset]):
            res = run_preset(model, ids, mask, exact, args.quick)
        res["routing"] = flips(exact_probs, res.pop("_probs"), top_k, ties["_margin"])
        out["presets"][preset] = res
        line = " ".join(f"{k}={v['max_abs_diff']:.3g}" for k, v in res.items()
                        if isinstance(v, dict) and "max_abs_diff" in v)
        print(f"[{name}] {preset:15s} {line} flips={res['routing']['flipped']} ({time.time() - t0:.0f} s)", flush=True)
    if args.native_cpu and not args.quick:
        out["native_cpu"] = native_cpu(name, model, ids, exact["causal"], args.workdir)
    return out


def render(results: dict[str, Any], cmd: str) -> str:
    lines = ["# Emulated CUDA arithmetic against the exact reference (no GPU)", "",
             f"`{cmd}`. The reference rounds what ggml's CUDA backend rounds for F32 weights with flash attention",
             "compiled off (clover_ref/precision.py, rules read from the pinned tree), under the native parity tests'",
             "protocol (n_ubatch 64). Each cell: max|logit diff| against the exact reference; the tolerance of the",
             "tests is 1e-3 x max(1, max|ref|). The H200 row is the measured native-CUDA figure",
             "(bench/results/cuda_tests.md).", ""]
    cols = ["prompt1", "prompt7", "prompt64", "prompt300", "token_by_token", "block_worst"]
    for name, r in results.items():
        tol = r["presets"][next(iter(r["presets"]))]["prompt1"]["tol"]
        lines += [f"## {name} (top-{r['top_k']} of {r['experts']} experts; tolerance {tol:.3g})", "",
                  "| arithmetic | " + " | ".join(cols) + " | top-k sets flipped (first token) |",
                  "|---|" + "---:|" * (len(cols) + 1)]
        for preset, res in r["presets"].items():
            cells = [f"{res[c]['max_abs_diff']:.3g}" if c in res else "-" for c in cols]
            rt = res["routing"]
            lines.append(f"| {preset} | " + " | ".join(cells) + f" | {rt['flipped']} ({rt['first_token']}) |")
        if name in H200:
            cells = [f"{H200[name][c]:.3g}" if c in H200[name] else "pass" for c in cols]
            lines.append("| **H200 measured** | " + " | ".join(cells) + " | |")
        nt = r["near_ties"]
        lines += ["", f"Router near-ties over the 300-token prompt (exact reference): top-{r['top_k']} margin "
                  f"(k-th minus (k+1)-th probability) min {nt['min']:.2e}, median {nt['median']:.2e}; "
                  f"{nt['below_1e-3']} of {nt['cells']} (token, layer) cells below 1e-3, "
                  f"{nt['below_1e-4']} below 1e-4.",
                  ""]
        if "native_cpu" in r:
            lines += ["Native CPU build, f32 GGUF, causal prompts in one pass (max|diff| against the exact reference):",
                      "",
                      "| flash attention / n_ubatch | " + " | ".join(f"prompt{n}" for n in PROMPTS) + " |",
                      "|---|" + "---:|" * len(PROMPTS)]
            for k, row in r["native_cpu"].items():
                lines.append(f"| {k} | " + " | ".join(f"{row[f'prompt{n}']['max_abs_diff']:.3g}" for n in PROMPTS)
                             + " |")
            lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from clover_ref import precision

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "mid", "demo"])
    ap.add_argument("--presets", nargs="+", default=list(precision.PRESETS)[1:], choices=list(precision.PRESETS))
    ap.add_argument("--workdir", type=Path, default=REPO / "build" / "gpu-precision")
    ap.add_argument("--quick", action="store_true", help="prompts up to 64 tokens and no block passes")
    ap.add_argument("--native-cpu", action="store_true",
                    help="also the CPU build with flash attention on/off and n_ubatch 1, 7, 64, 300")
    ap.add_argument("--name", default="gpu_precision")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    args.workdir.mkdir(parents=True, exist_ok=True)
    results = {name: study(name, args) for name in args.models}
    cmd = "bench/gpu_precision.py " + " ".join(argv if argv is not None else sys.argv[1:])
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.md").write_text(render(results, cmd.strip()))
    (RESULTS / f"{args.name}.json").write_text(json.dumps(results, indent=1, default=float))
    print(f"wrote bench/results/{args.name}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
