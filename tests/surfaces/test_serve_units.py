"""The server's pure parts (docs/serve.md): the output parser (reasoning, tool calls), the text stream helpers,
the chat template's failures and the command line's bad input. They need no model; tests/surfaces/test_serve_live.py
runs a live server."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from clover_cpp.output_parser import (OutputParser, TextEvent, ToolCallEvent, collect, opens_reasoning,
                                      parse_output, parse_tool_call)
from clover_cpp.text_stream import Detokenizer, StopMatcher
from clover_dev.process import cli_command
from tests.support.chat import child_env


# ============================================================================ parser and stream units
def _feed_in_pieces(text: str, cuts: list[int], start: bool, tools: bool) -> list[Any]:
    parser = OutputParser(start, tools)
    events: list[Any] = []
    last = 0
    for c in cuts + [len(text)]:
        events += parser.feed(text[last:c])
        last = c
    return events + parser.finish()


SAMPLES = [
    # (text, start_in_reasoning, parse_tools, reasoning, content, tool calls as (name, arguments dict))
    ("Let me think.\n</think>\n\nThe answer is 4.", True, False, "Let me think.", "The answer is 4.", []),
    ("\nplan\n\n</think>\n\nI'll call it.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
     "{\"city\": \"Paris\"}}\n</tool_call>", True, True, "plan", "I'll call it.",
     [("get_weather", {"city": "Paris"})]),
    ("<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", "
     "\"arguments\": {\"x\": [1, 2]}}\n</tool_call>", False, True, None, "", [("a", {}), ("b", {"x": [1, 2]})]),
    ("x <tool_call>not json</tool_call> y", False, True, None, "x<tool_call>not json</tool_call> y", []),
    ("<tool_call>{\"name\": \"f\", \"arguments\": {\"k\": 1}}", False, True, None, "", [("f", {"k": 1})]),
    ("<tool_call>{\"name\": \"f\"", False, True, None, "<tool_call>{\"name\": \"f\"", []),
    ("<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>", False, False, None,
     "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>", []),
    ("<think>\nhidden\n</think>\n\nshown", False, False, "hidden", "shown", []),
    ("reasoning cut by the length limit", True, False, "reasoning cut by the length limit", "", []),
    ("  indented code\n    more\n", False, False, None, "  indented code\n    more", []),
    ("a </thin b", True, False, "a </thin b", "", []),
]


@pytest.mark.parametrize("text,start,tools,reasoning,content,calls", SAMPLES)
def test_output_parser(text: str, start: bool, tools: bool, reasoning: str | None, content: str,
                       calls: list[tuple[str, dict[str, Any]]]) -> None:
    whole = parse_output(text, start, tools)
    assert whole.reasoning == reasoning
    assert whole.content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == calls
    # every way of cutting the text in two or three pieces gives the same answer (streaming == whole)
    for i in range(len(text) + 1):
        for j in sorted({i, (i + len(text)) // 2, len(text)}):
            got = collect(_feed_in_pieces(text, [i, j], start, tools))
            assert (got.reasoning, got.content) == (reasoning, content), (i, j)
            assert [(c.name, c.arguments) for c in got.tool_calls] == \
                   [(c.name, c.arguments) for c in whole.tool_calls]


def test_output_parser_events_are_incremental() -> None:
    parser = OutputParser(start_in_reasoning=True, parse_tools=True)
    assert parser.feed("step one") == [TextEvent("reasoning", "step one")]
    assert parser.feed(" </thi") == []  # a tag still arriving is held back, and so is the trailing space
    assert parser.feed("nk>\n\nHi <tool") == [TextEvent("content", "Hi")]
    assert parser.feed("_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}}") == []
    events = parser.feed("</tool_call>")
    assert len(events) == 1 and isinstance(events[0], ToolCallEvent)
    assert events[0].call.name == "f" and json.loads(events[0].call.arguments) == {"a": 1}
    assert events[0].call.id.startswith("call_")
    assert parser.finish() == []


def test_parse_tool_call_shapes() -> None:
    assert parse_tool_call('{"name": "f", "arguments": "{\\"a\\": 1}"}').arguments == '{"a": 1}'
    assert parse_tool_call('{"name": "f", "parameters": {"a": 1}}').arguments == '{"a": 1}'
    assert parse_tool_call('{"name": "f", "arguments": "not json"}') is None
    assert parse_tool_call('{"arguments": {}}') is None
    assert parse_tool_call("[1, 2]") is None
    assert opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_stop_matcher_across_pieces() -> None:
    text = "alpha beta STOP gamma"
    for i in range(len(text) + 1):
        m = StopMatcher(["STOP", "zzz"])
        out = m.feed(text[:i]) + m.feed(text[i:]) + m.finish()
        assert out == "alpha beta " and m.stopped, i
    m = StopMatcher(["STOP"])
    assert m.feed("no ST") == "no " and m.finish() == "ST" and not m.stopped


def test_detokenizer_holds_incomplete_utf8() -> None:
    pieces = {1: b"caf", 2: b"\xc3", 3: b"\xa9!", 4: b"\xff"}

    def detok(ids: Any) -> str:
        return b"".join(pieces[i] for i in ids).decode("utf-8", "replace")

    d = Detokenizer(detok)
    assert d.feed([1]) == "caf"
    assert d.feed([2]) == ""  # half of 'é'
    assert d.feed([3]) == "é!"
    assert d.feed([4]) == ""
    assert d.finish() == "\ufffd"


@pytest.mark.parametrize("exc,fragment", [(MemoryError(), "out of memory"), (RecursionError(), "recursed"),
                                           (OverflowError("int too large"), "OverflowError: int too large")])
def test_template_failures_are_template_errors(monkeypatch: pytest.MonkeyPatch, exc: BaseException,
                                               fragment: str) -> None:
    """serve answers a TemplateError with a 400 and chat prints it as one line: no 500, no traceback."""
    from clover_cpp import chat_template

    def fail(*_a: Any, **_k: Any) -> str:
        raise exc

    monkeypatch.setattr(chat_template, "render_chat", fail)
    with pytest.raises(chat_template.TemplateError, match=fragment):
        chat_template.ChatTemplate("x", "test").render([{"role": "user", "content": "hi"}])


# ============================================================================ the live server


def test_bad_command_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF garbage")
    serve = "serve-legacy"
    for args in ([serve, "-m", "/nonexistent.gguf"], [serve, "-m", str(bad)],
                 [serve, "-m", str(bad), "--port", "70000"], ["chat", "-m", str(bad), "--threshold", "2"],
                 ["generate", "-m", str(bad), "-p", "x", "--threshold", "-1"],
                 ["generate", "-m", str(bad), "-p", "x", "--threshold", "nan"],
                 [serve, "-m", str(bad), "--api-key-file", str(tmp_path / "none.txt")],
                 [serve, "-m", str(bad), "--max-queue", "-1"],
                 # numbers the engine's 32-bit fields cannot hold, and limits that are no finite number
                 ["generate", "-m", str(bad), "-p", "x", "-n", str(10**12)],
                 ["generate", "-m", str(bad), "-p", "x", "--temp", "1e39"],
                 [serve, "-m", str(bad), "-c", "99999999999"], [serve, "-m", str(bad), "-t", str(2**40)],
                 [serve, "-m", str(bad), "--top-k", str(2**31)], [serve, "-m", str(bad), "--cache-ram", "nan"],
                 [serve, "-m", str(bad), "--timeout", "nan"], [serve, "-m", str(bad), "--timeout", "-1"]):
        done = subprocess.run(cli_command(*args), capture_output=True, text=True, env=child_env(), timeout=120)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("clover-cpp: error:"), \
            (args, done.stderr)
