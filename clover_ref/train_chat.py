"""Second training stage of the demo model: chat in the shipped template, thinking on and off, and tool calls.

It starts from a first-stage model (``clover_ref.train``, code only) and trains on the synthetic conversations of
``chat_data.py`` (training split), rendered with the shipped chat template (the Qwen3.5 family's), with the same
joint objective as the first stage: the causal loss and the block-diffusion loss, so the block modes keep working.
Each chat row holds whole conversations and is topped up with standard-library code; plain code rows and the
first stage's self-distillation windows keep the code continuation (and the block mode's TPF on it) where it was.

    python -m clover_ref.train_chat BASE_DIR OUT_DIR [--steps N] [--minutes M] [--seed S]

The model's config declares a context of ``--context`` tokens (32,768 by default: what agents' prompts need);
the trained sequences are ``--length`` tokens long (docs/training.md says what that means beyond them).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from clover_common.tokenizer import load_tokenizer, render_chat, special_token_ids, TOKENIZER_DIR
from .chat_data import examples
from .checkpoint import load_model
from .train import (DISTILL_BATCH, POOL_CONTINUATION, POOL_PROMPT, POOL_REFRESH, SelfGeneratedPool, block_loss,
                    corpus_files, encode_files, joint_loss, learning_rate, log_step, optimizer_step, pick_block_size,
                    sample_batch, save_stage)
from .windowed import CHUNK, causal_with_window_states

CONVERSATIONS = 24_000  # drawn once; 1,000 steps of 4 rows (about 2 conversations each) see each about once
CONTEXT = 32_768


ASSISTANT_TURN = re.compile(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", re.DOTALL)


def encode_conversations(n: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(token ids, answer mask) of ``n`` training conversations as rendered, each ending with <|im_end|> and a
    newline. The mask marks the assistant turns' tokens after their header, <|im_end|> included: what the model
    writes in a chat."""
    tokenizer = load_tokenizer(TOKENIZER_DIR)
    out = []
    for ex in tqdm(examples("train", n, seed), total=n, desc="render", file=sys.stderr):
        text = render_chat(ex.messages, tools=ex.tools, enable_thinking=ex.enable_thinking,
                           add_generation_prompt=False)
        encoding = tokenizer.encode(text)
        spans = [m.span(1) for m in ASSISTANT_TURN.finditer(text)]
        answer = [any(a <= start < b for a, b in spans) for start, _ in encoding.offsets]
        out.append((np.asarray(encoding.ids, dtype=np.int64), np.asarray(answer, dtype=bool)))
    return out


class ChatRows:
    """Rows of ``length`` tokens: whole conversations from a random start in the list, each followed by
    <|endoftext|>, then code from the corpus stream to the end of the row (no padding, no cut conversation); with
    each row, its answer mask (``encode_conversations``; False on the code)."""

    def __init__(self, conversations: list[tuple[np.ndarray, np.ndarray]], code: np.ndarray, length: int) -> None:
        self.conversations = [c for c in conversations if len(c[0]) + 1 <= length]
        self.code, self.length = code, length
        self.eot = special_token_ids()["<|endoftext|>"]

    def row(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        ids, answer, used = [], [], 0
        i = int(rng.integers(len(self.conversations)))
        while used + len(self.conversations[i][0]) + 1 <= self.length:
            conversation, mask = self.conversations[i]
            ids += [conversation, np.asarray([self.eot])]
            answer += [mask, np.zeros(1, dtype=bool)]
            used += len(conversation) + 1
            i = (i + 1) % len(self.conversations)
        start = int(rng.integers(len(self.code) - self.length))
        ids.append(self.code[start: start + self.length - used])
        answer.append(np.zeros(self.length - used, dtype=bool))
        return np.concatenate(ids), np.concatenate(answer)

    def batch(self, rows: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        ids, answer = zip(*(self.row(rng) for _ in range(rows)))
        return torch.as_tensor(np.stack(ids)), torch.as_tensor(np.stack(answer))


def chat_loss(model, ids: torch.Tensor, answer: torch.Tensor,
              rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(causal loss, causal loss of the answers' tokens alone, block loss) of chat rows: ``joint_loss`` plus the
    answers' share, so that what the model writes in a chat is not outweighed by the prompts it reads (the tool
    instructions alone are about 400 of a tool conversation's 500-850 tokens)."""
    logits, histories = causal_with_window_states(model, ids)
    flat, targets = logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
    causal = F.cross_entropy(flat, targets)
    picked = answer[:, 1:].reshape(-1)
    answers = F.cross_entropy(flat[picked], targets[picked])
    return causal, answers, block_loss(model, ids, histories, pick_block_size(ids.shape[1], CHUNK, rng), CHUNK, rng)


def train_chat(base: Path, out_dir: Path, steps: int, minutes: float, seed: int, chat_rows: int, code_rows: int,
               length: int, lr: float, context: int, answer_weight: float, warmup: int = 50) -> dict:
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    train_files, _ = corpus_files()
    code = encode_files(train_files, max_bytes=24 << 20)
    rows = ChatRows(encode_conversations(CONVERSATIONS, seed), code, length)
    model = load_model(base)
    model.config.max_position_embeddings = context
    model.requires_grad_(True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    out_dir.mkdir(parents=True, exist_ok=True)
    pool = SelfGeneratedPool(128, POOL_PROMPT, POOL_CONTINUATION)
    start = time.perf_counter()
    history = []
    with (out_dir / "train_chat_log.jsonl").open("w") as log, tqdm(total=steps, desc="train", file=sys.stderr) as bar:
        for step in range(steps):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, steps, lr, warmup=warmup)
            chat_causal, chat_answers, chat_block = chat_loss(model, *rows.batch(chat_rows, rng), rng)
            code_causal, code_block = joint_loss(model, sample_batch(code, code_rows, 128, rng), rng)
            if step % POOL_REFRESH == 0:
                pool.refresh(model, code, rng)
            self_block = pool.loss(model, DISTILL_BATCH // 2, rng)
            loss = chat_causal + answer_weight * chat_answers + chat_block + code_causal + code_block + self_block
            optimizer_step(model, optimizer, loss)
            elapsed = time.perf_counter() - start
            record = {"step": step, "seconds": round(elapsed, 1), "chat_causal_loss": round(chat_causal.item(), 4),
                      "chat_answer_loss": round(chat_answers.item(), 4),
                      "chat_block_loss": round(chat_block.item(), 4), "code_causal_loss": round(code_causal.item(), 4),
                      "code_block_loss": round(code_block.item(), 4), "self_block_loss": round(self_block.item(), 4),
                      "lr": optimizer.param_groups[0]["lr"]}
            history.append(record)
            log_step(log, bar, record, step == steps - 1, chat="chat_answer_loss", code="code_causal_loss")
            if elapsed > minutes * 60:
                break
    summary = {"base": str(base), "steps": len(history), "seconds": round(time.perf_counter() - start, 1),
               "seed": seed, "chat_rows": chat_rows, "code_rows": code_rows, "length": length, "peak_lr": lr,
               "answer_weight": answer_weight,
               "conversations": len(rows.conversations), "context": context, "final": history[-1]}
    return save_stage(model, out_dir, "train_chat_summary.json", summary)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base", type=Path, help="the first-stage model directory (models/clover-demo's first stage)")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--minutes", type=float, default=25.0, help="stop early once this much time has passed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chat-rows", type=int, default=4)
    parser.add_argument("--code-rows", type=int, default=4)
    parser.add_argument("--length", type=int, default=768)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--context", type=int, default=CONTEXT, help="the context the model's config declares")
    parser.add_argument("--answer-weight", type=float, default=1.0,
                        help="weight of the answers' own causal loss, on top of the whole rows' (0 turns it off)")
    args = parser.parse_args(argv)
    summary = train_chat(args.base, args.out_dir, args.steps, args.minutes, args.seed, args.chat_rows,
                         args.code_rows, args.length, args.lr, args.context, args.answer_weight)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
