"""llama-server's chat templates (common/chat) as `clover-cpp chat` uses them (clover_cpp.chat_format, libclover's
clover_chat_*): the prompt it renders and the answers it parses.

- Rendering: for the demo's template (the Qwen3.5 family's, models/templates/Qwen3.5-4B.jinja in the pinned tree)
  and Qwen3's with Hermes JSON calls (models/templates/Qwen-Qwen3-0.6B.jinja), common/chat's prompt equals the
  reference's (clover_common.chat_render, Jinja configured as transformers' apply_chat_template) on conversations
  with a system prompt, earlier turns, reasoning, tools, tool calls and tool results, thinking on and off. Every
  template the pinned tree ships parses (the Jinja nesting limit leaves real templates alone) and renders a turn.
- Parsing with `tool_choice` `auto` (the grammar leaves the model free to answer or call), on recorded model text:
  the demo model's own tool calls in each template's format, recorded from `clover-cpp serve` with `tool_choice`
  `required` (greedy, demo GGUF; the model calls no tool unprompted yet), alone and after prose. Each becomes the
  call, fed whole or a character at a time as a stream, and prose without a call stays content.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clover_common import chat_render
from clover_common import tokenizer as ctok
from clover_dev.convert import vendored_tree
from tests.support.chat import transformers_shape
from tests.support.tools import ASK, TOOLS, pinned_template

pytestmark = pytest.mark.native

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "one_turn": ASK,
    "system_and_history": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hi, how can I help?"},
        {"role": "user", "content": "Write fibonacci in Python."}],
    "reasoning_in_history": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "add them"},
        {"role": "user", "content": "and 3+3?"}],
    "tool_round_trip": [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\": 21, \"sky\": \"clear\"}"}],
}

# The demo model's answers, as generated (`clover-cpp serve` on the demo GGUF, f32, ar, temperature 0, thinking off,
# ASK and TOOLS, tool_choice "required" and then the named function "add"; llama-server's __verbose content), with the
# call each is (the model calls add whatever it is asked, and pads with whitespace the grammar allows).
RECORDED = {
    "hermes": [
        ('<tool_call>\n\n\n                    {\n                    "name": "add" ,\n     "arguments" : {"a": 0, '
         '"b" : 0}\n\n    }\n\n                    </tool_call>\n                    ', {"a": 0, "b": 0}),
        ('<tool_call>\n\n\n                    {\n                    "name" : "add" ,\n            "arguments" : '
         '{"a": 0, "b" :0}} </tool_call>\n\n                    ', {"a": 0, "b": 0}),
    ],
    "qwen3.5": [
        ("                    <tool_call>\n<function=add>\n<parameter=a>\n1222\n</parameter>\n<parameter=b>\n1222\n"
         "</parameter>\n</function>\n</tool_call>\n\n                    ", {"a": 1222, "b": 1222}),
    ],
}
PROSE = "Let me look that up.\n\n"


@pytest.fixture(scope="module", params=["hermes", "qwen3.5"])
def template(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """(name, template text): the demo's own, the Qwen3.5 family's (XML calls), and Qwen3's (Hermes JSON calls)."""
    yield request.param, ctok.chat_template() if request.param == "qwen3.5" else \
        pinned_template(request.param).read_text(encoding="utf-8")


def _templates(text: str) -> Any:
    from clover_cpp.chat_format import ChatTemplates

    return ChatTemplates(None, text, "test template")


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("thinking", [True, False])
def test_common_chat_renders_as_the_reference(template: tuple[str, str], name: str, thinking: bool) -> None:
    family, text = template
    messages = CONVERSATIONS[name]
    tools = TOOLS if name.startswith("tool") else None
    ours = _templates(text).render(messages, tools=tools, enable_thinking=thinking)
    theirs = chat_render.render_chat(transformers_shape(messages), text, tools=tools, enable_thinking=thinking)
    assert ours.prompt == theirs
    assert theirs.endswith(ours.generation_prompt) and ours.generation_prompt.startswith("<|im_start|>assistant")
    # The Qwen3.5 family's generation prompt opens <think> when thinking is on; Qwen3's leaves it to the model.
    assert ours.in_reasoning == (thinking and family == "qwen3.5")


def test_every_shipped_template_parses_and_renders() -> None:
    """The nesting limit of the Jinja parser leaves llama.cpp's templates alone: each one renders a turn."""
    from clover_cpp.chat_format import TemplateError

    folder = vendored_tree() / "models" / "templates"
    paths = sorted(folder.glob("*.jinja"))
    assert len(paths) > 40, folder
    failed = {}
    for path in paths:
        try:
            prompt = _templates(path.read_text(encoding="utf-8")).render(ASK).prompt
            assert "Paris" in prompt, path.name
        except TemplateError as exc:
            failed[path.name] = str(exc)
    # templates that need more than one user turn or other roles raise in their own Jinja (raise_exception)
    assert not {k: v for k, v in failed.items() if "nests deeper" in v}, failed
    assert len(failed) < len(paths) // 10, failed


def test_the_format_is_detected(template: tuple[str, str]) -> None:
    """common/chat recognises both templates' tool-call formats: a parser and a lazy grammar triggered by the call."""
    name, text = template
    rendered = _templates(text).render(ASK, tools=TOOLS, tool_choice="auto", enable_thinking=False)
    params = rendered.params
    assert params["parser"] and params["grammar"] and params["grammar_lazy"], params["format_name"]
    assert any("<tool_call>" in t["value"] for t in params["grammar_triggers"]), params["grammar_triggers"]
    if name == "qwen3.5":
        assert "<function=" in params["grammar"] and "<parameter=" in params["grammar"]


def test_later_system_messages_join_the_first() -> None:
    """The Qwen3.5 family's template raises on a system message after the first, which agents send (Codex's developer
    messages, Claude Code's): common/chat moves their text into the first system message, or makes one (patch
    chat-merge-later-system-messages). Qwen3's template renders them itself, and is left alone."""
    user = [{"role": "user", "content": "Hi"}, {"role": "user", "content": "And now?"}]
    later = [{"role": "system", "content": "Be brief."}, user[0], {"role": "system", "content": "Answer in French."},
             {"role": "developer", "content": "No code."}, user[1]]
    merged = [{"role": "system", "content": "Be brief.\n\nAnswer in French.\n\nNo code."}, *user]
    qwen35 = ctok.chat_template()
    assert _templates(qwen35).render(later, enable_thinking=False).prompt == \
        chat_render.render_chat(merged, qwen35, enable_thinking=False)
    no_first = [user[0], {"role": "system", "content": "Answer in French."}, user[1]]
    assert _templates(qwen35).render(no_first, enable_thinking=False).prompt == \
        chat_render.render_chat([{"role": "system", "content": "Answer in French."}, *user], qwen35,
                                enable_thinking=False)
    qwen3 = pinned_template("hermes").read_text(encoding="utf-8")
    as_system = [{**m, "role": "system"} if m["role"] == "developer" else m for m in later]
    assert _templates(qwen3).render(later, enable_thinking=False).prompt == \
        chat_render.render_chat(as_system, qwen3, enable_thinking=False)


def test_the_demo_gguf_carries_the_qwen35_template(demo_gguf: Path) -> None:
    """The demo's GGUF holds the Qwen3.5 family's template byte for byte (the pinned tree's Qwen3.5-4B.jinja), so
    llama-server renders and parses the released model's format with it."""
    from tests.support.convert import fields

    template = fields(demo_gguf, "clover_moe")["tokenizer.chat_template"][1]
    assert template == pinned_template("qwen3.5").read_text(encoding="utf-8")


def _auto(text: str) -> Any:
    return _templates(text).render(ASK, tools=TOOLS, tool_choice="auto", enable_thinking=False)


def _streamed(rendered: Any, text: str) -> tuple[str, list[dict[str, Any]]]:
    """The text fed a character at a time as a stream: the content events joined, and the final answer's calls."""
    from clover_cpp.chat_format import AnswerParser

    parser = AnswerParser(rendered)
    events = [e for ch in text for e in parser.feed(ch)] + parser.finish()
    assert all(e.channel == "content" for e in events), events
    return "".join(e.text for e in events), parser.answer.tool_calls


@pytest.mark.parametrize("prose", ["", PROSE])
def test_auto_reads_the_recorded_calls(template: tuple[str, str], prose: str) -> None:
    from clover_cpp.chat_format import parse_answer

    name, text = template
    rendered = _auto(text)
    for recorded, arguments in RECORDED[name]:
        answer = parse_answer(rendered, prose + recorded)
        assert answer.content.strip() == prose.strip(), (recorded, answer)  # whitespace around the call: as it was
        assert len(answer.tool_calls) == 1, (recorded, answer)
        call = answer.tool_calls[0]["function"]
        assert call["name"] == "add" and json.loads(call["arguments"]) == arguments, (recorded, call)
        content, calls = _streamed(rendered, prose + recorded)
        assert content == answer.content
        assert [c["function"] for c in calls] == [call]


def test_auto_leaves_prose_as_content(template: tuple[str, str]) -> None:
    from clover_cpp.chat_format import parse_answer

    _, text = template
    prose = "def add(a, b):\n    return a + b\n"
    answer = parse_answer(_auto(text), prose)
    assert answer.content == prose and not answer.tool_calls
    assert _streamed(_auto(text), prose) == (prose, [])


def test_a_template_error_is_one_line() -> None:
    from clover_cpp.chat_format import TemplateError

    with pytest.raises(TemplateError, match="test template") as info:
        _templates("{% if %}")
    assert "\n" not in str(info.value)
    with pytest.raises(TemplateError, match="cannot render") as info:
        _templates("{{ raise_exception('no system role') }}").render(ASK)
    assert "no system role" in str(info.value) and "\n" not in str(info.value)
