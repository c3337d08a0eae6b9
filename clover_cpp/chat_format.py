"""llama-server's chat templates (llama.cpp's common/chat) for `clover-cpp chat`: the prompt and the answer's parts.

``ChatTemplates.render`` builds the prompt llama-server builds for the same chat request
(``common_chat_templates_apply``: the GGUF's template in llama.cpp's Jinja engine, with its format detected:
Hermes JSON tool calls, the Qwen3.5 family's XML ones and about twenty others). ``AnswerParser`` reads the
generated text back into reasoning, content and tool calls as llama-server does (``common_chat_parse``; while
streaming, each piece re-parses the text so far as partial and emits what grew). So `clover-cpp chat` and
`clover-cpp serve` agree on both. The calls go through libclover's ``clover_chat_*`` (clover.h).
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from clover_common.errors import BadInput
from clover_common.input_files import CHAT_TEMPLATE, read_input_text
from clover_native import libclover

Channel = Literal["reasoning", "content"]
ERR_SIZE = 4096


class TemplateError(BadInput):
    """The template cannot be read, or cannot render these messages (the message says why)."""


def _one_line(text: str, limit: int = 600) -> str:
    """llama.cpp's Jinja errors quote the template around the error over several lines: one line, bounded."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit] + " ..."


@dataclass(frozen=True)
class Rendered:
    """A conversation rendered for its answer: the prompt and common/chat's parameters for reading the answer."""

    prompt: str
    params: dict[str, Any]  # clover_chat_templates_apply's result (common_chat_params)

    @property
    def generation_prompt(self) -> str:
        """What the template adds after the conversation for the answer (the assistant header, an open <think>)."""
        return str(self.params.get("generation_prompt", ""))

    @property
    def head(self) -> str | None:
        """The prompt without the generation prompt: what the next turn's prompt shares with this one (the answer is
        re-rendered after it). None when the generation prompt is not the prompt's end."""
        gen = self.generation_prompt
        return self.prompt[:len(self.prompt) - len(gen)] if self.prompt.endswith(gen) else None

    @property
    def in_reasoning(self) -> bool:
        """The answer starts inside a thinking block the generation prompt opened."""
        start = str(self.params.get("thinking_start_tag") or "")
        if not start:
            return False
        gen = self.generation_prompt
        i = gen.rfind(start)
        return i >= 0 and not any(end and end in gen[i:] for end in self.params.get("thinking_end_tags", []))

    @property
    def thinking_end(self) -> str | None:
        """The template's end of thinking (its first end tag, without whitespace), or None when it has none."""
        tags = self.params.get("thinking_end_tags") or []
        return (str(tags[0]).strip() or None) if tags else None


class ChatTemplates:
    """A model's chat templates through common/chat (one native handle; ``close()`` frees it)."""

    def __init__(self, llama_model: Any, template_text: str | None, origin: str) -> None:
        err = ctypes.create_string_buffer(ERR_SIZE)
        override = template_text.encode("utf-8", "surrogatepass") if template_text else None
        handle = libclover.lib().clover_chat_templates_init(llama_model, override, err, len(err))
        if not handle:
            raise TemplateError(f"{origin}: {_one_line(err.value.decode('utf-8', 'replace'))}")
        self._handle: int | None = handle

    @classmethod
    def load(cls, llama_model: Any, model_path: str, template_file: str | None) -> "ChatTemplates":
        """``template_file`` (--chat-template FILE: a regular file of at most CHAT_TEMPLATE's size) if given, else
        the GGUF's templates (tokenizer.chat_template; llama-server's ChatML when the GGUF has none)."""
        if template_file:
            return cls(llama_model, read_input_text(template_file, CHAT_TEMPLATE, "--chat-template"), template_file)
        return cls(llama_model, None, f"{model_path}: tokenizer.chat_template")

    def _live(self) -> int:
        if self._handle is None:
            raise ValueError("the chat templates are closed")
        return self._handle

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
               enable_thinking: bool = True, add_generation_prompt: bool = True,
               tool_choice: str | None = None) -> Rendered:
        """The prompt for ``messages`` (OpenAI's chat shapes), as llama-server renders the same request."""
        request: dict[str, Any] = {"messages": list(messages), "enable_thinking": enable_thinking,
                                   "add_generation_prompt": add_generation_prompt}
        if tools:
            request["tools"] = list(tools)
        if tool_choice is not None:
            request["tool_choice"] = tool_choice
        err = ctypes.create_string_buffer(ERR_SIZE)
        body = json.dumps(request, ensure_ascii=False).encode("utf-8", "surrogatepass")
        out = libclover.take_string(libclover.lib().clover_chat_templates_apply(self._live(), body, err, len(err)))
        if out is None:
            raise TemplateError("the chat template cannot render these messages: "
                                + _one_line(err.value.decode("utf-8", "replace")))
        params = json.loads(out)
        return Rendered(params.pop("prompt"), params)

    def close(self) -> None:
        if self._handle is not None:
            libclover.lib().clover_chat_templates_free(self._handle)
            self._handle = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone
            pass


@dataclass(frozen=True)
class TextEvent:
    channel: Channel
    text: str


@dataclass
class Answer:
    """An answer's parts, as llama-server's message: reasoning_content, content and tool_calls."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def parse_answer(rendered: Rendered, text: str, partial: bool = False, parse_tools: bool = True,
                 reasoning_format: str = "auto") -> Answer:
    """The generated ``text`` read as llama-server reads it (common_chat_parse with the rendering's format)."""
    params = {**rendered.params, "reasoning_format": reasoning_format, "parse_tool_calls": parse_tools}
    err = ctypes.create_string_buffer(ERR_SIZE)
    out = libclover.take_string(libclover.lib().clover_chat_parse(
        json.dumps(params).encode(), text.encode("utf-8", "surrogatepass"), partial, err, len(err)))
    if out is None:
        raise TemplateError("the answer cannot be parsed: " + _one_line(err.value.decode("utf-8", "replace")))
    msg = json.loads(out)
    return Answer(msg.get("reasoning_content") or "", msg.get("content") or "", msg.get("tool_calls") or [])


class AnswerParser:
    """Streams an answer's reasoning and content as text events; ``answer`` is the whole, parsed once complete.

    Each ``feed`` re-parses all the text so far as partial (llama-server does the same per token) and emits what
    each channel grew by; ``finish`` parses it as complete. A channel whose parse is not an extension of what was
    emitted (the parser revised a partial reading) emits nothing more until the final parse, which is the answer."""

    def __init__(self, rendered: Rendered, parse_tools: bool = True) -> None:
        self.rendered = rendered
        self.parse_tools = parse_tools
        self.text = ""
        self.answer = Answer()
        self._sent = {"reasoning": "", "content": ""}

    def _events(self, answer: Answer) -> list[TextEvent]:
        events = []
        for channel, now in (("reasoning", answer.reasoning), ("content", answer.content)):
            sent = self._sent[channel]
            if len(now) > len(sent) and now.startswith(sent):
                events.append(TextEvent(channel, now[len(sent):]))  # type: ignore[arg-type]
                self._sent[channel] = now
        return events

    def feed(self, text: str) -> list[TextEvent]:
        if not text:
            return []
        self.text += text
        return self._events(parse_answer(self.rendered, self.text, partial=True, parse_tools=self.parse_tools))

    def finish(self) -> list[TextEvent]:
        try:
            self.answer = parse_answer(self.rendered, self.text, partial=False, parse_tools=self.parse_tools)
        except TemplateError:  # cut short (Ctrl-C, the length limit) where the format cannot end: as streamed
            self.answer = parse_answer(self.rendered, self.text, partial=True, parse_tools=self.parse_tools)
        return self._events(self.answer)
