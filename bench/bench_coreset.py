"""The block expert coreset (spec v2 3.3): what each coreset_top_p does to the coreset's size, diffusion's TPF
and its tokens, the native block pass's time, and what router shapes do to the size at 35B scale.

    .venv/bin/python -m bench.bench_coreset [--model models/clover-demo] [--prompts 12] [--tokens 48]
        [--workdir build/bench-35b] [--no-slice]

1. On a trained model (the demo), greedy diffusion over held-out code at B = 8 and 32 for each top_p:
   the mean coreset size per MoE layer in its block passes, TPF (tokens per block or causal pass), and
   the share of output positions equal to top_p = 1's (whose coreset is every expert).
2. At the 35B's router shape (256 experts, top-8), the mean coreset size of W-row windows under two router
   models: *random* (each row's router logits i.i.d. N(0, 1), what a random-weight checkpoint such as the
   35b-shape slice gives, since its router inputs are RMS-normalised and its weights have std
   1/sqrt(hidden)) and *peaked* (logits = 3 g + N(0, 1), g one N(0, 1) vector per window: rows of one
   window prefer the same experts, as a trained router on one passage does). No weights are needed.

3. Native, side by side in one run: the demo model and a random `35b-shape --layers 4` slice (3 GDN layers, 1
   attention layer, 256 experts; bench/predict_35b.py's, cached in --workdir), both Q4_K_M. For each top_p: the
   block pass's milliseconds at W = 8 and 32 over a 64-token history (the minimum of 7 passes after one warm-up:
   noise on a shared machine only adds time), and on the demo, greedy native diffusion's TPF and its token
   agreement with top_p = 1 (B = 32, the engine's own pass counts). The slice's router is random, so its
   coreset sizes are those of the random router model of part 2.
Results: bench/results/bench_coreset.{md,json}.
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
REPO = Path(__file__).resolve().parent.parent
NATIVE_WIDTHS = (8, 32)


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


def block_pass_ms(path: Path, top_ps: tuple[float, ...], reps: int = 7) -> dict:
    """{top_p: {W: ms}}: the native block pass over a 64-token history, the minimum of ``reps`` after a warm-up."""
    import time

    from clover_native import bindings

    model = bindings.LlamaModel(path)
    ids = np.random.default_rng(0).integers(0, 3000, size=64 + max(NATIVE_WIDTHS)).tolist()
    out: dict = {}
    for top_p in top_ps:
        ctx = bindings.Context(model, n_ctx=256, n_ubatch=64)
        ctx.set_coreset_top_p(top_p)
        ctx.causal(ids[:64], rows=[63])
        out[str(top_p)] = {}
        for w in NATIVE_WIDTHS:
            window = ids[64: 64 + w]
            ctx.block(window)
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                ctx.block(window)
                times.append((time.perf_counter() - start) * 1e3)
            out[str(top_p)][str(w)] = min(times)
        print(f"{path.name} top_p={top_p}: block ms {out[str(top_p)]}", flush=True)
    return out


def native_diffusion(path: Path, prompts: list[list[int]], n_tokens: int) -> dict:
    """{top_p: {tpf, agreement_with_top_p_1}}: greedy native diffusion at B = 32 for each top_p."""
    from clover_cpp.model import Model

    out: dict = {}
    baseline: list[list[int]] = []
    with Model(path, n_ctx=512, n_threads=2) as model:
        for top_p in TOP_PS:
            tokens = passes = same = compared = 0
            outputs = []
            for i, prompt in enumerate(prompts):
                model.reset()
                r = model.run(prompt, mode="diffusion", block_size=32, max_tokens=n_tokens, coreset_top_p=top_p)
                outputs.append(r.tokens)
                tokens += r.stats.generated_tokens
                passes += r.stats.passes
                if baseline:
                    same += sum(x == y for x, y in zip(r.tokens, baseline[i]))
                    compared += max(len(r.tokens), len(baseline[i]))
            baseline = baseline or outputs
            out[str(top_p)] = {"tpf": tokens / max(passes, 1),
                               "agreement_with_top_p_1": same / compared if compared else 1.0}
            print(f"native demo top_p={top_p}: {out[str(top_p)]}", flush=True)
    return out


def native_figures(model_dir: Path, prompts: list[list[int]], n_tokens: int, workdir: Path,
                   with_slice: bool) -> dict:
    import subprocess
    import sys

    workdir.mkdir(parents=True, exist_ok=True)
    demo = workdir / "demo-Q4_K_M.gguf"
    done = subprocess.run([sys.executable, "-m", "clover_convert", str(model_dir), str(demo), "--outtype", "Q4_K_M"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr)
    files = {"demo Q4_K_M": demo}
    if with_slice:
        from bench.predict_35b import slice_gguf

        files["35b-shape 4-layer slice Q4_K_M"] = slice_gguf(workdir, 4)
    return {"block_ms": {name: block_pass_ms(path, TOP_PS) for name, path in files.items()},
            "demo_diffusion": native_diffusion(demo, prompts, n_tokens)}


def held_out_prompts(n_prompts: int) -> list[list[int]]:
    _, held = corpus_files()
    stream = encode_files(held, max_bytes=1 << 19)
    starts = np.linspace(0, len(stream) - 64, n_prompts).astype(int)
    return [stream[s: s + 32].tolist() for s in starts]


def write_markdown(figures: dict, path: Path) -> None:
    demo = figures["demo"]
    lines = ["# The block expert coreset (`bench/bench_coreset.py`)", "", "## Reference", "",
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
    native = figures.get("native")
    if native:
        names = list(native["block_ms"])
        lines += ["", "## Native (Q4_K_M, 2 threads; one run, side by side)", "",
                  "Block-pass milliseconds over a 64-token history (the minimum of 7):", "",
                  "| top_p | " + " | ".join(f"{n} W={w}" for n in names for w in NATIVE_WIDTHS) + " |",
                  "|---|" + "---:|" * (len(names) * len(NATIVE_WIDTHS))]
        for top_p in TOP_PS:
            lines.append(f"| {top_p} | " + " | ".join(f"{native['block_ms'][n][str(top_p)][str(w)]:.1f}"
                                                      for n in names for w in NATIVE_WIDTHS) + " |")
        lines += ["", f"Native greedy diffusion on the demo (B = 32, {figures['prompts']} prompts, "
                  f"{figures['tokens']} tokens):", "", "| top_p | TPF | tokens equal to top_p = 1 |", "|---|---:|---:|"]
        for top_p, r in native["demo_diffusion"].items():
            lines.append(f"| {top_p} | {r['tpf']:.2f} | {r['agreement_with_top_p_1']:.1%} |")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("models/clover-demo"))
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--workdir", type=Path, default=REPO / "build" / "bench-35b")
    parser.add_argument("--no-slice", action="store_true", help="leave out the 35b-shape slice")
    args = parser.parse_args()
    torch.set_num_threads(2)
    figures = {"prompts": args.prompts, "tokens": args.tokens,
               "demo": demo_figures(args.model, args.prompts, args.tokens), "router_models": router_model_figures(),
               "native": native_figures(args.model, held_out_prompts(args.prompts), args.tokens, args.workdir,
                                        not args.no_slice)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_coreset.json").write_text(json.dumps(figures, indent=2) + "\n")
    write_markdown(figures, RESULTS / "bench_coreset.md")
    print((RESULTS / "bench_coreset.md").read_text())


if __name__ == "__main__":
    main()
