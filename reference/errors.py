"""Errors raised for bad user input: each names the file and the field at fault."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class CloverInputError(Exception):
    """A checkpoint, config or tokenizer that cannot be used, with a message written for people.

    Command-line entry points catch this, print the one-line message and exit with code 2.
    """

    def __init__(self, path: str | Path | None, message: str, field: str | None = None) -> None:
        self.path = str(path) if path is not None else None
        self.field = field
        where = self.path or "<input>"
        if field:
            where = f"{where}: field '{field}'"
        super().__init__(f"{where}: {message}")


def missing_path_reason(path: Path) -> str | None:
    """Why ``path`` cannot be used although something is there: a symbolic link that leads nowhere (a loop or a
    missing target); None otherwise."""
    if path.is_symlink() and not path.exists():
        return "is a symbolic link that leads nowhere (a loop or a missing target)"
    return None


def read_json(path: Path) -> Any:
    """The JSON value in ``path``; CloverInputError (one line, naming the file) when it cannot be read, is not
    UTF-8 JSON, or nests too deeply for the parser."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CloverInputError(path, missing_path_reason(path) or f"cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise CloverInputError(path, f"is not valid JSON ({exc})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CloverInputError(path, f"is not valid JSON ({exc})") from None
    except RecursionError:
        raise CloverInputError(path, "nests JSON arrays or objects too deeply to be read") from None
