"""Train a small Clover on Python standard-library sources: the shipped demo model.

Joint objective, as the spec's two modes: the causal next-token loss over every position, plus the
block-diffusion loss of a window [p, p+B) on top of the AR-computed history [0, p), with its inputs
c_{p+1} .. c_{p+B-1} masked at a random ratio. The block loss counts the targets whose input was masked
and the last target p+B (never an input).

    python -m clover_ref.train OUT_DIR [--steps N] [--minutes M] [--seed S]

Corpus: the .py files of the running CPython's standard library (Python Software Foundation License),
in sorted order; every 50th file is held out for evaluation.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import time
import zlib
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from .batched import block_logits, causal_with_history
from .checkpoint import save_model
from .config import CloverConfig
from .factory import random_model
from .tokenizer import MASK_TOKEN, copy_tokenizer, load_tokenizer, special_token_ids, TOKENIZER_DIR

DEMO_MODEL = dict(
    hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128,
    vocab_size=3072, max_position_embeddings=4096, block_size=8, confidence_threshold=0.9,
    calibrated_block_sizes=[8, 16, 32], calibrated_thresholds=[0.9, 0.9, 0.9],
    rope_parameters={"rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1]},
    rms_norm_eps=1e-6,
)
TRAIN_BLOCK_SIZES = (4, 8, 16, 32)
HELD_OUT_EVERY = 50


def corpus_files() -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) of the standard library, excluding site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    held = [p for i, p in enumerate(files) if i % HELD_OUT_EVERY == 0]
    train = [p for i, p in enumerate(files) if i % HELD_OUT_EVERY != 0]
    return train, held


def encode_files(files: list[Path], max_bytes: int) -> np.ndarray:
    """Token ids of the files' text, separated by <|endoftext|>, up to about max_bytes of source."""
    tokenizer = load_tokenizer(TOKENIZER_DIR)
    eot = special_token_ids()["<|endoftext|>"]
    ids: list[int] = []
    used = 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if used + len(text) > max_bytes:
            break
        ids.extend(tokenizer.encode(text).ids)
        ids.append(eot)
        used += len(text)
    return np.asarray(ids, dtype=np.int64)


def demo_config() -> CloverConfig:
    ids = special_token_ids()
    return CloverConfig(**DEMO_MODEL, mask_token_id=ids[MASK_TOKEN],
                        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]], pad_token_id=ids["<|endoftext|>"])


def sample_batch(stream: np.ndarray, batch: int, length: int, rng: np.random.Generator) -> torch.Tensor:
    starts = rng.integers(0, len(stream) - length, size=batch)
    return torch.as_tensor(np.stack([stream[s: s + length] for s in starts]))


def joint_loss(model, ids: torch.Tensor, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(causal loss, block-diffusion loss) for a batch of sequences [N, T]."""
    n, t = ids.shape
    b = int(rng.choice(TRAIN_BLOCK_SIZES))
    p = int(rng.integers(1, t - b))  # seed position; targets p+1 .. p+b
    logits, histories = causal_with_history(model, ids, split=p)
    causal = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    ratio = torch.as_tensor(rng.uniform(0.05, 1.0, size=(n, 1)), dtype=torch.float32)
    masked = torch.rand(n, b - 1, generator=torch.Generator().manual_seed(int(rng.integers(1 << 31)))) < ratio
    window = ids[:, p: p + b].clone()
    window[:, 1:][masked] = model.config.mask_token_id
    targets = ids[:, p + 1: p + b + 1]
    counted = torch.cat((masked, torch.ones(n, 1, dtype=torch.bool)), dim=1)  # the last target is never an input
    block = block_logits(model, window, histories)
    diffusion = F.cross_entropy(block[counted], targets[counted])
    return causal, diffusion


def learning_rate(step: int, total: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(out_dir: Path, steps: int, minutes: float, seed: int, batch: int, length: int, lr: float) -> dict:
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    train_files, held_files = corpus_files()
    stream = encode_files(train_files, max_bytes=24 << 20)
    config = demo_config()
    model = random_model(config, seed)
    # Start from small embeddings and a tied-scale head, as trained LMs do; random_model's scales are
    # meant for parity tests, not for training.
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(0.05)
        model.lm_head.weight.mul_(0.5)
    model.requires_grad_(True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "train_log.jsonl"
    start = time.perf_counter()
    history = []
    with log_path.open("w") as log, tqdm(total=steps, desc="train", file=sys.stderr) as bar:
        for step in range(steps):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, steps, lr)
            ids = sample_batch(stream, batch, length, rng)
            causal, diffusion = joint_loss(model, ids, rng)
            loss = causal + diffusion
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            elapsed = time.perf_counter() - start
            record = {"step": step, "seconds": round(elapsed, 1), "causal_loss": round(causal.item(), 4),
                      "block_loss": round(diffusion.item(), 4), "lr": optimizer.param_groups[0]["lr"]}
            history.append(record)
            if step % 25 == 0 or step == steps - 1:
                log.write(json.dumps(record) + "\n")
                log.flush()
                bar.set_postfix(causal=record["causal_loss"], block=record["block_loss"])
            bar.update()
            if elapsed > minutes * 60:
                break
    model.requires_grad_(False)
    save_model(model, out_dir, dtype="bfloat16")
    copy_tokenizer(out_dir)
    summary = {"steps": len(history), "seconds": round(time.perf_counter() - start, 1), "seed": seed,
               "batch": batch, "length": length, "peak_lr": lr, "train_tokens": int(len(stream)),
               "held_out_files": len(held_files), "final": history[-1]}
    (out_dir / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--minutes", type=float, default=30.0, help="stop early once this much time has passed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)
    summary = train(args.out_dir, args.steps, args.minutes, args.seed, args.batch, args.length, args.lr)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
