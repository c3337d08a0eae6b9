"""Validate JSON against a JSON Schema: `jsonschema` when installed, otherwise a small validator of the subset
the project's schema files and tests use (type, required, properties, additionalProperties, propertyNames.pattern,
items, enum, minimum, maximum, minLength, maxLength, minItems, maxItems and local $ref). Returns a list of error
strings (empty = valid)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

_TYPES: dict[str, Any] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}
_SUPPORTED = {"$schema", "$defs", "$ref", "title", "description", "type", "required", "properties",
              "additionalProperties", "propertyNames", "pattern", "items", "enum", "minimum", "maximum",
              "minLength", "maxLength", "minItems", "maxItems"}


def load_schema(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def validate(instance: Any, schema: dict[str, Any]) -> list[str]:
    try:
        import jsonschema
    except ImportError:
        errors: list[str] = []
        _check(instance, schema, schema, "$", errors)
        return errors
    validator = jsonschema.Draft202012Validator(schema)
    return [f"{'/'.join(map(str, e.absolute_path)) or '$'}: {e.message}" for e in validator.iter_errors(instance)]


def _resolve(ref: str, root: dict[str, Any]) -> dict[str, Any]:
    assert ref.startswith("#/"), f"only local $ref is supported, got {ref}"
    node: Any = root
    for part in ref[2:].split("/"):
        node = node[part]
    return node


def _check(value: Any, schema: dict[str, Any], root: dict[str, Any], where: str, errors: list[str]) -> None:
    unknown = set(schema) - _SUPPORTED
    assert not unknown, f"schema keywords {sorted(unknown)} are not supported by this validator"
    if "$ref" in schema:
        _check(value, _resolve(schema["$ref"], root), root, where, errors)
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_TYPES[t](value) for t in types):
            errors.append(f"{where}: {value!r} is not of type {'/'.join(types)}")
            return
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where}: {value!r} is not one of {schema['enum']}")
    if "minimum" in schema and _TYPES["number"](value) and value < schema["minimum"]:
        errors.append(f"{where}: {value!r} is less than the minimum {schema['minimum']}")
    if "maximum" in schema and _TYPES["number"](value) and value > schema["maximum"]:
        errors.append(f"{where}: {value!r} is more than the maximum {schema['maximum']}")
    for key, kind, low in (("minLength", str, True), ("maxLength", str, False), ("minItems", list, True),
                           ("maxItems", list, False)):
        if key in schema and isinstance(value, kind) and (len(value) < schema[key] if low
                                                          else len(value) > schema[key]):
            errors.append(f"{where}: {value!r} has {len(value)} {'characters' if kind is str else 'items'}, "
                          f"{key} is {schema[key]}")
    if "pattern" in schema and isinstance(value, str) and not re.search(schema["pattern"], value):
        errors.append(f"{where}: {value!r} does not match {schema['pattern']}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            _check(item, schema["items"], root, f"{where}[{i}]", errors)
    if isinstance(value, dict):
        for key in schema.get("required", []):
            if key not in value:
                errors.append(f"{where}: the required key {key!r} is missing")
        props = schema.get("properties", {})
        for key, item in value.items():
            if "propertyNames" in schema:
                _check(key, schema["propertyNames"], root, f"{where} key {key!r}", errors)
            if key in props:
                _check(item, props[key], root, f"{where}.{key}", errors)
            elif schema.get("additionalProperties") is False:
                errors.append(f"{where}: the key {key!r} is not allowed")
            elif isinstance(schema.get("additionalProperties"), dict):
                _check(item, schema["additionalProperties"], root, f"{where}.{key}", errors)
