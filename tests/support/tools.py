"""The two functions the tool-call tests offer a model (one taking a string, one taking two integers), and the two
tool-call formats they run in: the Qwen3.5 family's XML calls (the shipped template) and Hermes JSON calls (Qwen3's)."""

from __future__ import annotations

from pathlib import Path

# Template files of the pinned llama.cpp tree (models/templates/), by the tool-call format they write.
TEMPLATE_FILES = {"hermes": "Qwen-Qwen3-0.6B.jinja", "qwen3.5": "Qwen3.5-4B.jinja"}


def pinned_template(name: str) -> Path:
    """The pinned tree's template file that writes tool calls in format ``name`` (TEMPLATE_FILES)."""
    from clover_dev.convert import vendored_tree

    return vendored_tree() / "models" / "templates" / TEMPLATE_FILES[name]

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]}}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
