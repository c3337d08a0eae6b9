"""Logprobs in OpenAI's shapes: a chat choice's ``logprobs.content`` (token, logprob, bytes, top_logprobs) and a
text completion's ``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``. The values are spec 4's P
after bias, penalties and grammar, the same in ar, auto and spec; diffusion reports the confidence distribution
each token was filled from (docs/serve.md, "Logprobs")."""

from __future__ import annotations

from typing import Any, Sequence

from ..model import Model, TokenLogprob


def _token(model: Model, token: int) -> tuple[str, list[int]]:
    raw = model.token_piece(token)
    return raw.decode("utf-8", errors="replace"), list(raw)


def _chat_entries(model: Model, entries: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """``logprobs.content`` items of a chat choice (or of one streamed chunk)."""
    out = []
    for e in entries:
        text, raw = _token(model, e.token)
        top = []
        for t, lp in e.top:
            t_text, t_raw = _token(model, t)
            top.append({"token": t_text, "logprob": lp, "bytes": t_raw})
        out.append({"token": text, "logprob": e.logprob, "bytes": raw, "top_logprobs": top})
    return out


def chat_logprobs(model: Model, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    return {"content": _chat_entries(model, entries), "refusal": None}


def completion_logprobs(model: Model, entries: Sequence[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """A text completion choice's ``logprobs``; ``offset``: where the first token's text starts in the choice's
    text (after an echoed prompt)."""
    tokens, offsets, tops = [], [], []
    for e in entries:
        text, _ = _token(model, e.token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        tops.append({_token(model, t)[0]: lp for t, lp in e.top})
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
            "text_offset": offsets}
