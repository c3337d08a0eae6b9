"""Helpers for the chat and server tests: the reference's answer to a conversation.

The expected answer is built without the native runtime: the chat template shipped in the checkpoint,
rendered by clover_common.tokenizer.render_chat, tokenized by the checkpoint's tokenizer.json, and decoded
greedily by clover_ref.decode on a fresh history (the mask token banned, the config's end-of-generation
ids as stops), then detokenized without special tokens and split by the output parser.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pexpect  # a test dependency (pyproject [test]): missing, the suite fails instead of skipping

from clover_cpp.output_parser import ParsedOutput, opens_reasoning, parse_output
from clover_common.tokenizer import load_tokenizer, render_chat
from clover_dev.process import cli_command

N_CTX = 4096


@dataclass
class Expected:
    prompt_text: str
    prompt_ids: list[int]
    tokens: list[int]
    text: str
    parsed: ParsedOutput
    stats: Any


class Reference:
    def __init__(self, checkpoint: Path, model: Any) -> None:
        self.model = model
        self.tokenizer = load_tokenizer(checkpoint)
        self.template = (checkpoint / "chat_template.jinja").read_text(encoding="utf-8")

    def render(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
               thinking: bool = True) -> str:
        return render_chat(messages, tools=tools, enable_thinking=thinking, template=self.template)

    def ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def greedy(self, prompt_ids: list[int], mode: str, max_tokens: int, block_size: int | None = None,
               threshold: float | None = None, stop_ids: list[int] | None = None) -> tuple[list[int], Any]:
        import torch

        from clover_ref.decode import generate

        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tiny matrices: threads only contend with the server on a small machine
        try:
            r = generate(self.model, prompt_ids, n_ctx=N_CTX, mode=mode, max_new_tokens=max_tokens,
                         block_size=block_size, threshold=threshold, stop_ids=stop_ids)
        finally:
            torch.set_num_threads(threads)
        return r.tokens, r.stats

    def chat(self, messages: Sequence[dict[str, Any]], mode: str, max_tokens: int, thinking: bool = True,
             tools: Sequence[dict[str, Any]] | None = None, parse_tools: bool = False,
             **opts: Any) -> Expected:
        text = self.render(messages, tools, thinking)
        ids = self.ids(text)
        tokens, stats = self.greedy(ids, mode, max_tokens, **opts)
        out = self.decode(tokens)
        return Expected(text, ids, tokens, out, parse_output(out, opens_reasoning(text), parse_tools), stats)

    def completion(self, prompt: str, mode: str, max_tokens: int, **opts: Any) -> Expected:
        ids = self.ids(prompt)
        tokens, stats = self.greedy(ids, mode, max_tokens, **opts)
        out = self.decode(tokens)
        return Expected(prompt, ids, tokens, out, parse_output(out, False, False), stats)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("CLOVER_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


class ChatProcess:
    """`clover-cpp chat` in a pseudo-terminal (pexpect), without color."""

    """A `clover-cpp chat` child on a pseudo-terminal; ``out`` accumulates what it printed (\\r\\n -> \\n)."""

    def __init__(self, gguf: Path, *args: str) -> None:
        cmd = cli_command("chat", "-m", str(gguf), "--color", "never", *args)
        env = child_env() | {"TERM": "dumb"}
        self.child = pexpect.spawn(cmd[0], cmd[1:], env=env, encoding="utf-8", codec_errors="replace",
                                   timeout=120, dimensions=(50, 250))
        self.prompt()

    def prompt(self) -> str:
        """Wait for the input prompt; returns what came before it."""
        self.child.expect("\n> ")
        return self.child.before.replace("\r\n", "\n")

    def send(self, line: str) -> str:
        self.child.sendline(line)
        return self.prompt()

    def close(self) -> int:
        self.child.sendeof()
        self.child.expect(pexpect.EOF)
        self.child.close()
        return self.child.exitstatus

    def kill(self) -> None:
        if self.child.isalive():
            self.child.terminate(force=True)
