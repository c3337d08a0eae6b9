"""Helpers for the chat and server tests: the reference's answer to a conversation.

The expected answer is built without the engine: the chat template shipped in the checkpoint, rendered by
clover_common.tokenizer.render_chat (Jinja configured as transformers' apply_chat_template), tokenized by the
checkpoint's tokenizer.json, and decoded greedily by clover_ref.decode on a fresh history (the mask token banned,
the config's end-of-generation ids as stops), then detokenized without special tokens and split into reasoning,
content and tool calls by llama-server's parser for the template (common/chat through libclover,
clover_cpp.chat_format), which also renders the prompt: the two renderings must agree.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pexpect  # a test dependency (pyproject [test]): missing, the suite fails instead of skipping

from clover_common.tokenizer import load_tokenizer, render_chat
from clover_dev.process import cli_command

N_CTX = 4096


def transformers_shape(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool-call arguments as objects, as transformers' templates take them (OpenAI sends JSON text, which
    common/chat turns into objects for templates that iterate them, such as the Qwen3.5 family's)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [{**c, "function": {**c["function"],
                                                         "arguments": json.loads(c["function"]["arguments"])}}
                                     if isinstance(c["function"].get("arguments"), str) else c
                                     for c in m["tool_calls"]]}
        out.append(m)
    return out


@dataclass
class Parsed:
    """An answer's parts as llama-server's message has them (reasoning None when there is none)."""

    reasoning: str | None
    content: str
    tool_calls: list[dict[str, Any]]


@dataclass
class Expected:
    prompt_text: str
    prompt_ids: list[int]
    tokens: list[int]
    text: str
    parsed: Parsed
    stats: Any


class Reference:
    def __init__(self, checkpoint: Path, model: Any) -> None:
        self.model = model
        self.tokenizer = load_tokenizer(checkpoint)
        self.template = (checkpoint / "chat_template.jinja").read_text(encoding="utf-8")
        self._common: Any = None  # common/chat's templates for the same text, made on first use

    def common_chat(self) -> Any:
        from clover_cpp.chat_format import ChatTemplates

        if self._common is None:
            self._common = ChatTemplates(None, self.template, "chat_template.jinja")
        return self._common

    def parse(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None, thinking: bool,
              prompt_text: str, out: str, parse_tools: bool) -> Parsed:
        """``out`` read by llama-server's parser for this rendering; common/chat's prompt must be ``prompt_text``."""
        from clover_cpp.chat_format import parse_answer

        rendered = self.common_chat().render(messages, tools=tools, enable_thinking=thinking)
        assert rendered.prompt == prompt_text, "common/chat and the reference render the conversation differently"
        answer = parse_answer(rendered, out, parse_tools=parse_tools)
        return Parsed(answer.reasoning or None, answer.content, answer.tool_calls)

    def render(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
               thinking: bool = True) -> str:
        return render_chat(transformers_shape(messages), tools=tools, enable_thinking=thinking, template=self.template)

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
        return Expected(text, ids, tokens, out, self.parse(messages, tools, thinking, text, out, parse_tools), stats)

    def completion(self, prompt: str, mode: str, max_tokens: int, **opts: Any) -> Expected:
        ids = self.ids(prompt)
        tokens, stats = self.greedy(ids, mode, max_tokens, **opts)
        out = self.decode(tokens)
        return Expected(prompt, ids, tokens, out, Parsed(None, out, []), stats)


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
