"""llama-server's utility endpoints, with its request and response shapes (tools/server/README.md of the pinned
llama.cpp): ``POST /tokenize``, ``POST /detokenize`` and ``POST /apply-template``. None of them runs the model."""

from __future__ import annotations

from typing import Any

from ..model import Model
from .prepare import Preparer, check_unicode
from .schema import ApplyTemplateRequest, DetokenizeRequest, TokenizeRequest, invalid


def _piece(raw: bytes) -> str | list[int]:
    """A token's piece as llama-server gives it: the text when it is valid UTF-8, else its bytes."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def tokenize(model: Model, prep: Preparer, req: TokenizeRequest) -> dict[str, Any]:
    """``{"tokens": [ids]}``, or ``{"tokens": [{"id", "piece"}]}`` with ``with_pieces``."""
    check_unicode(req.content, "content")
    prep.check_chars(len(req.content), "content", "content")
    ids = model.tokenize(req.content, special=req.parse_special, add_special=req.add_special)
    if not req.with_pieces:
        return {"tokens": ids}
    return {"tokens": [{"id": t, "piece": _piece(model.token_piece(t))} for t in ids]}


def detokenize(model: Model, req: DetokenizeRequest) -> dict[str, Any]:
    """``{"content": text}``; special tokens are rendered, as llama-server's ``tokens_to_str`` does."""
    n_vocab = model.info.n_vocab
    for i, t in enumerate(req.tokens):
        if not 0 <= t < n_vocab:
            raise invalid(f"token {t} is not in the vocabulary (0 to {n_vocab - 1})", f"tokens[{i}]")
    return {"content": model.detokenize(req.tokens, special=True)}


def apply_template(prep: Preparer, req: ApplyTemplateRequest) -> dict[str, Any]:
    """``{"prompt": text}``: what a chat completion of these messages would run on."""
    return {"prompt": prep.apply_template(req)}
