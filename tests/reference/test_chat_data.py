"""The demo model's second-stage chat data (clover_ref/chat_data.py): seeded, split, and in the format llama.cpp reads.

- The same seed gives the same conversations; the held-out split's values (functions asked about, paths, commands)
  never occur in the training split's conversations.
- Every tool conversation, rendered with the shipped template, is what common/chat (llama-server's parser) reads
  back as the intended call: the training data teaches the calls agents will receive.
"""

from __future__ import annotations

import json

import pytest

from clover_common.tokenizer import render_chat
from clover_ref.chat_data import examples, split_of

pytestmark = pytest.mark.native  # common/chat is in libclover


def test_examples_are_seeded() -> None:
    first = [(e.messages, e.tools, e.enable_thinking) for e in examples("train", 40, 3)]
    again = [(e.messages, e.tools, e.enable_thinking) for e in examples("train", 40, 3)]
    other = [(e.messages, e.tools, e.enable_thinking) for e in examples("train", 40, 4)]
    assert first == again and first != other


def test_held_out_values_never_train() -> None:
    held = list(examples("held-out", 300, 1))
    train_text = json.dumps([e.messages for e in examples("train", 3000, 0)])
    values = {v for e in held if e.expected_call for v in e.expected_call["arguments"].values()}
    asked = {e.messages[-2]["content"].split("`")[1] for e in held
             if e.kind == "question" and e.messages[-2]["content"].count("`") == 2}
    assert values and asked
    assert all(split_of(name) == "held-out" for name in asked)
    leaked = [v for v in values | asked if f"`{v}`" in train_text or f" {v}." in train_text]
    assert leaked == [], leaked[:5]


def test_rendered_calls_parse_back() -> None:
    from clover_cpp.chat_format import ChatTemplates, parse_answer
    from clover_common.tokenizer import chat_template

    templates = ChatTemplates(None, chat_template(), "chat_template.jinja")
    try:
        for ex in examples("held-out", 30, 2, kinds=("tool",)):
            prompt = ex.prompt_messages()
            call_index = len(prompt)
            rendered = templates.render(prompt, tools=ex.tools, enable_thinking=ex.enable_thinking)
            whole = render_chat(ex.messages[:call_index + 1], tools=ex.tools, enable_thinking=ex.enable_thinking,
                                add_generation_prompt=False)
            assert whole.startswith(rendered.prompt)
            answer = whole[len(rendered.prompt):].removesuffix("\n").removesuffix("<|im_end|>")
            parsed = parse_answer(rendered, answer)
            assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls] == \
                [(ex.expected_call["name"], ex.expected_call["arguments"])], answer
    finally:
        templates.close()
