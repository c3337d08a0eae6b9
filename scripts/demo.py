"""`make demo`: continue a code prompt with the native engine in several modes and print a stats table, then hold a
short chat exchange in which the model calls a tool, reads its result and answers.

    .venv/bin/python scripts/demo.py MODEL.gguf [--prompt TEXT] [-n N]

The chat goes through llama.cpp's common/chat, as `clover-cpp serve` and `clover-cpp chat` do: the GGUF's template
renders the conversation, and the answer is parsed into content and tool calls. The tool is a stand-in that reads
from a two-file project held in memory.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import clover_cpp
from clover_cpp.chat_format import ChatTemplates, parse_answer

DEFAULT_PROMPT = "def fibonacci(n):\n"
MODES = ("ar", "auto", "diffusion", "spec")
PROJECT = {"src/app.py": "def load_config():\n    return 42", "src/util.py": "def clamp(x):\n    return x"}
READ_FILE = {"type": "function", "function": {
    "name": "read_file", "description": "Read a text file and return its contents.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
REQUEST = "Use read_file to show me src/app.py."


def modes_table(model: clover_cpp.Model, prompt: str, max_tokens: int) -> None:
    """The prompt continued in each mode, then a table of their stats."""
    rows = []
    for mode in MODES:
        model.reset()
        result = model.run(prompt, mode=mode, max_tokens=max_tokens)
        s = result.stats
        print(f"--- {mode} (B={s.block_size}, threshold={s.threshold:.2f}) ---")
        print(prompt + model.detokenize(result.tokens))
        rows.append((mode, s.generated_tokens, s.decode_tok_s, s.tokens_per_pass, s.block_passes, s.causal_passes))
    print(f"({model.n_threads} threads: the physical cores this process may use)")
    print("| mode | tokens | decode tok/s | TPF | block passes | causal passes |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode, tokens, tok_s, tpf, blocks, causal in rows:
        print(f"| {mode} | {tokens} | {tok_s:.1f} | {tpf:.2f} | {blocks} | {causal} |")


def read_file(path: str) -> str:
    return PROJECT.get(path, f"error: no file {path}")


def chat_with_a_tool(model: clover_cpp.Model, max_tokens: int) -> None:
    """One user request, the model's tool call, the tool's result and the model's answer (auto, greedy, no
    thinking), each turn rendered and parsed by common/chat."""
    templates = ChatTemplates(model.llama_model, None, "the GGUF's tokenizer.chat_template")
    messages: list[dict[str, Any]] = [{"role": "user", "content": REQUEST}]
    print("--- chat: a tool call (auto, greedy, thinking off) ---")
    print(f"user: {REQUEST}")
    try:
        for _ in range(3):  # the model may call the tool, then must answer
            rendered = templates.render(messages, tools=[READ_FILE], enable_thinking=False)
            model.reset()
            result = model.run(rendered.prompt, mode="auto", max_tokens=max_tokens)
            answer = parse_answer(rendered, model.detokenize(result.tokens, special=False))
            if not answer.tool_calls:
                print(f"assistant: {answer.content.strip()}")
                return
            call = answer.tool_calls[0]
            args = json.loads(call["function"]["arguments"] or "{}")
            output = read_file(str(args.get("path", ""))) if call["function"]["name"] == "read_file" else \
                f"error: no tool {call['function']['name']}"
            print(f"assistant calls {call['function']['name']}({json.dumps(args)})")
            print("tool: " + output.replace("\n", "\n      "))
            messages += [{"role": "assistant", "content": answer.content, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": call.get("id", ""), "content": output}]
        print("(no answer after three tool calls)")
    finally:
        templates.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("-n", "--max-tokens", type=int, default=96)
    args = parser.parse_args(argv)
    with clover_cpp.Model(str(args.model)) as model:  # the engine's default threads, as a user gets them
        modes_table(model, args.prompt, args.max_tokens)
        chat_with_a_tool(model, args.max_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
