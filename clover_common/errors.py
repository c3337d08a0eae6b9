"""The project's errors: what the user's input or machine causes, as opposed to bugs.

Every command-line tool (clover-ref, clover-convert, clover-quantize, clover-cpp; clover_common.cli_runner) prints a
``CloverError`` as one line and exits with code 2; any other exception is a bug and keeps its traceback. A file the
user names is read through input_files.py, whose errors are CloverInputErrors.
"""

from __future__ import annotations

from pathlib import Path


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
