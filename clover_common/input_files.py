"""The one way every tool opens a file the user named (docs/architecture.md, "Input files").

A file is read only when it is a regular file (symbolic links followed) no larger than its kind allows
(``KINDS``): a fifo, a device such as /dev/zero, a directory or a link that leads nowhere is refused with what
the path is, never waited on or read until memory runs out. The path is checked with ``stat`` before it is
opened (opening a device can have effects of its own), opened with O_NONBLOCK (a fifo swapped in between the
two cannot block the open) and checked again on the opened descriptor, which is what is read; a read never asks
for more than the limit plus one byte.

- ``read_input_bytes`` / ``read_input_text`` / ``read_json``: a whole small file (configs, tokenizers,
  templates, grammars, schemas, key files, calibration text).
- ``open_input`` / ``open_input_fd``: a file read in pieces (safetensors shards, session files, GGUF headers).
- ``check_input_file``: a file only handed to other code by name (a GGUF to llama.cpp, a model card to gguf-py).
- ``present``: whether an optional file is there at all; whatever is there must then pass the checks above.
- ``check_input_dir``: a checkpoint directory.

Errors are ``InputFileError`` (a CloverInputError): ``PATH: REASON``, or ``FLAG PATH: REASON`` for a file an
option named.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from .errors import CloverInputError
from .long_numbers import long_integer_reason

KiB, MiB, GiB = 2**10, 2**20, 2**30


@dataclass(frozen=True)
class InputKind:
    """What a file is, in messages ("grammar" files), and the most bytes it may have (None: any size, for files
    read in bounded pieces or by native code)."""

    name: str
    max_bytes: int | None


READ_CHUNK = 1 * MiB  # a capped read's step (a read reserves its whole size first)

# The caps are far above what real files of each kind hold (the table in docs/architecture.md says why each).
CONFIG = InputKind("JSON settings", 64 * MiB)  # config.json, generation_config.json, tokenizer_config.json,
# --metadata: a few KB; a tokenizer_config.json with a large added_tokens_decoder a few MB
WEIGHT_INDEX = InputKind("safetensors index", 256 * MiB)  # a line per tensor: ~20 MB for a 1T per-expert MoE
TOKENIZER = InputKind("tokenizer", 256 * MiB)  # tokenizer.json: real ones are 10-35 MB
MODEL_CARD = InputKind("model card", 16 * MiB)  # README.md: tens of KB
CHAT_TEMPLATE = InputKind("chat template", 4 * MiB)  # Jinja (or chat_template.json): real ones are under 50 KB
GRAMMAR = InputKind("grammar", 16 * MiB)  # GBNF and JSON schemas: real ones are a few KB; twice the largest
JSON_SCHEMA = InputKind("JSON schema", 16 * MiB)  # request body serve takes by default (llama-clover: the same)
API_KEYS = InputKind("API key", 1 * MiB)  # one key per line: thousands of keys
CALIBRATION_TEXT = InputKind("calibration text", 256 * MiB)  # tokenized whole: wiki.train.raw is 10 MB
IMATRIX = InputKind("importance matrix", 8 * GiB)  # loaded whole as float32: ~1.5 GB for a 1T MoE's experts
SAFETENSORS = InputKind("safetensors", None)  # streamed in bounded chunks
GGUF = InputKind("GGUF", None)  # mapped by llama.cpp or gguf-py
SESSION = InputKind("session", None)  # a long context's state is GBs; every read is checked against the size

KINDS = (CONFIG, WEIGHT_INDEX, TOKENIZER, MODEL_CARD, CHAT_TEMPLATE, GRAMMAR, JSON_SCHEMA, API_KEYS,
         CALIBRATION_TEXT, IMATRIX, SAFETENSORS, GGUF, SESSION)


class InputFileError(CloverInputError):
    """A named input that is not a readable regular file of its kind; ``reason`` says what it is instead."""

    def __init__(self, path: str | os.PathLike[str], reason: str, flag: str | None = None) -> None:
        super().__init__(f"{flag} {os.fspath(path)}" if flag else path, reason)
        self.path = os.fspath(path)
        self.flag = flag
        self.reason = reason


def size_text(n: int) -> str:
    """Bytes as people read them: "512 bytes", "3.2 MiB", "16 GiB"."""
    if n < KiB:
        return f"{n} bytes"
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            return f"{n / scale:.1f}".removesuffix(".0") + f" {unit}"
    raise AssertionError(n)


def mode_text(mode: int) -> str:
    """What a stat mode that is no regular file is, as the rest of a sentence starting "PATH: "."""
    if stat.S_ISDIR(mode):
        return "is a directory, not a file"
    if stat.S_ISFIFO(mode):
        return "is a fifo (named pipe), not a regular file"
    if stat.S_ISCHR(mode):
        return "is a character device, not a regular file"
    if stat.S_ISBLK(mode):
        return "is a block device, not a regular file"
    if stat.S_ISSOCK(mode):
        return "is a socket, not a regular file"
    return "is not a regular file"


def _stat_error_text(path: str | os.PathLike[str], exc: OSError) -> str:
    """Why ``stat`` or ``open`` of ``path`` failed, as the rest of a sentence starting "PATH: "."""
    if exc.errno == errno.ENOENT and os.path.islink(path):
        return "is a symbolic link that leads nowhere (a missing target)"
    if exc.errno == errno.ELOOP:
        return "is a symbolic link that leads nowhere (a loop)"
    if exc.errno == errno.ENOENT:
        return "no such file"
    if exc.errno == errno.ENOTDIR:
        return "no such file (a part of the path is not a directory)"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if exc.errno == errno.ENAMETOOLONG:
        return "the file name is too long"
    return f"cannot be read ({exc.strerror or exc})"


def _check_stat(path: str | os.PathLike[str], st: os.stat_result, kind: InputKind, flag: str | None) -> int:
    if not stat.S_ISREG(st.st_mode):
        raise InputFileError(path, mode_text(st.st_mode), flag)
    if kind.max_bytes is not None and st.st_size > kind.max_bytes:
        size = size_text(st.st_size) + (f" ({st.st_size} bytes)" if st.st_size >= KiB else "")
        raise InputFileError(path, f"is {size}; {kind.name} files may have at most {size_text(kind.max_bytes)}",
                             flag)
    return st.st_size


def check_input_file(path: str | os.PathLike[str], kind: InputKind, flag: str | None = None) -> int:
    """Refuse ``path`` unless it is a regular file (symlinks followed) within ``kind``'s size; its size. For a
    file that other code opens by name: llama.cpp's loader, gguf-py."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise InputFileError(path, _stat_error_text(path, exc), flag) from None
    return _check_stat(path, st, kind, flag)


def present(path: str | os.PathLike[str]) -> bool:
    """Whether anything is at ``path``, even a link that leads nowhere: an optional file is skipped only when
    this is false, and whatever is there must be a usable file."""
    return os.path.lexists(path)


def open_input_fd(path: str | os.PathLike[str], kind: InputKind, flag: str | None = None) -> int:
    """A read-only descriptor of the regular file at ``path`` (checked before and after the open); the caller
    closes it."""
    check_input_file(path, kind, flag)  # before the open: a device is never opened
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise InputFileError(path, _stat_error_text(path, exc), flag) from None
    try:
        _check_stat(path, os.fstat(fd), kind, flag)  # what was opened, if the path changed since
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_input(path: str | os.PathLike[str], kind: InputKind, flag: str | None = None) -> BinaryIO:
    """The regular file at ``path``, open for binary reading (``open_input_fd``)."""
    return os.fdopen(open_input_fd(path, kind, flag), "rb")


def read_input_bytes(path: str | os.PathLike[str], kind: InputKind, flag: str | None = None) -> bytes:
    """The whole file, at most ``kind.max_bytes`` (a file that grew past it while read is refused too)."""
    with open_input(path, kind, flag) as f:
        limit = kind.max_bytes
        try:
            if limit is None:
                return f.read()
            # in chunks: read(limit + 1) would reserve the whole cap first, whatever the file's size
            chunks, size = [], 0
            while size <= limit and (chunk := f.read(min(READ_CHUNK, limit + 1 - size))):
                chunks.append(chunk)
                size += len(chunk)
        except OSError as exc:
            raise InputFileError(path, f"cannot be read ({exc.strerror or exc})", flag) from None
    if size > limit:
        raise InputFileError(path, f"grew while it was read, past the {size_text(limit)} {kind.name} files may "
                                   "have", flag)
    return b"".join(chunks)


def read_input_text(path: str | os.PathLike[str], kind: InputKind, flag: str | None = None) -> str:
    """The file as UTF-8 text, newlines read as ``open()`` in text mode reads them ("\\r\\n" and "\\r" as
    "\\n")."""
    data = read_input_bytes(path, kind, flag)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputFileError(path, f"is not UTF-8 text (byte {exc.start})", flag) from None
    return text.replace("\r\n", "\n").replace("\r", "\n") if "\r" in text else text


def read_json(path: Path, kind: InputKind = CONFIG, flag: str | None = None) -> Any:
    """The JSON value in ``path``; InputFileError (one line, naming the file) when it is no readable file of
    ``kind``, not UTF-8 JSON, or nests too deeply for the parser."""
    try:
        text = read_input_bytes(path, kind, flag).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputFileError(path, f"is not valid JSON ({exc})", flag) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputFileError(path, f"is not valid JSON ({exc})", flag) from None
    except ValueError:  # an integer of more digits than CPython converts
        raise InputFileError(path, long_integer_reason(text), flag) from None
    except RecursionError:
        raise InputFileError(path, "nests JSON arrays or objects too deeply to be read", flag) from None


def check_input_dir(path: str | os.PathLike[str], expected: str, flag: str | None = None) -> None:
    """Refuse ``path`` unless it is a directory (symlinks followed); ``expected`` says which, e.g. "a Hugging
    Face checkpoint"."""
    try:
        st = os.stat(path)
    except OSError as exc:
        reason = _stat_error_text(path, exc)
        raise InputFileError(path, ("no such directory" if reason.startswith("no such file") else reason)
                             + f" (expected {expected})", flag) from None
    if not stat.S_ISDIR(st.st_mode):
        reason = "is a file" if stat.S_ISREG(st.st_mode) else mode_text(st.st_mode).split(",")[0]
        raise InputFileError(path, f"{reason}, not a directory (expected {expected})", flag)
