"""Quality of a trained Clover on held-out standard-library code (the model card's figures; not a test).

    .venv/bin/python -m bench.eval_demo_model MODEL_DIR [--prompts 96] [--tokens 64]

Causal perplexity comes from the PyTorch reference; decoding figures from the native engine on an f32
GGUF converted from MODEL_DIR: for diffusion at tau 0.9 and 0.95 with B = 8, 16, 32, TPF (tokens per
decode-time pass, block and causal) and tokens per block pass, and how often the diffusion output equals
greedy ar output; for spec mode, the mean accepted length per round; and, at the default tau and B, how
diffusion's tokens at the trained block coreset (the GGUF's coreset_top_p) agree with coreset_top_p = 1
(per-row routing), position by position, with both runs' TPF.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from clover_convert.cli import main as convert_main
from clover_ref.batched import causal_with_history
from clover_ref.checkpoint import load_model
from clover_ref.train import corpus_files, encode_files


def perplexity(model_dir: Path, stream: np.ndarray, length: int = 128, sequences: int = 64) -> float:
    model = load_model(model_dir)
    starts = np.linspace(0, len(stream) - length - 1, sequences).astype(int)
    ids = torch.as_tensor(np.stack([stream[s: s + length] for s in starts]))
    with torch.no_grad():
        logits, _ = causal_with_history(model, ids, split=0)
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    return math.exp(nll.item())


def tpf_interval(per_prompt: list[tuple[int, int]], resamples: int = 2000) -> list[float]:
    """A 90 % bootstrap interval of TPF (tokens / passes, summed over prompts), resampling the prompts.
    Per-prompt TPF is heavy-tailed (a prompt that lands in a loop fills a block in one or two passes), so
    the figure moves a lot with the prompt sample; this says how much."""
    counts = np.asarray(per_prompt, dtype=np.float64)
    picks = np.random.default_rng(0).integers(0, len(counts), size=(resamples, len(counts)))
    tpf = counts[picks, 0].sum(axis=1) / counts[picks, 1].sum(axis=1)
    return [float(x) for x in np.percentile(tpf, [5, 95])]


def decode_figures(gguf: Path, prompts: list[list[int]], tokens: int) -> dict:
    import clover_cpp

    out: dict = {}
    with clover_cpp.Model(str(gguf), n_ctx=1024, n_threads=2, max_block_size=32) as model:
        def run(**options):
            model.reset()
            return model.run(list(prompt), max_tokens=tokens, **options)

        ar_outputs = []
        for prompt in prompts:
            ar_outputs.append(run(mode="ar").tokens)
        for tau in (0.9, 0.95):
            for b in (8, 16, 32):
                block_passes = equal = 0
                per_prompt = []  # (generated tokens, passes)
                for prompt, ar in zip(prompts, ar_outputs):
                    r = run(mode="diffusion", block_size=b, threshold=tau)
                    per_prompt.append((r.stats.generated_tokens, r.stats.passes))
                    block_passes += r.stats.block_passes
                    equal += int(r.tokens == ar)
                generated, passes = (sum(column) for column in zip(*per_prompt))
                out[f"diffusion tau={tau} B={b}"] = {
                    "tpf": generated / passes, "tpf_interval_90": tpf_interval(per_prompt),
                    "tpf_median_prompt": float(np.median([g / p for g, p in per_prompt])),
                    "tokens_per_block_pass": generated / block_passes,
                    "equals_ar": equal / len(prompts)}
        trained = model.info.coreset_top_p
        agree = total = 0
        counts = {trained: [0, 0], 1.0: [0, 0]}
        for prompt in prompts:
            outs = {}
            for top_p in counts:
                r = run(mode="diffusion", coreset_top_p=top_p)
                outs[top_p] = r.tokens
                counts[top_p][0] += r.stats.generated_tokens
                counts[top_p][1] += r.stats.passes
            agree += sum(a == b for a, b in zip(outs[trained], outs[1.0]))
            total += max(len(outs[trained]), len(outs[1.0]))
        out["coreset"] = {"trained_top_p": trained, "block_size": model.info.block_size,
                          "tpf_trained": counts[trained][0] / counts[trained][1],
                          "tpf_top_p_1": counts[1.0][0] / counts[1.0][1],
                          "token_agreement_with_top_p_1": agree / total}
        for b in (8, 16, 32):
            accepted = rounds = equal = 0
            for prompt, ar in zip(prompts, ar_outputs):
                r = run(mode="spec", block_size=b)
                hist = r.stats.accepted_lengths
                accepted += sum(m * n for m, n in enumerate(hist))
                rounds += sum(hist)
                equal += int(r.tokens == ar)
            out[f"spec B={b}"] = {"mean_accepted": accepted / rounds, "equals_ar": equal / len(prompts)}
    return out


@contextlib.contextmanager
def f32_gguf(model_dir: Path) -> Iterator[Path]:
    """``model_dir`` converted to an f32 GGUF in a temporary folder (the converter's output kept off stdout)."""
    with tempfile.TemporaryDirectory() as tmp:
        gguf = Path(tmp) / "model-f32.gguf"
        with contextlib.redirect_stdout(sys.stderr):  # keep stdout pure JSON
            convert_main([str(model_dir), str(gguf), "--outtype", "f32"])
        yield gguf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--prompt-tokens", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    _, held = corpus_files()
    stream = encode_files(held, max_bytes=1 << 20)
    starts = np.linspace(0, len(stream) - args.prompt_tokens - 1, args.prompts).astype(int)
    prompts = [stream[s: s + args.prompt_tokens].tolist() for s in starts]
    figures = {"held_out_tokens": int(len(stream)), "causal_perplexity": perplexity(args.model_dir, stream)}
    with f32_gguf(args.model_dir) as gguf:
        figures.update(decode_figures(gguf, prompts, args.tokens))
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
