"""Train a small Clover on Python standard-library sources: the shipped demo model.

Joint objective, as the spec's two modes: the causal next-token loss over every position, plus the
block-diffusion loss of windows [p, p+B) on top of the AR-computed history [0, p), their inputs
c_{p+1} .. c_{p+B-1} masked at a random ratio. The block loss counts the targets whose input was masked
and the last target p+B (never an input). Windows start at every multiple of max(8, B) of every
sequence, so the block loss sees about as many targets as the causal loss (``windowed.py`` computes
them in one batch).

From 25 % of the steps on, the block loss also runs over the model's own greedy continuations of
corpus prompts (self-distillation, ``SelfGeneratedPool``): block mode learns to emit in parallel what
causal mode would emit one token at a time. Half of those windows mask a suffix after a filled prefix,
the state LowConfidence decoding is in for half of its passes. The causal mode never trains on those
continuations.

    python -m clover_ref.train OUT_DIR [--steps N] [--minutes M] [--seed S] [--self-distill-from F]

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
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from .windowed import CHUNK, block_logits_at, causal_with_window_states, greedy_continue
from .checkpoint import save_model
from clover_common.config import CloverConfig
from .factory import random_model
from clover_common.tokenizer import MASK_TOKEN, copy_tokenizer, load_tokenizer, special_token_ids, TOKENIZER_DIR

# The block expert coreset the demo model trains its block loss with (spec 3.3), recorded in its config.json:
# 0.9 keeps about half of the 8 experts in a 32-row window (bench/results/bench_coreset.md).
DEMO_CORESET_TOP_P = 0.9
DEMO_MODEL = dict(
    hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128,
    vocab_size=3072, max_position_embeddings=4096, block_size=32, confidence_threshold=0.9,
    calibrated_block_sizes=[8, 16, 32], calibrated_thresholds=[0.9, 0.9, 0.9], coreset_top_p=DEMO_CORESET_TOP_P,
    rope_parameters={"rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1]},
    rms_norm_eps=1e-6,
)
TRAIN_BLOCK_SIZES = (4, 8, 16, 32)
# Self-distillation (see SelfGeneratedPool): from this fraction of the steps on, every step adds the block
# loss of DISTILL_BATCH pool sequences; the pool (POOL_SEQUENCES corpus prompts of POOL_PROMPT tokens, each
# continued greedily by POOL_CONTINUATION tokens) is regenerated every POOL_REFRESH steps.
SELF_DISTILL_FROM = 0.25
DISTILL_BATCH = 16
POOL_SEQUENCES = 128
POOL_PROMPT = 48
POOL_CONTINUATION = 80
POOL_REFRESH = 50
# Share of the pool's block windows masked as a filled prefix and a masked suffix (window_masks).
DISTILL_SUFFIX_SHARE = 0.5
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


def window_starts(length: int, block: int, first: int = CHUNK) -> list[int]:
    """Window starts p on the chunk grid from `first`, spaced by at least B, every target p+1 .. p+B in range."""
    stride = CHUNK * math.ceil(block / CHUNK)
    return list(range(first, length - block, stride))


def pick_block_size(length: int, first: int, rng: np.random.Generator) -> int:
    """A training block size B for this step, among those with at least one window in the sequence."""
    sizes = [b for b in TRAIN_BLOCK_SIZES if window_starts(length, b, first)]
    if not sizes:
        raise ValueError(f"sequences of {length} tokens leave no room for a block window after position {first}")
    return int(rng.choice(sizes))


def window_masks(windows: int, block: int, suffix_share: float, rng: np.random.Generator) -> torch.Tensor:
    """Which inputs c_{p+1} .. c_{p+B-1} of each window are masked [W, B-1], at a ratio drawn per window from
    U(0.05, 1). A window masks a random subset, or, with probability `suffix_share`, the same number of
    inputs as one run at the end: the filled-prefix, masked-suffix state LowConfidence decoding is in
    about half of its passes."""
    ratio = rng.uniform(0.05, 1.0, size=(windows, 1))
    scattered = rng.random((windows, block - 1)) < ratio
    kept = np.floor((1.0 - ratio) * (block - 1))
    suffix = np.arange(block - 1)[None, :] >= kept
    return torch.as_tensor(np.where(rng.random((windows, 1)) < suffix_share, suffix, scattered))


def block_loss(model, ids: torch.Tensor, histories, block: int, first: int, rng: np.random.Generator,
               suffix_share: float = 0.0) -> torch.Tensor:
    """Block-diffusion loss of a window of B at every start window_starts(T, B, first) of every sequence,
    each over its own AR history, inputs c_{p+1} .. c_{p+B-1} masked at a random ratio per window
    (``window_masks``). It counts the targets whose input was masked and the last target p+B (never an
    input)."""
    n, t = ids.shape
    starts_per_row = window_starts(t, block, first)
    rows = torch.arange(n, device=ids.device).repeat_interleave(len(starts_per_row))
    starts = torch.as_tensor(starts_per_row, device=ids.device).repeat(n)
    w = len(rows)
    offsets = starts[:, None] + torch.arange(block, device=ids.device)[None, :]
    window = ids[rows[:, None], offsets].clone()
    targets = ids[rows[:, None], offsets + 1]
    masked = window_masks(w, block, suffix_share, rng).to(ids.device)
    window[:, 1:][masked] = model.config.mask_token_id
    counted = torch.cat((masked, torch.ones(w, 1, dtype=torch.bool, device=ids.device)), dim=1)
    logits = block_logits_at(model, window, rows, starts, histories, model.config.coreset_top_p)
    return F.cross_entropy(logits[counted], targets[counted])


def joint_loss(model, ids: torch.Tensor, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(causal loss, block-diffusion loss) for a batch of corpus sequences [N, T]; the block loss covers
    about as many targets as the causal one."""
    logits, histories = causal_with_window_states(model, ids)
    causal = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    return causal, block_loss(model, ids, histories, pick_block_size(ids.shape[1], CHUNK, rng), CHUNK, rng)


class SelfGeneratedPool:
    """Corpus prompts continued by the model's own greedy causal decoding, refreshed as training goes.

    Block windows over these continuations teach block mode to produce in parallel what ``ar`` would
    produce one token at a time: the tokens LowConfidence decoding and spec drafts are judged against.
    """

    def __init__(self, sequences: int, prompt: int, continuation: int) -> None:
        self.sequences, self.prompt, self.continuation = sequences, prompt, continuation
        self.ids: torch.Tensor | None = None

    def refresh(self, model, stream: np.ndarray, rng: np.random.Generator) -> None:
        prompts = sample_batch(stream, self.sequences, self.prompt, rng)
        banned = [model.config.mask_token_id]
        self.ids = torch.cat((prompts, greedy_continue(model, prompts, self.continuation, banned)), dim=1)

    def loss(self, model, batch: int, rng: np.random.Generator) -> torch.Tensor:
        pick = torch.as_tensor(rng.choice(self.sequences, size=batch, replace=False))
        ids = self.ids[pick]
        with torch.no_grad():  # the causal mode keeps learning the corpus, not its own output
            _, histories = causal_with_window_states(model, ids)
        block = pick_block_size(ids.shape[1], self.prompt, rng)
        return block_loss(model, ids, histories, block, self.prompt, rng, suffix_share=DISTILL_SUFFIX_SHARE)


def optimizer_step(model, optimizer: torch.optim.Optimizer, loss: torch.Tensor) -> None:
    """One optimizer step on ``loss``, the gradient clipped to norm 1."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def log_step(log, bar: tqdm, record: dict, last: bool, **postfix: str) -> None:
    """Every 25th step's record (and the last's) to the log file; the progress bar shows the ``postfix`` keys
    (label=key) of it."""
    if record["step"] % 25 == 0 or last:
        log.write(json.dumps(record) + "\n")
        log.flush()
        bar.set_postfix(**{label: record[key] for label, key in postfix.items()})
    bar.update()


def save_stage(model, out_dir: Path, summary_file: str, summary: dict) -> dict:
    """The trained model (bf16) and the tokenizer in ``out_dir``, and the run's ``summary`` in ``summary_file``."""
    model.requires_grad_(False)
    save_model(model, out_dir, dtype="bfloat16")
    copy_tokenizer(out_dir)
    (out_dir / summary_file).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def learning_rate(step: int, total: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(out_dir: Path, steps: int, minutes: float, seed: int, batch: int, length: int, lr: float,
          self_distill_from: float = SELF_DISTILL_FROM) -> dict:
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
    pool = SelfGeneratedPool(POOL_SEQUENCES, POOL_PROMPT, POOL_CONTINUATION)
    distill_start = int(self_distill_from * steps) if self_distill_from < 1 else steps
    start = time.perf_counter()
    history = []
    with log_path.open("w") as log, tqdm(total=steps, desc="train", file=sys.stderr) as bar:
        for step in range(steps):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, steps, lr)
            ids = sample_batch(stream, batch, length, rng)
            causal, diffusion = joint_loss(model, ids, rng)
            loss = causal + diffusion
            self_block = None
            if step >= distill_start:
                if (step - distill_start) % POOL_REFRESH == 0:
                    pool.refresh(model, stream, rng)
                self_block = pool.loss(model, DISTILL_BATCH, rng)
                loss = loss + self_block
            optimizer_step(model, optimizer, loss)
            elapsed = time.perf_counter() - start
            record = {"step": step, "seconds": round(elapsed, 1), "causal_loss": round(causal.item(), 4),
                      "block_loss": round(diffusion.item(), 4), "lr": optimizer.param_groups[0]["lr"]}
            if self_block is not None:
                record["self_block_loss"] = round(self_block.item(), 4)
            history.append(record)
            log_step(log, bar, record, step == steps - 1, causal="causal_loss", block="block_loss")
            if elapsed > minutes * 60:
                break
    summary = {"steps": len(history), "seconds": round(time.perf_counter() - start, 1), "seed": seed,
               "batch": batch, "length": length, "peak_lr": lr, "train_tokens": int(len(stream)),
               "self_distill_from_step": distill_start,
               "held_out_files": len(held_files), "final": history[-1]}
    return save_stage(model, out_dir, "train_summary.json", summary)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--steps", type=int, default=2300)
    parser.add_argument("--minutes", type=float, default=30.0, help="stop early once this much time has passed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--lr", type=float, default=6e-3)
    parser.add_argument("--self-distill-from", type=float, default=SELF_DISTILL_FROM,
                        help="fraction of the steps after which block mode also trains on the model's own greedy "
                             "continuations (1 turns it off)")
    args = parser.parse_args(argv)
    summary = train(args.out_dir, args.steps, args.minutes, args.seed, args.batch, args.length, args.lr,
                    args.self_distill_from)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
