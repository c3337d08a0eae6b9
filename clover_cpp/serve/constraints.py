"""A request's constraint on its answer, as one GBNF grammar (spec 4's grammar mask; docs/serve.md, "Structured
output"): llama-server's ``grammar`` (GBNF) and ``json_schema`` fields, OpenAI's ``response_format``
(``json_object``, ``json_schema``) and a forced tool call (``tool_choice`` ``required`` or a named function, in
Qwen's ``<tool_call>`` format, which the chat template and the output parser use). JSON schemas become GBNF the way
llama-server converts them (llama.cpp's common/json-schema-to-grammar, through libclover). Every grammar is checked
against the vocabulary before the request is queued, so a bad one is a 400, never an error mid-answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from clover_common.errors import BadInput

from clover_native import libclover
from ..model import Model
from ..output_parser import THINK_CLOSE, TOOL_CLOSE, TOOL_OPEN, think_close_id
from .schema import ChatCompletionRequest, CloverFields, invalid


@dataclass(frozen=True)
class Constraint:
    """The grammar and the request field it came from (named in errors)."""

    grammar: str
    param: str


def schema_grammar(schema: Any, param: str) -> str:
    """GBNF for a JSON schema, or a 400 naming ``param`` with the converter's reason."""
    if not isinstance(schema, dict):
        raise invalid(f"'{param}' must be a JSON schema object, got {type(schema).__name__}", param)
    try:
        return libclover.json_schema_to_grammar(json.dumps(schema))
    except libclover.NativeError as exc:
        raise invalid(f"'{param}' is not a schema this server can enforce: {str(exc).removeprefix('JSON schema: ')}",
                      param) from None


def _response_format(fmt: dict[str, Any]) -> Constraint | None:
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":  # any JSON object; llama-server also takes an optional "schema" here
        return Constraint(schema_grammar(fmt.get("schema", {"type": "object"}), "response_format.schema"),
                          "response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise invalid("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                          "response_format.json_schema")
        return Constraint(schema_grammar(spec["schema"], "response_format.json_schema.schema"), "response_format")
    raise invalid(f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
                  "response_format.type", "unsupported_value")


def _tool_call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """One call of the tool as the template's JSON: its name as a constant, then its arguments' schema."""
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def _tool_choice(req: ChatCompletionRequest) -> Constraint | None:
    """``required``: a call of one of the tools; ``{"type": "function", "function": {"name": N}}``: a call of N.
    The answer is then exactly one ``<tool_call>`` block (llama-server falls back to ``auto`` for a named
    function; this server enforces it)."""
    choice = req.tool_choice
    if choice in (None, "auto", "none"):
        return None
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    if not tools:
        raise invalid("tool_choice forces a tool call, but the request has no tools", "tool_choice")
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise invalid("tool_choice must be 'none', 'auto', 'required' or "
                          "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
        tools = [t for t in tools if t["function"]["name"] == name]
        if not tools:
            raise invalid(f"tool_choice names the function {name!r}, which is not among the tools",
                          "tool_choice.function.name")
    schemas = [_tool_call_schema(t) for t in tools]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    body = schema_grammar(schema, "tools")
    # the converter's start symbol becomes the call's JSON, inside the template's tags
    body = body.replace("root ::= ", "tool-call-json ::= ", 1)
    root = f'root ::= {json.dumps(TOOL_OPEN + chr(10))} tool-call-json {json.dumps(chr(10) + TOOL_CLOSE)}\n'
    return Constraint(root + body, "tool_choice")


def _fields(req: CloverFields) -> list[Constraint]:
    """llama-server's own fields: ``grammar`` (GBNF) and ``json_schema``."""
    out = []
    if req.grammar:
        out.append(Constraint(req.grammar, "grammar"))
    if req.json_schema is not None:
        out.append(Constraint(schema_grammar(req.json_schema, "json_schema"), "json_schema"))
    return out


def request_constraint(model: Model, req: CloverFields) -> Constraint | None:
    """The request's one grammar, checked against the vocabulary; None when it has none. Two sources at once
    (a grammar and a response_format, say) are a 400: the answer could not meet both."""
    found = _fields(req)
    if isinstance(req, ChatCompletionRequest):
        if req.response_format is not None:
            c = _response_format(req.response_format.model_dump(by_alias=True, exclude_none=True))
            found += [c] if c else []
        c = _tool_choice(req)
        found += [c] if c else []
    if not found:
        return None
    if len(found) > 1:
        raise invalid(f"{' and '.join(c.param for c in found)} each constrain the answer; send one of them",
                      found[1].param)
    try:
        model.check_grammar(found[0].grammar)
    except BadInput as exc:
        raise invalid(f"'{found[0].param}': {str(exc).removeprefix('grammar: ')}", found[0].param) from None
    return found[0]


def grammar_after_ids(model: Model, thinking: bool) -> tuple[int, ...]:
    """With thinking on, the grammar applies after ``</think>`` (the reasoning stays free); its token id."""
    if not thinking:
        return ()
    token = think_close_id(model.tokenize)
    if token is None:
        raise invalid(f"structured output with thinking needs {THINK_CLOSE} as one token of the vocabulary; turn "
                      "thinking off (chat_template_kwargs.enable_thinking = false)", "chat_template_kwargs")
    return (token,)
