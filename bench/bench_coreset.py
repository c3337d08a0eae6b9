"""The block expert coreset (spec v2 3.3) on the PyTorch reference: what each coreset_top_p does to the
coreset's size, diffusion's TPF and its tokens, and what router shapes do to the size at 35B scale.

    .venv/bin/python bench/bench_coreset.py [--model models/clover-demo] [--prompts 12] [--tokens 48]

1. On a trained model (the demo), greedy diffusion over held-out code at B = 8 and 32 for each top_p:
   the mean coreset size per MoE layer in its block passes, TPF (tokens per block or causal pass), and
   the share of output positions equal to top_p = 1's (whose coreset is every expert).
2. At the 35B's router shape (256 experts, top-8), the mean coreset size of W-row windows under two router
   models: *random* (each row's router logits i.i.d. N(0, 1), what a random-weight checkpoint such as the
   35b-shape slice gives, since its router inputs are RMS-normalised and its weights have std
   1/sqrt(hidden)) and *peaked* (logits = 3 g + N(0, 1), g one N(0, 1) vector per window: rows of one
   window prefer the same experts, as a trained router on one passage does). No weights are needed.

Not here yet: block-pass milliseconds at W = 8 and 32 and the 35b-shape slice at Q4_K_M need the coreset
in the native graph, which is not built yet. Results: bench/results/bench_coreset.{md,json}.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from clover_ref.checkpoint import load_model
from clover_ref.coreset import block_coreset
from clover_ref.decode import Session
from clover_ref.train import corpus_files, encode_files

TOP_PS = (1.0, 0.95, 0.9, 0.8)
BLOCKS = (8, 32)
RESULTS = Path(__file__).resolve().parent / "results"


class CoresetSizes:
    """Mean coreset size per MoE layer over the block passes run while attached."""

    def __init__(self, model, top_p: float) -> None:
        self.sizes: dict[int, list[int]] = {}
        self.handles = []
        for index, layer in enumerate(model.model.layers):
            def hook(module, inputs, _output, index=index) -> None:
                x, top_p = inputs
                if x.shape[0] > 1 or top_p < 1.0:
                    size = block_coreset(module.router_probs(x), top_p, module.top_k).size
                    self.sizes.setdefault(index, []).append(size)
            self.handles.append(layer.mlp.register_forward_hook(hook))

    def close(self) -> dict[int, float]:
        for h in self.handles:
            h.remove()
        return {layer: float(np.mean(v)) for layer, v in sorted(self.sizes.items())}


def demo_figures(model_dir: Path, n_prompts: int, n_tokens: int) -> dict:
    model = load_model(model_dir)
    _, held = corpus_files()
    stream = encode_files(held, max_bytes=1 << 19)
    starts = np.linspace(0, len(stream) - 64, n_prompts).astype(int)
    prompts = [stream[s: s + 32].tolist() for s in starts]
    out: dict = {"experts": model.config.num_experts, "top_k": model.config.num_experts_per_tok, "blocks": {}}
    for b in BLOCKS:
        rows: dict = {}
        baseline: list[list[int]] = []
        for top_p in TOP_PS:
            sizes = CoresetSizes(model, top_p)
            tokens = passes = same = compared = 0
            outputs = []
            for i, prompt in enumerate(prompts):
                with torch.no_grad():
                    res = Session(model, n_ctx=512).generate(prompt, mode="diffusion", block_size=b,
                                                             max_new_tokens=n_tokens, coreset_top_p=top_p)
                outputs.append(res.tokens)
                tokens += len(res.tokens)
                passes += res.stats.block_passes + res.stats.causal_passes
                if baseline:
                    n = min(len(res.tokens), len(baseline[i]))
                    same += sum(x == y for x, y in zip(res.tokens[:n], baseline[i][:n]))
                    compared += max(len(res.tokens), len(baseline[i]))
            if not baseline:
                baseline = outputs
            per_layer = sizes.close()
            rows[str(top_p)] = {"coreset_size_per_layer": per_layer,
                                "mean_coreset_size": float(np.mean(list(per_layer.values()))),
                                "tpf": tokens / max(passes, 1),
                                "agreement_with_top_p_1": same / compared if compared else 1.0}
            print(f"demo B={b} top_p={top_p}: {rows[str(top_p)]}", flush=True)
        out["blocks"][str(b)] = rows
    return out


def router_model_figures(n_expert: int = 256, top_k: int = 8, windows: int = 200) -> dict:
    gen = torch.Generator().manual_seed(0)
    out: dict = {}
    for name, shared in (("random", 0.0), ("peaked", 3.0)):
        for w in BLOCKS:
            for top_p in TOP_PS[1:]:
                sizes = []
                for _ in range(windows):
                    logits = shared * torch.randn(1, n_expert, generator=gen) + torch.randn(w, n_expert, generator=gen)
                    sizes.append(block_coreset(logits.softmax(-1), top_p, top_k).size)
                out[f"{name}/W{w}/{top_p}"] = float(np.mean(sizes))
    return out


def write_markdown(figures: dict, path: Path) -> None:
    demo = figures["demo"]
    lines = ["# The block expert coreset on the reference (`bench/bench_coreset.py`)", "",
             f"Demo model: {demo['experts']} experts, top-{demo['top_k']}; greedy diffusion, "
             f"{figures['prompts']} held-out prompts, {figures['tokens']} new tokens each.", "",
             "| B | top_p | mean coreset size (per layer) | TPF | tokens equal to top_p = 1 |",
             "|---|---|---|---:|---:|"]
    for b, rows in demo["blocks"].items():
        for top_p, r in rows.items():
            per_layer = ", ".join(f"{v:.2f}" for v in r["coreset_size_per_layer"].values())
            lines.append(f"| {b} | {top_p} | {r['mean_coreset_size']:.2f} ({per_layer}) | {r['tpf']:.2f} | "
                         f"{r['agreement_with_top_p_1']:.1%} |")
    lines += ["", "Router models at the 35B's shape (256 experts, top-8), mean coreset size of a W-row window:", "",
              "| router | W | top_p 0.95 | 0.9 | 0.8 |", "|---|---|---:|---:|---:|"]
    model = figures["router_models"]
    for name in ("random", "peaked"):
        for w in BLOCKS:
            lines.append(f"| {name} | {w} | " + " | ".join(f"{model[f'{name}/W{w}/{p}']:.1f}" for p in TOP_PS[1:])
                         + " |")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("models/clover-demo"))
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    torch.set_num_threads(2)
    figures = {"prompts": args.prompts, "tokens": args.tokens,
               "demo": demo_figures(args.model, args.prompts, args.tokens), "router_models": router_model_figures()}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_coreset.json").write_text(json.dumps(figures, indent=2) + "\n")
    write_markdown(figures, RESULTS / "bench_coreset.md")
    print((RESULTS / "bench_coreset.md").read_text())


if __name__ == "__main__":
    main()
