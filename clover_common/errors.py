"""The project's errors: what the user's input or machine causes, as opposed to bugs.

Every command-line tool (clover-ref, clover-convert, clover-quantize, clover-cpp; clover_common.cli_runner) prints a
``CloverError`` as one line and exits with code 2; any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class CloverError(Exception):
    """Base of the errors a user can cause and fix: bad input files, options, or a machine that cannot do the
    work. The message is written for people and names the file or option at fault."""


class BadInput(CloverError, ValueError):
    """An option or argument out of range or in conflict with another (a ValueError for Python callers)."""


class CloverInputError(CloverError):
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
