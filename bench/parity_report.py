"""Print the reference's causal-mode distance to transformers as a Markdown table (not a test).

    .venv/bin/python -m bench.parity_report [--presets tiny mid] [--lengths 1 9 200]

The tests assert the bound; this script reports the measured numbers for the README.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from clover_dev.reference import load_transformers, prompt

from clover_ref.checkpoint import load_model
from clover_ref.factory import init_checkpoint


@torch.no_grad()
def measure(preset: str, lengths: list[int]) -> list[tuple[str, int, float, float, bool]]:
    with tempfile.TemporaryDirectory() as tmp:
        init_checkpoint(tmp, preset, seed=0)
        ours_model, hf = load_model(tmp), load_transformers(Path(tmp))
        ids = prompt(max(lengths), seed=1)
        ours = ours_model.forward_causal(ids, ours_model.new_history())
        rows = []
        for length in lengths:
            theirs = hf(ids[None, :length]).logits[0]
            diff = (ours[:length] - theirs).abs().max().item()
            top1 = torch.equal(ours[:length].argmax(-1), theirs.argmax(-1))
            rows.append((preset, length, diff, theirs.abs().max().item(), top1))
        return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--presets", nargs="+", default=["tiny", "mid"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[1, 9, 200])
    args = parser.parse_args()
    print("| preset | prompt tokens | max abs diff | max abs logit | relative | top-1 equal |")
    print("|---|---|---|---|---|---|")
    for preset in args.presets:
        for name, length, diff, scale, top1 in measure(preset, args.lengths):
            print(f"| {name} | {length} | {diff:.2e} | {scale:.2f} | {diff / max(1.0, scale):.2e} | {top1} |")


if __name__ == "__main__":
    main()
