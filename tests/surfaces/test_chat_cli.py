"""`clover-cpp chat` (docs/serve.md) driven through a pseudo-terminal with pexpect.

A two-turn conversation with /think toggling, /mode, /block and /stats, each answer checked against the
reference (the conversation rendered with the checkpoint's template, decoded greedily by clover_ref);
Ctrl-C during a generation stops the answer and the chat goes on; --visual redraws the canvas.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.chat import ChatProcess, Reference
from clover_dev.convert import clover_convert
from tests.support.tmp import MkTemp

pytestmark = pytest.mark.native  # every test here runs the native build (skipped without it; a failure in CI)

STATS = r"TPF [0-9.]+, prefill \d+ tokens, stop: \w+"


@pytest.fixture(scope="module")
def gguf(tiny_checkpoint: Path, module_tmp: MkTemp) -> Path:
    return clover_convert(tiny_checkpoint, module_tmp("chat") / "tiny.gguf", "f32")


@pytest.fixture(scope="module")
def ref(tiny_checkpoint: Path, tiny_model: Any) -> Reference:
    return Reference(tiny_checkpoint, tiny_model)


@pytest.fixture
def chat_factory(gguf: Path) -> Iterator[Any]:
    started: list[ChatProcess] = []

    def make(*args: str) -> ChatProcess:
        started.append(ChatProcess(gguf, *args))
        return started[-1]

    yield make
    for c in started:
        c.kill()


def _assistant(parsed: Any) -> dict[str, Any]:
    """The assistant message the chat keeps after a turn."""
    msg: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.reasoning:
        msg["reasoning_content"] = parsed.reasoning
    return msg


def test_two_turns_with_think_toggling(chat_factory: Any, ref: Reference) -> None:
    chat = chat_factory("--mode", "ar", "-n", "12")
    # turn 1: thinking on (the default), ar
    first = [{"role": "user", "content": "hello"}]
    want1 = ref.chat(first, "ar", 12, thinking=True)
    assert want1.parsed.reasoning and not want1.parsed.content
    out1 = chat.send("hello")
    assert f"<think>\n{want1.parsed.reasoning}\n</think>\n" in out1, out1
    assert re.search(r"\[ar\] 12 tokens, [0-9.]+ tok/s, TPF 1\.00, prefill %d tokens, [0-9]+ threads?, stop: length"
                     % len(want1.prompt_ids), out1), out1
    # toggles
    assert "thinking off" in chat.send("/think off")
    assert "mode spec" in chat.send("/mode spec")
    assert "block size 4" in chat.send("/block 4")
    assert "error:" in chat.send("/block 999")
    assert "error:" in chat.send("/mode beam")
    # turn 2: thinking off, spec B=4, the whole conversation re-rendered
    second = first + [_assistant(want1.parsed), {"role": "user", "content": "again"}]
    want2 = ref.chat(second, "spec", 12, thinking=False, block_size=4)
    assert want2.prompt_text.endswith("<think>\n\n</think>\n\n") and want2.parsed.content
    out2 = chat.send("again")
    assert f"again\n{want2.parsed.content}\n[spec B=4 threshold=0.9]" in out2, out2
    assert "<think>" not in out2
    # turn 2 prefills only what follows turn 1's prompt (its answer is re-rendered): the rest is reused
    line = re.search(r"12 tokens, .*prefill (\d+) tokens \((\d+) reused\), [0-9]+ threads?, stop: length", out2)
    assert line, out2
    assert int(line.group(1)) + int(line.group(2)) == len(want2.prompt_ids) and int(line.group(2)) > 0
    stats = chat.send("/stats")
    assert re.search(r"mode\s+spec", stats) and re.search(r"generated_tokens\s+12", stats), stats
    assert "session: 2 answers, 24 tokens" in stats, stats
    assert "/think on|off" in chat.send("/help")
    assert "conversation cleared" in chat.send("/reset")
    assert chat.close() == 0


def test_ctrl_c_stops_the_answer_not_the_app(chat_factory: Any) -> None:
    chat = chat_factory("--mode", "diffusion", "--block-size", "16", "--threshold", "1", "-n", "4000",
                        "--ignore-eos")  # about a minute per answer on one core
    for turn in ("go", "and again"):
        chat.child.sendline(turn)
        chat.child.expect("<think>\r\n")
        chat.child.expect(r"\S")  # the answer is streaming
        chat.child.sendintr()
        out = chat.prompt()
        assert "[interrupted]" in out, out
        assert re.search(r"\[diffusion B=16 threshold=1\] \d+ tokens, .*stop: interrupted", out), out
        tokens = int(re.search(r"\] (\d+) tokens", out).group(1))
        assert 0 < tokens < 4000
        assert re.search(r"stop_reason\s+cancelled", chat.send("/stats"))
    # Ctrl-C at the prompt does not leave either
    chat.child.sendintr()
    assert "Ctrl-D quits" in chat.prompt()
    assert "thinking on" in chat.send("/think")
    assert chat.close() == 0


def test_visual_mode_redraws_the_canvas(chat_factory: Any, ref: Reference) -> None:
    chat = chat_factory("--visual", "--mode", "diffusion", "--block-size", "8", "--threshold", "0.006", "-n", "16",
                        "--think", "off")
    want = ref.chat([{"role": "user", "content": "hi"}], "diffusion", 16, thinking=False, block_size=8,
                    threshold=0.006)
    out = chat.send("hi")
    frames = out.split("\x1b[H\x1b[2J")
    steps = [f for f in frames if re.search(r"\] step \d+, \d+ tokens", f)]
    assert len(steps) >= want.stats.block_passes, out  # one frame per step, one per committed block
    assert any("_" in f for f in steps)  # masked targets are drawn as '_'
    final = frames[-1]  # the answer as a normal turn, then the stats line
    assert f"> hi\n{want.parsed.content}\n[diffusion B=8 threshold=0.006]" in final, final
    assert chat.close() == 0
