"""Chat session files: a conversation and the engine's history state (`clover-cpp chat`'s /save and /load).

A session resumes a long conversation without prefilling it again: besides the messages it holds the state of
the engine's history sequence (llama.cpp's full sequence state: attention KV entries and Gated DeltaNet
recurrent state, ``llama_state_seq_get_data``) and the tokens that state covers.

Layout (little-endian), written atomically (a temporary file in the same folder, then a rename)::

    magic      8 bytes   b"CLVRSESS"
    version    u32       FORMAT_VERSION
    header_len u32       bytes of the JSON header (at most MAX_HEADER)
    digest     32 bytes  SHA-256 of the header
    header     JSON      (UTF-8) format, clover version, model identity, engine, chat settings, messages,
                         history tokens, state length and SHA-256
    state      bytes     the engine state blob (state.bytes of them, to the end of the file)

Reading checks each part before using it, and every read length against the file's size before reading, so a
truncated, corrupted or foreign file is refused with one ``SessionError`` line naming the file and the field.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from clover_common.errors import BadInput
from clover_common.input_files import GGUF, SESSION, InputFileError, open_input

from .gen_params import PARAMS

MAGIC = b"CLVRSESS"
FORMAT_VERSION = 1
PREFIX = struct.Struct("<8sII32s")  # magic, version, header length, header SHA-256
MAX_HEADER = 256 * 2**20            # a header longer than this is not one we wrote
FINGERPRINT_SAMPLES = 16
FINGERPRINT_CHUNK = 64 * 1024
FINGERPRINT_HEAD = 2**20


class SessionError(BadInput):
    """A session file that cannot be written or read: one line, naming the file and the field."""


def toolkit_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("clover-toolkit")
    except metadata.PackageNotFoundError:
        return "unknown"


def gguf_fingerprint(path: str | os.PathLike[str]) -> str:
    """SHA-256 of a GGUF's size, its first MiB (the header and metadata) and 16 evenly spaced 64 KiB samples of the
    rest (the weights): cheap on a file of many GB, and different for another checkpoint or another conversion."""
    h = hashlib.sha256()
    with open_input(path, GGUF) as f:
        size = os.fstat(f.fileno()).st_size
        h.update(struct.pack("<Q", size))
        h.update(f.read(FINGERPRINT_HEAD))
        for k in range(FINGERPRINT_SAMPLES + 1):
            f.seek(min(size, FINGERPRINT_HEAD + (max(0, size - FINGERPRINT_HEAD) * k) // FINGERPRINT_SAMPLES))
            h.update(f.read(FINGERPRINT_CHUNK))
    return h.hexdigest()


@dataclass
class Session:
    """What a session file holds, checked."""

    path: str
    header: dict[str, Any]
    messages: list[dict[str, Any]]
    settings: dict[str, Any]
    tokens: list[int]
    state: bytes


def pack(header: Mapping[str, Any], state: bytes) -> bytes:
    """The file's bytes for a header (``state`` gets its length and SHA-256 added) and a state blob."""
    header = dict(header) | {"state": {"bytes": len(state), "sha256": hashlib.sha256(state).hexdigest()}}
    raw = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return PREFIX.pack(MAGIC, FORMAT_VERSION, len(raw), hashlib.sha256(raw).digest()) + raw + state


def write(path: str | os.PathLike[str], header: Mapping[str, Any], state: bytes) -> int:
    """Write atomically: a temporary file next to ``path``, synced, then renamed over it; nothing is left behind
    on failure. Returns the bytes written."""
    target = Path(path).expanduser()
    folder = target.parent
    if not folder.is_dir():
        raise SessionError(f"{path}: cannot write: the folder {str(folder)!r} does not exist")
    data = pack(header, state)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise SessionError(f"{path}: cannot write: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except OSError as exc:
        _unlink(tmp)
        raise SessionError(f"{path}: cannot write: {exc.strerror or exc}") from None
    except BaseException:
        _unlink(tmp)
        raise
    return len(data)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def read(path: str | os.PathLike[str], identity: Mapping[str, Any], n_ctx: int, n_vocab: int,
         modes: Sequence[str]) -> Session:
    """Read and check a session for this model (``identity``, see ``model_identity``) and context size."""
    name = str(path)

    def bad(field: str, problem: str) -> SessionError:
        return SessionError(f"{name}: {field}: {problem}")

    try:
        f = open_input(Path(path).expanduser(), SESSION)  # a regular file: never a fifo's wait
    except InputFileError as exc:
        raise SessionError(f"{name}: cannot read: {exc.reason}") from None
    with f:
        size = os.fstat(f.fileno()).st_size

        def take(n: int, field: str) -> bytes:
            # every read is checked against the file's size first
            if n < 0 or f.tell() + n > size:
                raise bad(field, f"the file ends after {size} bytes, {f.tell() + n - size} bytes short (truncated?)")
            data = f.read(n)
            if len(data) != n:
                raise bad(field, "the file changed while it was read")
            return data

        if size < len(MAGIC) or f.read(len(MAGIC)) != MAGIC:
            raise bad("magic", "not a clover chat session file")
        f.seek(0)
        magic, version, header_len, digest = PREFIX.unpack(take(PREFIX.size, "prefix"))
        if version != FORMAT_VERSION:
            raise bad("format version", f"version {version}, this clover-cpp reads version {FORMAT_VERSION}")
        if header_len > MAX_HEADER:
            raise bad("header length", f"{header_len} bytes is more than a session header can hold")
        raw = take(header_len, "header length")
        if hashlib.sha256(raw).digest() != digest:
            raise bad("header checksum", "the header does not match its SHA-256 (the file is corrupted)")
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise bad("header", f"not valid JSON ({exc})") from None
        if not isinstance(header, dict):
            raise bad("header", "not a JSON object")
        if header.get("format") != FORMAT_VERSION:
            raise bad("format", f"{header.get('format')!r}, expected {FORMAT_VERSION}")
        saved_by, running = header.get("clover_version"), toolkit_version()
        if saved_by != running:
            raise bad("clover_version", f"saved by clover {saved_by}, this is clover {running}")
        _check_model(header.get("model"), identity, bad)
        settings = _check_settings(header.get("chat"), modes, bad)
        messages = _check_messages(header.get("messages"), bad)
        tokens = header.get("tokens")
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise bad("tokens", "not a list of token ids")
        outside = [t for t in tokens if not 0 <= t < n_vocab]
        if outside:
            raise bad("tokens", f"ids outside the vocabulary [0, {n_vocab}): {outside[:5]}")
        if header.get("n_past") != len(tokens):
            raise bad("n_past", f"{header.get('n_past')!r}, but the history holds {len(tokens)} tokens")
        if len(tokens) + 1 > n_ctx:
            raise bad("n_past", f"a history of {len(tokens)} tokens does not fit this chat's context ({n_ctx}); "
                                "start the chat with a larger -c")
        state = header.get("state")
        if (not isinstance(state, dict) or type(state.get("bytes")) is not int
                or not isinstance(state.get("sha256"), str)):
            raise bad("state", "missing its length and checksum")
        left = size - f.tell()
        if state["bytes"] != left:
            raise bad("state.bytes", f"the header announces {state['bytes']} bytes of engine state, "
                                     f"the file holds {left} after the header"
                                     + (" (truncated?)" if left < state["bytes"] else ""))
        if (state["bytes"] == 0) != (not tokens):
            raise bad("state.bytes", "an engine state without history tokens, or tokens without a state")
        blob = take(state["bytes"], "state.bytes")
        if hashlib.sha256(blob).hexdigest() != state["sha256"]:
            raise bad("state.sha256", "the engine state does not match its checksum (the file is corrupted)")
    return Session(name, header, messages, settings, tokens, blob)


def _check_model(saved: Any, identity: Mapping[str, Any], bad: Any) -> None:
    if not isinstance(saved, dict) or not isinstance(saved.get("fingerprint"), str):
        raise bad("model", "no model identity")
    if saved["fingerprint"] != identity["fingerprint"]:
        def says(m: Mapping[str, Any]) -> str:
            fingerprint = str(m.get("fingerprint"))[:12]
            return f"{m.get('file')} ({m.get('desc')}, {m.get('size')} bytes, fingerprint {fingerprint})"
        raise bad("model", f"saved with {says(saved)}, this chat runs {says(identity)}")


def _check_settings(chat: Any, modes: Sequence[str], bad: Any) -> dict[str, Any]:
    if not isinstance(chat, dict):
        raise bad("chat", "not an object")
    if chat.get("mode") not in modes:
        raise bad("chat.mode", f"{chat.get('mode')!r} is not one of {', '.join(modes)}")
    b = chat.get("block_size")
    if b is not None and (type(b) is not int or not PARAMS["block_size"].bound.ok(b)):
        raise bad("chat.block_size", f"{b!r} is not a block size ({PARAMS['block_size'].bound.rule})")
    t = chat.get("threshold")
    if t is not None and (type(t) not in (int, float) or not PARAMS["threshold"].bound.ok(t)):
        raise bad("chat.threshold", f"{t!r} is not a threshold ({PARAMS['threshold'].bound.rule})")
    if type(chat.get("thinking")) is not bool:
        raise bad("chat.thinking", "not true or false")
    s = chat.get("system")
    if s is not None and not isinstance(s, str):
        raise bad("chat.system", "not a string")
    return {"mode": chat["mode"], "block_size": b, "threshold": None if t is None else float(t),
            "thinking": chat["thinking"], "system": s}


def _check_messages(messages: Any, bad: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        raise bad("messages", "not a list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
            raise bad(f"messages.{i}", "not a system, user or assistant message")
        if not all(isinstance(v, str) for k, v in m.items()) or not isinstance(m.get("content"), str):
            raise bad(f"messages.{i}", "not a message of text fields")
    return messages


def model_identity(model: Any) -> dict[str, Any]:
    """What ties a session to the GGUF it was saved with: the fingerprint decides, the rest names it."""
    import ctypes

    from clover_native import loader

    L = loader.llama()
    buf = ctypes.create_string_buffer(256)
    L.llama_model_desc(model.llama_model, buf, len(buf))
    return {"file": Path(model.path).name, "size": os.path.getsize(model.path),
            "fingerprint": gguf_fingerprint(model.path), "desc": buf.value.decode("utf-8", "replace"),
            "n_params": int(L.llama_model_n_params(model.llama_model)), "n_vocab": model.info.n_vocab}
