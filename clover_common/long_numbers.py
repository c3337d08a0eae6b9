"""Numbers from users' files in one short line, and JSON integers too long to read.

CPython converts an integer of more than 4,300 digits neither from text nor to text
(``sys.get_int_max_str_digits``): ``json.loads`` raises a plain ValueError on one (not a JSONDecodeError), and
formatting one into a message raises too. ``shown`` writes any value so that a message stays one short line;
``long_integer_reason`` says which key of a JSON text holds the integer that ``json.loads`` refused.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

MAX_SHOWN = 40  # characters of a string value a message quotes
MAX_SHOWN_NAME = 200  # of a name (a tensor's, a file's): real ones are shorter


def shown(value: Any, limit: int = MAX_SHOWN) -> str:
    """``value`` as config.json spells it (``NaN``, ``Infinity``, ``true``, ``null``), short: an integer of
    more than 20 digits by its length, a string cut to ``limit`` characters, a list or an object by its kind."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int):
        if abs(value) < 10**20:
            return str(value)
        return f"{'a negative' if value < 0 else 'an'} integer of {_digits(value)} digits"
    if isinstance(value, float):
        return json.dumps(value)  # NaN, Infinity, -Infinity, 1e+39
    if isinstance(value, str):
        return repr(value) if len(value) <= limit else repr(value[:limit]) + "..."
    if isinstance(value, list):
        return f"a list of {len(value)}"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _digits(value: int) -> int:
    """The decimal digits of ``value`` without converting it to text (which CPython refuses past 4,300)."""
    n = abs(value)
    digits = max(1, int(n.bit_length() * math.log10(2)))  # a lower bound, at most one short
    return digits + 1 if n >= 10 ** digits else digits


class _Long:
    """Where json.loads meets an integer too long to convert: its digit count."""

    def __init__(self, text: str) -> None:
        self.digits = len(text.lstrip("-"))


class _At:
    """An object that holds a _Long somewhere: the key path to it (replaces the object while re-parsing)."""

    def __init__(self, path: list[str], digits: int) -> None:
        self.path = path
        self.digits = digits


def _find(value: Any) -> _At | None:
    if isinstance(value, _Long):
        return _At([], value.digits)
    if isinstance(value, _At):
        return value
    if isinstance(value, list):
        return next((found for item in value if (found := _find(item)) is not None), None)
    return None


def _mark(pairs: list[tuple[str, Any]]) -> Any:
    for key, value in pairs:
        if (found := _find(value)) is not None:
            return _At([key, *found.path], found.digits)
    return dict(pairs)


def _parse_int(text: str) -> int | _Long:
    limit = sys.get_int_max_str_digits()
    return _Long(text) if limit and len(text.lstrip("-")) > limit else int(text)


def long_integer_reason(text: str | bytes) -> str:
    """Why ``json.loads(text)`` raised a ValueError that is no JSONDecodeError, as the rest of a sentence
    starting "PATH: ": "field 'KEY': holds an integer of N digits, ...", KEY the dotted path to it (left out at
    the top level). Parses ``text`` again: call it only on that failure."""
    try:
        found = _find(json.loads(text, parse_int=_parse_int, object_pairs_hook=_mark))
    except (ValueError, RecursionError):
        found = None
    if found is None:
        return "holds a number too long to read"
    where = f"field '{'.'.join(found.path)}': " if found.path else ""
    return (f"{where}holds an integer of {found.digits} digits, more than the {sys.get_int_max_str_digits()} "
            "a JSON integer may have here")
