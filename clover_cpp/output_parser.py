"""Split generated chat text into reasoning, content and tool calls (Qwen style), incrementally.

The model writes ``reasoning</think>\\n\\ncontent`` when the prompt ends inside ``<think>`` (thinking on), and
tool calls as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` in the content. The parser
is fed text pieces as they are generated and returns events; feeding the whole text at once gives the same
events joined (the streaming and non-streaming answers of the server are the same by construction).

Whitespace rules (as the chat template reads an assistant message back): newlines at the start of the
reasoning and of each content segment are dropped, and trailing whitespace at the end of a segment (before
``</think>``, before ``<tool_call>``, at the end) is dropped. Tags split over pieces are held back until
they are complete. A ``<tool_call>`` body that is not a JSON object with a ``name`` stays content, verbatim.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"
_WHITESPACE = " \t\r\n"

Channel = Literal["reasoning", "content"]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])


@dataclass(frozen=True)
class TextEvent:
    channel: Channel
    text: str


@dataclass(frozen=True)
class ToolCallEvent:
    call: ToolCall


Event = TextEvent | ToolCallEvent


@dataclass
class ParsedOutput:
    reasoning: str | None  # None when the answer has no (non-empty) reasoning
    content: str
    tool_calls: list[ToolCall]


def opens_reasoning(prompt_text: str) -> bool:
    """True when the prompt ends inside an open ``<think>`` block (the template's thinking-on prompt)."""
    return prompt_text.rfind(THINK_OPEN) > prompt_text.rfind(THINK_CLOSE)


def think_close_id(tokenize: Callable[[str], list[int]]) -> int | None:
    """``</think>``'s id when it is one token of the vocabulary (a grammar can start after it), else None."""
    ids = tokenize(THINK_CLOSE)
    return ids[0] if len(ids) == 1 else None


def parse_tool_call(body: str) -> ToolCall | None:
    """``{"name": ..., "arguments": ...}`` (Qwen/Hermes) to a ToolCall; None when it is not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
        text = args
    else:
        text = json.dumps(args, ensure_ascii=False)
    return ToolCall(obj["name"], text)


def _partial_tag(buf: str, tag: str) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of ``tag`` (a tag still arriving)."""
    for n in range(min(len(buf), len(tag) - 1), 0, -1):
        if buf.endswith(tag[:n]):
            return n
    return 0


class OutputParser:
    """Incremental parser; ``feed(text)`` and ``finish()`` return the events the new text completes."""

    def __init__(self, start_in_reasoning: bool, parse_tools: bool) -> None:
        self.parse_tools = parse_tools
        self._state: Literal["reasoning", "content", "tool"] = "reasoning" if start_in_reasoning else "content"
        self._may_open_think = not start_in_reasoning  # a model may open <think> itself at the very start
        self._buf = ""
        self._lead = True  # at a segment start: leading newlines are dropped
        self._held = ""    # trailing whitespace of the current segment, emitted only if more text follows
        self._out: list[Event] = []

    # ------------------------------------------------------------------------------ emission
    def _emit(self, channel: Channel, text: str, end: bool) -> None:
        if self._lead:
            text = text.lstrip("\n")
            if text:
                self._lead = False
        text = self._held + text
        self._held = ""
        if not end:
            kept = text.rstrip(_WHITESPACE)
            self._held = text[len(kept):]
            text = kept
        else:
            text = text.rstrip(_WHITESPACE)
        if text:
            self._out.append(TextEvent(channel, text))
            self._may_open_think = False

    def _end_segment(self, channel: Channel, text: str, next_state: Literal["reasoning", "content", "tool"]) -> None:
        self._emit(channel, text, end=True)
        self._state = next_state
        self._lead = True
        self._held = ""

    # ------------------------------------------------------------------------------ states
    def _step(self) -> bool:
        """Consume what can be decided from the buffer; True to run again."""
        buf = self._buf
        if self._state == "reasoning":
            i = buf.find(THINK_CLOSE)
            if i >= 0:
                self._buf = buf[i + len(THINK_CLOSE):]
                self._end_segment("reasoning", buf[:i], "content")
                self._may_open_think = False
                return True
            keep = _partial_tag(buf, THINK_CLOSE)
            self._buf = buf[len(buf) - keep:]
            self._emit("reasoning", buf[:len(buf) - keep], end=False)
            return False
        if self._state == "content":
            if self._may_open_think and not self._held:
                head = buf.lstrip(_WHITESPACE)
                if head.startswith(THINK_OPEN):
                    self._buf = head[len(THINK_OPEN):]
                    self._state, self._lead, self._may_open_think = "reasoning", True, False
                    return True
                if THINK_OPEN.startswith(head):  # still arriving (or only whitespace so far)
                    return False
                self._may_open_think = False
            if self.parse_tools:
                i = buf.find(TOOL_OPEN)
                if i >= 0:
                    self._buf = buf[i + len(TOOL_OPEN):]
                    self._end_segment("content", buf[:i], "tool")
                    return True
                keep = _partial_tag(buf, TOOL_OPEN)
            else:
                keep = 0
            self._buf = buf[len(buf) - keep:]
            self._emit("content", buf[:len(buf) - keep], end=False)
            return False
        # inside <tool_call>: wait for the closing tag
        i = buf.find(TOOL_CLOSE)
        if i < 0:
            return False
        self._buf = buf[i + len(TOOL_CLOSE):]
        self._close_tool(buf[:i], closed=True)
        return True

    def _close_tool(self, body: str, closed: bool) -> None:
        call = parse_tool_call(body)
        self._state, self._lead, self._held = "content", True, ""
        if call is not None:
            self._out.append(ToolCallEvent(call))
            self._may_open_think = False
        else:  # not a tool call: the text stays content, tags included
            self._emit("content", TOOL_OPEN + body + (TOOL_CLOSE if closed else ""), end=not closed)

    # ------------------------------------------------------------------------------ API
    def feed(self, text: str) -> list[Event]:
        self._buf += text
        while self._step():
            pass
        out, self._out = self._out, []
        return out

    def finish(self) -> list[Event]:
        """The end of the text: flush what was held back."""
        buf, self._buf = self._buf, ""
        if self._state == "tool":
            self._close_tool(buf, closed=False)
        elif self._state == "reasoning":
            self._emit("reasoning", buf, end=True)
        else:
            self._emit("content", buf, end=True)
        self._held = ""
        out, self._out = self._out, []
        return out


def collect(events: list[Event]) -> ParsedOutput:
    """Join events into the non-streaming answer."""
    reasoning = "".join(e.text for e in events if isinstance(e, TextEvent) and e.channel == "reasoning")
    content = "".join(e.text for e in events if isinstance(e, TextEvent) and e.channel == "content")
    calls = [e.call for e in events if isinstance(e, ToolCallEvent)]
    return ParsedOutput(reasoning or None, content, calls)


def parse_output(text: str, start_in_reasoning: bool, parse_tools: bool) -> ParsedOutput:
    """The whole text at once (same result as feeding it in any pieces)."""
    parser = OutputParser(start_in_reasoning, parse_tools)
    return collect(parser.feed(text) + parser.finish())
