"""Chat-template rendering as transformers' ``apply_chat_template`` does it, without transformers: a sandboxed
Jinja environment with its ``tojson`` filter and ``raise_exception`` global, for the reference's tokenizer module and
the tests' expected prompts. chat and serve render with llama.cpp's common/chat (clover_cpp/chat_format.py); the
tests check that both give the same text. It needs jinja2 only (no torch, no tokenizers).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' ``tojson`` filter (jinja2's own sorts keys and escapes HTML)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    """The ``raise_exception`` global that chat templates call."""
    raise jinja2.exceptions.TemplateError(message)


@functools.lru_cache(maxsize=8)
def _compile_template(template: str) -> jinja2.Template:
    """Compile ``template`` in a Jinja environment configured like transformers' apply_chat_template."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)


def _with_reasoning_alias(message: Mapping[str, Any]) -> dict[str, Any]:
    """Copy ``thinking``/``reasoning`` into ``reasoning_content`` as transformers does."""
    names = ("reasoning_content", "thinking", "reasoning")
    reasoning = next((message[k] for k in names if message.get(k) is not None), None)
    if reasoning is None:
        return dict(message)
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    template: str,
    tools: Sequence[Mapping[str, Any]] | None = None,
    enable_thinking: bool = True,
    add_generation_prompt: bool = True,
) -> str:
    """Render a conversation with a Jinja chat template (a GGUF's tokenizer.chat_template, or a file's).

    Same text as transformers' ``apply_chat_template(..., tokenize=False)``, without transformers.
    """
    compiled = _compile_template(template)
    return compiled.render(
        messages=[_with_reasoning_alias(m) for m in messages],
        tools=list(tools) if tools is not None else None,
        documents=None,
        add_generation_prompt=add_generation_prompt,
        enable_thinking=enable_thinking,
    )
