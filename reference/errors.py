"""Errors raised for bad user input: each names the file and the field at fault."""

from __future__ import annotations

from pathlib import Path


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
