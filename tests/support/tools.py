"""The two functions the tool-call tests offer a model: one taking a string, one taking two integers."""

from __future__ import annotations

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
