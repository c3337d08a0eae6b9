"""From committed token blocks to text pieces: incremental detokenization, stop strings, output parsing.

``TextPipeline.feed(block)`` returns the events the block completes; ``finish()`` flushes. The chat app runs
generated blocks through it, streamed or (``--visual``) all at once, and gets the same text either way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from .chat_format import TextEvent


class Parser(Protocol):
    """Splits the text into channels as it arrives (chat_format.AnswerParser)."""

    def feed(self, text: str) -> list[TextEvent]: ...

    def finish(self) -> list[TextEvent]: ...

REPLACEMENT = "\ufffd"
MAX_PENDING_TOKENS = 8  # a character never spans more tokens than this; beyond it the bytes are invalid


class Detokenizer:
    """Tokens to text piece by piece; an incomplete UTF-8 sequence at the end waits for the next tokens."""

    def __init__(self, detokenize: Callable[[Sequence[int]], str]) -> None:
        self._detokenize = detokenize
        self._pending: list[int] = []

    def feed(self, ids: Sequence[int]) -> str:
        self._pending.extend(ids)
        if not self._pending:
            return ""
        text = self._detokenize(self._pending)
        if text.endswith(REPLACEMENT) and len(self._pending) < MAX_PENDING_TOKENS:
            return ""
        self._pending = []
        return text

    def finish(self) -> str:
        text = self._detokenize(self._pending) if self._pending else ""
        self._pending = []
        return text


class StopMatcher:
    """Cuts the text at the first stop string; holds back a tail that could still become one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._buf = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self._buf + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self._buf = ""
            return buf[:min(hits)]
        keep = 0
        for s in self.stops:
            for n in range(min(len(buf), len(s) - 1), keep, -1):
                if buf.endswith(s[:n]):
                    keep = n
                    break
        self._buf = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]

    def finish(self) -> str:
        buf, self._buf = self._buf, ""
        return "" if self.stopped else buf


class TextPipeline:
    """Detokenizer -> stop strings -> (optional) answer parser. Without a parser every piece
    is a ``content`` event (raw completions)."""

    def __init__(self, detokenize: Callable[[Sequence[int]], str], stops: Sequence[str] = (),
                 parser: Parser | None = None) -> None:
        self.detok = Detokenizer(detokenize)
        self.stop = StopMatcher(stops)
        self.parser = parser

    @property
    def stopped(self) -> bool:
        """A stop string was found: the caller should cancel the generation."""
        return self.stop.stopped

    def _parse(self, text: str) -> list[TextEvent]:
        if self.parser is not None:
            return self.parser.feed(text)
        return [TextEvent("content", text)] if text else []

    def feed(self, block: Sequence[int]) -> list[TextEvent]:
        if self.stop.stopped:
            return []
        return self._parse(self.stop.feed(self.detok.feed(block)))

    def finish(self) -> list[TextEvent]:
        events = [] if self.stop.stopped else self._parse(self.stop.feed(self.detok.finish()))
        events += self._parse(self.stop.finish())
        if self.parser is not None:
            events += self.parser.finish()
        return events
