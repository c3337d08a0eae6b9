"""``tokenizer.*`` keys: the gpt2 BPE vocabulary with pre-tokenizer ``qwen35``, as llama.cpp writes it.

The token list follows ``TextModel.get_vocab_base`` of the vendored converter: ids missing from the tokenizer
are padded with ``[PAD{i}]`` (UNUSED) up to the config's vocab_size, added special tokens are CONTROL,
other added tokens USER_DEFINED. Token texts must be unique (llama.cpp refuses a vocabulary with two equal
ones): a tokenizer that gives two ids one text is refused, naming both, and where a real token's text is
``[PAD{i}]`` the filler of id i is ``[PAD{i}.1]`` instead (the vendored converter would write the duplicate).
It reads tokenizer.json with the ``tokenizers`` library instead of transformers' AutoTokenizer. The
pre-tokenizer is not detected by hash (our test tokenizers are not in llama.cpp's list): it is always
``qwen35``, with a warning when the split regex is not Qwen3.5's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGUFWriter, TokenType
from tokenizers import Tokenizer

from clover_common.errors import CloverInputError
from clover_common.input_files import TOKENIZER, present, read_input_text, read_json
from clover_common.long_numbers import shown
from clover_common.tokenizer import PRETOKENIZE_REGEX

from .special_vocab import SpecialVocab, load_special_vocab

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
PRE_TOKENIZER = "qwen35"


@dataclass
class TokenizerKeys:
    tokens: list[str]
    token_types: list[int]
    special: SpecialVocab


def looks_special(token: str) -> bool:
    """``TextModel.does_token_look_special``: added tokens that should be CONTROL even if not flagged special."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<｜") and token.endswith("｜>"))
            or (token.startswith("<unused") and token.endswith(">")))


def read_tokenizer_keys(model_dir: Path, vocab_size: int, mask_token_id: int) -> TokenizerKeys:
    path = model_dir / TOKENIZER_FILE
    if not present(path):
        raise CloverInputError(path, "not found; clover-convert needs the Hugging Face tokenizer (tokenizer.json)")
    text = read_input_text(path, TOKENIZER)
    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as exc:  # the tokenizers library raises plain Exceptions for bad files
        raise CloverInputError(path, f"cannot be loaded by the tokenizers library ({exc})") from None
    _check_tokenizer_json(path)
    tokens, token_types = _token_list(tokenizer, vocab_size, path)
    special = load_special_vocab(model_dir)
    if not special.merges:
        raise CloverInputError(path, "has no BPE merges; llama.cpp cannot load a gpt2 vocabulary without them",
                               field="model.merges")
    found = special.special_token_ids.get("mask")
    if found is not None and found != mask_token_id:
        log.warning("the tokenizer's mask token is id %d but config.json's mask_token_id is %d; writing %d",
                    found, mask_token_id, mask_token_id)
    special.special_token_ids["mask"] = mask_token_id
    if token_types[mask_token_id] == TokenType.UNUSED:
        log.warning("mask_token_id %d is not a token of %s (it is padding)", mask_token_id, path)
    return TokenizerKeys(tokens, token_types, special)


def _token_list(tokenizer: Tokenizer, vocab_size: int, path: Path) -> tuple[list[str], list[int]]:
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    largest = max(vocab.values(), default=-1)
    if largest >= vocab_size:
        raise CloverInputError(path, f"has token id {largest}, but config.json's vocab_size is {vocab_size}")
    by_id = {token_id: token for token, token_id in vocab.items()}
    added = tokenizer.get_added_tokens_decoder()
    tokens: list[str | None] = []  # None: padding, named once every real text is known
    types: list[int] = []
    for i in range(vocab_size):
        token = by_id.get(i)
        if token is None:
            tokens.append(None)
            types.append(TokenType.UNUSED)
        elif i in added:
            if not added[i].normalized:  # llama.cpp expects added tokens pre-normalized
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False).ids,
                                         skip_special_tokens=False)
            if added[i].special or looks_special(token):
                types.append(TokenType.CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(TokenType.USER_DEFINED)
            tokens.append(token)
        else:
            tokens.append(token)
            types.append(TokenType.NORMAL)
    return _with_fillers(tokens, path), [int(t) for t in types]


def _with_fillers(tokens: list[str | None], path: Path) -> list[str]:
    """``tokens`` with each padding id i named ``[PAD{i}]``, or ``[PAD{i}.1]``, ``[PAD{i}.2]``, ... when a real
    token has that text; CloverInputError naming both ids when two real tokens have one text (llama.cpp's
    normalization of added tokens can make two)."""
    first: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if token is not None and (j := first.setdefault(token, i)) != i:
            raise CloverInputError(path, f"gives tokens {j} and {i} the same text {shown(token)} (after llama.cpp's "
                                         "normalization of added tokens): llama.cpp cannot load a vocabulary with "
                                         "two equal token texts")
    out: list[str] = []
    for i, token in enumerate(tokens):
        if token is None:
            token = f"[PAD{i}]"
            suffix = 0
            while token in first:
                suffix += 1
                token = f"[PAD{i}.{suffix}]"
            if suffix:
                log.warning("%s: token %d has the text '[PAD%d]', so the filler of the unused id %d is %r",
                            path, first[f"[PAD{i}]"], i, i, token)
        out.append(token)
    return out


def _split_regexes(node: Any) -> list[str]:
    if not isinstance(node, dict):
        return []
    if node.get("type") == "Split":
        pattern = node.get("pattern", {})
        return [pattern["Regex"]] if isinstance(pattern, dict) and "Regex" in pattern else []
    return [r for child in node.get("pretokenizers", []) for r in _split_regexes(child)]


def _check_tokenizer_json(path: Path) -> None:
    """What the tokenizers library does not check: token texts that two ids share (refused), and the
    pre-tokenizer's split regex (a warning)."""
    data = read_json(path, TOKENIZER)
    if not isinstance(data, dict):
        return  # the tokenizers library has refused it already
    _check_unique_texts(data, path)
    if PRETOKENIZE_REGEX not in _split_regexes(data.get("pre_tokenizer")):
        log.warning("%s does not use Qwen3.5's split regex; the GGUF still declares pre-tokenizer '%s', so "
                    "llama.cpp may tokenize differently", path, PRE_TOKENIZER)


def _check_unique_texts(data: dict[str, Any], path: Path) -> None:
    """Refuse a tokenizer.json whose ``model.vocab`` and ``added_tokens`` give two ids one text (the tokenizers
    library keeps one of them and the other id silently becomes padding), naming both ids."""
    model = data.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    owner: dict[str, tuple[object, str]] = {}  # text -> (id, where)
    if isinstance(vocab, dict):
        owner.update((text, (token_id, "model.vocab")) for text, token_id in vocab.items())
    added = data.get("added_tokens")
    for entry in added if isinstance(added, list) else []:
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
            continue
        text, token_id = entry["content"], entry.get("id")
        other, where = owner.setdefault(text, (token_id, "added_tokens"))
        if other != token_id:
            raise CloverInputError(path, f"gives token {shown(token_id)} the text {shown(text)}, which token "
                                         f"{shown(other)} ({where}) has too: llama.cpp cannot load a vocabulary with "
                                         "two equal token texts", field="added_tokens")


def add_tokenizer_keys(writer: GGUFWriter, keys: TokenizerKeys) -> None:
    """The keys in the order ``_set_vocab_gpt2`` and ``SpecialVocab.add_to_gguf`` write them."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(PRE_TOKENIZER)
    writer.add_token_list(keys.tokens)
    writer.add_token_types(keys.token_types)
    special = keys.special
    writer.add_token_merges(special.merges)
    for typ, token_id in special.special_token_ids.items():
        handler = getattr(writer, f"add_{typ}_token_id", None)
        if handler is None:
            log.warning("no GGUF key for special token type %s (id %d); skipped", typ, token_id)
            continue
        handler(token_id)
    for typ, value in special.add_special_token.items():
        handler = getattr(writer, f"add_add_{typ}_token", None)
        if handler is not None:
            handler(value)
    if special.chat_template is not None:
        writer.add_chat_template(special.chat_template)
