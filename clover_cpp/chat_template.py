"""The model's chat template (``tokenizer.chat_template`` in the GGUF), rendered for chat and serve.

Rendering is ``clover_common.chat_render.render_chat`` (Jinja configured like transformers'
``apply_chat_template``) with the template text read from the GGUF; the reference renders with the same function,
so both build the same prompt text.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jinja2

from clover_common.chat_render import render_chat
from clover_common.errors import BadInput
from clover_common.input_files import CHAT_TEMPLATE, read_input_text

from clover_native import loader


class TemplateError(BadInput):
    """The template could not render these messages (the message says why)."""


class ChatTemplate:
    def __init__(self, source: str, origin: str) -> None:
        self.source = source
        self.origin = origin

    @classmethod
    def from_model(cls, llama_model: Any, path: str) -> "ChatTemplate | None":
        """The GGUF's default template (``tokenizer.chat_template``), or None when it has none."""
        raw = loader.llama().llama_model_chat_template(llama_model, None)
        if not raw:
            return None
        return cls(raw.decode("utf-8", "replace"), f"{path}: tokenizer.chat_template")

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> "ChatTemplate":
        """--chat-template FILE (clover_common.input_files: a regular file of at most CHAT_TEMPLATE's size)."""
        return cls(read_input_text(path, CHAT_TEMPLATE, "--chat-template"), os.fspath(path))

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
               enable_thinking: bool = True, add_generation_prompt: bool = True) -> str:
        try:
            return render_chat(messages, self.source, tools=tools or None, enable_thinking=enable_thinking,
                               add_generation_prompt=add_generation_prompt)
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the chat template cannot render these messages: {exc}") from None
        except (TypeError, AttributeError, KeyError) as exc:  # a message shape the template does not expect
            raise TemplateError(f"the chat template cannot render these messages: {exc}") from None
        except RecursionError:
            raise TemplateError("the chat template cannot render these messages: it recursed too deeply") from None
        except SyntaxError as exc:  # Jinja compiles the template to Python, whose compiler has nesting limits of its
            # own ("too many statically nested blocks", "too many levels of indentation")
            raise TemplateError(f"the chat template cannot be compiled: it nests too deeply ({exc.msg})") from None
        except MemoryError:
            raise TemplateError("the chat template cannot render these messages: it ran out of memory") from None
        except (OverflowError, ValueError, ArithmeticError) as exc:  # e.g. range(10**30), an int too large
            raise TemplateError(f"the chat template cannot render these messages: "
                                f"{type(exc).__name__}: {exc}") from None


    def generation_prompt_start(self, tokenize: Callable[[str], list[int]], messages: Sequence[Mapping[str, Any]],
                                tools: Sequence[Mapping[str, Any]] | None, enable_thinking: bool, text: str,
                                ids: Sequence[int]) -> int:
        """Where the generation prompt starts in ``ids`` (the tokens of ``text``, this rendering): the
        conversation rendered without it is what the next turn's prompt shares with this one, since the
        answer is re-rendered with its reasoning dropped. 0 when that is not a token prefix of ``ids``."""
        try:
            head = self.render(messages, tools=tools, enable_thinking=enable_thinking, add_generation_prompt=False)
        except TemplateError:
            return 0
        if not head or not text.startswith(head):
            return 0
        head_ids = tokenize(head)
        n = len(head_ids)
        return n if 0 < n < len(ids) and list(ids[:n]) == head_ids else 0


def load_template(llama_model: Any, model_path: str, override: str | None) -> ChatTemplate | None:
    """``override`` (a file) if given, else the GGUF's template."""
    if override:
        return ChatTemplate.from_file(override)
    return ChatTemplate.from_model(llama_model, model_path)
