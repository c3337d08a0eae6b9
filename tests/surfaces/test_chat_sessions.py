"""Chat sessions: `clover-cpp chat`'s /save FILE and /load FILE (clover_cpp/session.py).

A session saved after two turns and loaded into a fresh chat resumes without prefilling the conversation, and
its third answer is token for token the third answer of the uninterrupted chat (greedy ar). A truncated,
corrupted or foreign file is refused with one error line naming the file and the field, and the chat goes on
with its conversation untouched; a /save that cannot write leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import struct
from pathlib import Path
from typing import Any

import pytest

from tests.support.chat import ChatProcess
from clover_dev.convert import clover_convert
from tests.support.tmp import MkTemp

pytestmark = pytest.mark.native  # every test here runs the native build (skipped without it; a failure in CI)

TURNS = ("hello", "again", "and a third one")


@pytest.fixture(scope="module")
def gguf(tiny_checkpoint: Path, module_tmp: MkTemp) -> Path:
    return clover_convert(tiny_checkpoint, module_tmp("sessions") / "tiny.gguf", "f32")


@pytest.fixture(scope="module")
def other_gguf(module_tmp: MkTemp) -> Path:
    """The same preset and vocabulary with other weights (seed 1): a session from it must be refused."""
    from clover_ref.factory import init_checkpoint

    ck = module_tmp("tiny-seed1")
    init_checkpoint(ck, "tiny", seed=1)
    return clover_convert(ck, module_tmp("sessions-other") / "tiny.gguf", "f32")


class App:
    """A ChatApp in this process (greedy ar, 12 tokens a turn) that records each turn's tokens."""

    def __init__(self, gguf: Path, n_ctx: int = 1024) -> None:
        from clover_cpp import Model
        from clover_cpp.chat import ChatApp, Settings
        from clover_cpp.gen_params import GenParams
        from clover_cpp.chat_format import ChatTemplates

        self.model = Model(gguf, n_ctx=n_ctx, n_threads=1, cache_ram_mib=64)
        self.out = io.StringIO()
        self.turns: list[Any] = []
        recorder = self

        class Recording(ChatApp):
            def _generate(self, *args: Any, **kwargs: Any) -> Any:
                turn = super()._generate(*args, **kwargs)
                recorder.turns.append(turn)
                return turn

        self.app = Recording(self.model, ChatTemplates.load(self.model.llama_model, str(gguf), None),
                             Settings(GenParams(mode="ar", max_tokens=12)), self.model.max_block_size, self.out)

    def said(self, line: str) -> str:
        """Run a line (a message or a /command); returns what the app printed."""
        start = self.out.tell()
        if line.startswith("/"):
            self.app.command(line)
        else:
            self.app.answer(line)
        return self.out.getvalue()[start:]

    def close(self) -> None:
        self.model.close()


@pytest.fixture
def apps() -> Any:
    made: list[App] = []

    def make(path: Path, **kw: Any) -> App:
        made.append(App(path, **kw))
        return made[-1]

    yield make
    for a in made:
        a.close()


def _uninterrupted(apps: Any, gguf: Path) -> list[Any]:
    a = apps(gguf)
    for t in TURNS:
        a.said(t)
    return a.turns


def _saved(apps: Any, gguf: Path, path: Path) -> App:
    b = apps(gguf)
    for t in TURNS[:2]:
        b.said(t)
    out = b.said(f"/save {path}")
    assert re.search(r"saved .*: 4 messages, \d+ tokens of engine state", out), out
    return b


def test_a_loaded_session_continues_like_the_uninterrupted_chat(apps: Any, gguf: Path, tmp_path: Path) -> None:
    want = _uninterrupted(apps, gguf)
    path = tmp_path / "s.clover"
    b = _saved(apps, gguf, path)
    # the saving chat goes on as if nothing happened
    b.said(TURNS[2])
    assert b.turns[2].tokens == want[2].tokens and b.turns[2].reused == want[2].reused
    # a fresh engine: load, then the third turn
    c = apps(gguf)
    out = c.said(f"/load {path}")
    assert re.search(r"loaded .*: 4 messages, \d+ tokens of history restored \(mode ar, thinking on\)", out), out
    assert c.app.messages == b.app.messages[:4]
    n = int(re.search(r"(\d+) tokens of history", out).group(1))
    assert c.model.n_past == n > 0
    out = c.said(TURNS[2])
    got = c.turns[0]
    assert got.tokens == want[2].tokens  # token for token
    assert got.reused == want[2].reused == n  # no full prefill: the prompt up to the last answer is reused
    assert got.stats.prompt_tokens == want[2].stats.prompt_tokens  # the same prefill as the uninterrupted chat
    assert f"({n} reused)" in out, out


def _parts(data: bytes) -> tuple[dict[str, Any], bytes]:
    from clover_cpp import session

    _, _, n, _ = session.PREFIX.unpack_from(data)
    start = session.PREFIX.size
    return json.loads(data[start:start + n]), data[start + n:]


def _repack(header: dict[str, Any], blob: bytes) -> bytes:
    """A well-formed container (valid header checksum) around any header."""
    from clover_cpp import session

    raw = json.dumps(header).encode()
    prefix = session.PREFIX.pack(session.MAGIC, session.FORMAT_VERSION, len(raw), hashlib.sha256(raw).digest())
    return prefix + raw + blob


def _variants(good: bytes) -> dict[str, tuple[bytes, str]]:
    """name -> (file contents, the field the error must name)"""
    from clover_cpp import session

    header, blob = _parts(good)
    hstart = session.PREFIX.size
    flipped_header = bytearray(good)
    flipped_header[hstart + 40] ^= 0x04
    flipped_blob = bytearray(good)
    flipped_blob[-7] ^= 0x01
    return {
        "truncated": (good[:-100], "state.bytes"),
        "truncated-header": (good[:hstart + 20], "header length"),
        "truncated-prefix": (good[:20], "prefix"),
        "empty": (b"", "magic"),
        "flipped-header-byte": (bytes(flipped_header), "header checksum"),
        "flipped-state-byte": (bytes(flipped_blob), "state.sha256"),
        "wrong-magic": (b"GGUF\x03\x00\x00\x00" + good[8:], "magic"),
        "future-version": (good[:8] + struct.pack("<I", 99) + good[12:], "format version"),
        "huge-header-length": (good[:12] + struct.pack("<I", 0xFFFFFFF0) + good[16:], "header length"),
        "header-past-the-end": (good[:12] + struct.pack("<I", len(good)) + good[16:], "header length"),
        "blob-longer-than-file": (_repack(header | {"state": header["state"] | {"bytes": len(blob) + 4096}}, blob),
                                  "state.bytes"),
        "not-json": (session.PREFIX.pack(session.MAGIC, session.FORMAT_VERSION, 5, hashlib.sha256(b"{oops").digest())
                     + b"{oops" + blob, "header"),
        "other-clover-version": (_repack(header | {"clover_version": "0.0.1"}, blob), "clover_version"),
        "tokens-outside-vocab": (_repack(header | {"tokens": [10**9] * len(header["tokens"])}, blob), "tokens"),
        "n_past-mismatch": (_repack(header | {"n_past": header["n_past"] + 1}, blob), "n_past"),
        "bad-mode": (_repack(header | {"chat": header["chat"] | {"mode": "beam"}}, blob), "chat.mode"),
        "bad-message": (_repack(header | {"messages": [{"role": "tool", "content": 3}]}, blob), "messages.0"),
    }


def test_bad_session_files_get_one_clean_error_and_the_chat_goes_on(apps: Any, gguf: Path, other_gguf: Path,
                                                                      tmp_path: Path) -> None:
    good = tmp_path / "good.clover"
    _saved(apps, gguf, good).close()
    other = tmp_path / "other-model.clover"
    _saved(apps, other_gguf, other).close()
    cases = _variants(good.read_bytes())
    cases["other-model"] = (other.read_bytes(), "model")

    c = apps(gguf)
    c.said("hello")
    messages, n_past = [dict(m) for m in c.app.messages], c.model.n_past
    for name, (data, field) in cases.items():
        path = tmp_path / f"{name}.clover"
        path.write_bytes(data)
        out = c.said(f"/load {path}")
        assert out.count("\n") == 1 and out.startswith(f"error: {path}: {field}: "), (name, out)
        assert c.app.messages == messages and c.model.n_past == n_past, name  # nothing was touched
    missing = tmp_path / "missing.clover"
    assert c.said(f"/load {missing}").startswith(f"error: {missing}: cannot read: ")
    assert "usage: /load FILE" in c.said("/load")
    # the model's identity names both files
    out = c.said(f"/load {other}")
    assert "saved with tiny.gguf" in out and "fingerprint" in out, out
    # the conversation goes on, its history reused
    c.said("again")
    assert c.turns[-1].reused > 0 and len(c.app.messages) == 4


def test_a_session_too_long_for_the_context_is_refused(apps: Any, gguf: Path, tmp_path: Path) -> None:
    path = tmp_path / "s.clover"
    _saved(apps, gguf, path).close()
    header, blob = _parts(path.read_bytes())
    long = tmp_path / "long.clover"
    long.write_bytes(_repack(header | {"tokens": [1] * 300, "n_past": 300}, blob))
    small = apps(gguf, n_ctx=256)
    small.said("hello")
    n_past = small.model.n_past
    out = small.said(f"/load {long}")
    assert out == (f"error: {long}: n_past: a history of 300 tokens does not fit this chat's context (256); "
                   "start the chat with a larger -c\n"), out
    assert small.model.n_past == n_past


def test_save_that_cannot_write_leaves_nothing_behind(apps: Any, gguf: Path, tmp_path: Path) -> None:
    a = apps(gguf)
    a.said("hello")
    target = tmp_path / "no" / "such" / "dir" / "s.clover"
    out = a.said(f"/save {target}")
    assert out.count("\n") == 1 and out.startswith(f"error: {target}: cannot write: "), out
    assert not (tmp_path / "no").exists()
    # the rename fails (the target is a folder): the temporary file is removed
    folder = tmp_path / "a-folder"
    folder.mkdir()
    out = a.said(f"/save {folder}")
    assert out.startswith(f"error: {folder}: cannot write: "), out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-folder"] and not any(folder.iterdir())
    assert "usage: /save FILE" in a.said("/save")
    # the conversation goes on
    a.said("again")
    assert a.turns[-1].reused > 0


# ------------------------------------------------------------------------------------------------ the CLI
def Chat(gguf: Path, *args: str) -> ChatProcess:
    return ChatProcess(gguf, "--mode", "ar", "-n", "12", *args)


def _answer(out: str) -> tuple[str, str]:
    """(the answer text, its stats line) from what a turn printed."""
    lines = out.split("\n")[1:]  # the echoed input first
    i = next(k for k, line in enumerate(lines) if line.startswith("[ar] "))
    return "\n".join(lines[:i]), lines[i]


def test_chat_cli_save_and_load(gguf: Path, tmp_path: Path) -> None:
    path = tmp_path / "chat.clover"
    a = Chat(gguf)
    outs = [a.send(t) for t in TURNS]
    assert a.close() == 0
    b = Chat(gguf)
    for t in TURNS[:2]:
        b.send(t)
    assert "saved" in b.send(f"/save {path}")
    assert "/save FILE" in b.send("/help")
    assert b.close() == 0

    c = Chat(gguf)
    corrupt = tmp_path / "corrupt.clover"
    data = bytearray(path.read_bytes())
    data[100] ^= 0x20
    corrupt.write_bytes(bytes(data))
    out = c.send(f"/load {corrupt}")
    assert out.strip().split("\n")[1:] == [f"error: {corrupt}: header checksum: the header does not match its "
                                           "SHA-256 (the file is corrupted)"], out
    assert "loaded" in c.send(f"/load {path}")
    out = c.send(TURNS[2])
    assert "Traceback" not in out
    text, stats = _answer(out)
    want_text, want_stats = _answer(outs[2])
    assert text == want_text
    reused = re.search(r"prefill (\d+) tokens \((\d+) reused\)", stats)
    assert reused and reused.groups() == re.search(r"prefill (\d+) tokens \((\d+) reused\)", want_stats).groups()
    assert c.close() == 0
