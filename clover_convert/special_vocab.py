"""Merges, special-token ids, add_* flags and chat template of a Hugging Face tokenizer.

A port of ``SpecialVocab`` from the gguf-py inside the pinned llama.cpp tree (MIT licence), which differs
from the PyPI gguf 0.19.0 wheel's copy: a ``ByteLevel`` post-processor sets ``add_bos``/``add_eos`` to
false, and flags from the post-processor win over tokenizer_config.json. Porting it keeps our
``tokenizer.ggml.*`` keys equal to what llama.cpp's own converter writes. Normalizer flags (lowercase,
strip accents) are not ported: Qwen tokenizers use NFC, which maps to no key.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clover_common.errors import CloverInputError
from clover_common.input_files import CHAT_TEMPLATE, TOKENIZER, present, read_input_text, read_json

log = logging.getLogger(__name__)

SPECIAL_TOKEN_TYPES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")


@dataclass
class SpecialVocab:
    merges: list[str] = field(default_factory=list)
    special_token_ids: dict[str, int] = field(default_factory=dict)
    add_special_token: dict[str, bool] = field(default_factory=dict)
    chat_template: str | list[dict[str, str]] | None = None
    special_token_types: tuple[str, ...] = SPECIAL_TOKEN_TYPES


def load_special_vocab(model_dir: Path) -> SpecialVocab:
    vocab = SpecialVocab()
    _load_from_tokenizer_json(vocab, model_dir)
    _load_from_config_json(vocab, model_dir)
    return vocab


def _set_special_token(vocab: SpecialVocab, typ: str, token_id: Any) -> None:
    if not isinstance(token_id, int) or isinstance(token_id, bool):
        return
    if token_id < 0:
        raise CloverInputError(None, f"invalid value for special token type {typ}: {token_id}")
    vocab.special_token_ids.setdefault(typ, token_id)


def _merges(raw: Any, path: Path) -> list[str]:
    if not isinstance(raw, list) or not raw:
        return []
    if all(isinstance(m, str) for m in raw):
        return list(raw)
    if all(isinstance(m, list) and len(m) == 2 and all(isinstance(p, str) for p in m) for m in raw):
        # transformers >= 4.45 format; spaces inside a part are encoded as U+0120 like llama.cpp does
        return [" ".join("".join(chr(ord(ch) + 256) if ch == " " else ch for ch in part) for part in pair)
                for pair in raw]
    raise CloverInputError(path, "has merges in an unknown format", field="model.merges")


def _load_from_tokenizer_json(vocab: SpecialVocab, model_dir: Path) -> None:
    tokenizer_file = model_dir / "tokenizer.json"
    tokenizer = read_json(tokenizer_file, TOKENIZER) if present(tokenizer_file) else None
    added_tokens: list[dict[str, Any]] = []
    if tokenizer:
        vocab.merges = _merges(tokenizer.get("model", {}).get("merges"), tokenizer_file)
        added_tokens = tokenizer.get("added_tokens", [])
    config_file = model_dir / "tokenizer_config.json"
    tokenizer_config = read_json(config_file) if present(config_file) else None
    if tokenizer_config is not None and not isinstance(tokenizer_config, dict):
        raise CloverInputError(config_file, "must hold a JSON object")
    if tokenizer:
        _apply_post_processor(vocab, tokenizer, tokenizer_config)
    if not tokenizer_config:
        return
    vocab.chat_template = _chat_template(model_dir, tokenizer_config)
    for typ in vocab.special_token_types:
        add_entry = tokenizer_config.get(f"add_{typ}_token")
        if isinstance(add_entry, bool):
            if typ not in vocab.add_special_token:
                vocab.add_special_token[typ] = add_entry
            elif vocab.add_special_token[typ] != add_entry:
                log.warning("tokenizer_config add_%s_token (%s) disagrees with the tokenizer's post-processor (%s); "
                            "using the latter", typ, add_entry, vocab.add_special_token[typ])
        entry = tokenizer_config.get(f"{typ}_token")
        if isinstance(entry, dict):
            entry = entry.get("content")
        if not isinstance(entry, str):
            continue
        token_id = next((t.get("id") for t in added_tokens if t.get("content") == entry), None)
        _set_special_token(vocab, typ, token_id)


def _chat_template(model_dir: Path, tokenizer_config: dict[str, Any]) -> str | list[dict[str, str]] | None:
    alternative: str | list[dict[str, str]] | None = None
    jinja = model_dir / "chat_template.jinja"
    if present(jinja):
        alternative = read_input_text(jinja, CHAT_TEMPLATE)
        extra = sorted((model_dir / "additional_chat_templates").glob("*.jinja"))
        if extra:
            alternative = [{"name": "default", "template": alternative}]
            alternative += [{"name": p.stem, "template": read_input_text(p, CHAT_TEMPLATE)} for p in extra]
    elif present(model_dir / "chat_template.json"):
        data = read_json(model_dir / "chat_template.json", CHAT_TEMPLATE)
        if not isinstance(data, dict):
            raise CloverInputError(model_dir / "chat_template.json", "must hold a JSON object with a chat_template")
        alternative = data.get("chat_template")
    template = tokenizer_config.get("chat_template", alternative)
    if template is None or isinstance(template, (str, list)):
        return template
    log.warning("ignoring chat_template in tokenizer_config.json: it is neither a string nor a list")
    return None


def _apply_post_processor(vocab: SpecialVocab, tokenizer: dict[str, Any],
                          tokenizer_config: dict[str, Any] | None) -> None:
    """Which special tokens the tokenizer adds by itself (llama.cpp's crude post-processor parse)."""
    cfg = tokenizer_config
    special_bos = (cfg or {}).get("bos_token")
    special_cls = (cfg or {}).get("cls_token")
    special_eos = (cfg or {}).get("eos_token")
    special_sep = (cfg or {}).get("sep_token")
    if not special_bos and special_cls and cfg:
        cfg["bos_token"] = special_bos = special_cls
    if not special_eos and special_sep and cfg:
        cfg["eos_token"] = special_eos = special_sep
    post_processor = tokenizer.get("post_processor")
    if not post_processor:
        return
    for processor in post_processor.get("processors", [post_processor]):
        kind = processor.get("type")
        if kind == "ByteLevel":
            vocab.add_special_token.setdefault("bos", False)
            vocab.add_special_token.setdefault("eos", False)
        elif kind == "RobertaProcessing":
            vocab.add_special_token.update(bos=True, eos=True, sep=True)
            if not special_cls and cfg:
                special_cls = cfg["cls_token"] = processor.get("cls", [special_bos])[0]
            if not special_sep and cfg:
                special_sep = cfg["sep_token"] = processor.get("sep", [special_eos])[0]
        elif kind == "TemplateProcessing":
            special_bos, special_cls, special_eos = _template_processing(
                vocab, processor, cfg, special_bos, special_cls, special_eos, special_sep)


def _template_processing(vocab: SpecialVocab, processor: dict[str, Any], cfg: dict[str, Any] | None,
                         special_bos: Any, special_cls: Any, special_eos: Any,
                         special_sep: Any) -> tuple[Any, Any, Any]:
    single = processor.get("single", [])
    pair = processor.get("pair", [])
    special_first = special_last = None
    if len(single) > 1:
        if special_first := single[0].get("SpecialToken", {}).get("id"):
            if not cfg:
                special_bos = special_first
            elif special_first not in (special_bos, special_cls):
                if not special_bos:
                    cfg["bos_token"] = special_bos = special_first
                if not special_cls:
                    cfg["cls_token"] = special_cls = special_first
            vocab.add_special_token["bos"] = special_first in (special_bos, special_cls)
        if special_last := single[-1].get("SpecialToken", {}).get("id"):
            if not cfg:
                special_eos = special_last
            elif special_last != special_eos:
                if "eot" not in vocab.special_token_types:
                    vocab.special_token_types = (*vocab.special_token_types, "eot")
                    cfg["eot_token"] = special_eos
                elif "eom" not in vocab.special_token_types:
                    vocab.special_token_types = (*vocab.special_token_types, "eom")
                    cfg["eom_token"] = special_eos
                cfg["eos_token"] = special_eos = special_last
            vocab.add_special_token["eos"] = special_last == special_eos
    if pair:
        start = 1 if special_first and pair[0].get("SpecialToken", {}).get("id") == special_first else 0
        stop = -1 if special_last and pair[-1].get("SpecialToken", {}).get("id") == special_last else None
        middle = pair[slice(start, stop)]
        if middle:
            seq_a = middle[0].get("Sequence", {}).get("id")
            seq_b = middle[-1].get("Sequence", {}).get("id")
            if seq_a == "A" and seq_b == "B" and (middle := middle[1:-1]):
                add_sep = False
                if entry := middle[0].get("SpecialToken", {}).get("id"):
                    if entry in (special_sep, special_eos) and not special_last:
                        add_sep = True
                if len(middle) == 2:
                    if entry := middle[1].get("SpecialToken", {}).get("id"):
                        if entry in (special_sep, special_eos):
                            add_sep = True
                vocab.add_special_token["sep"] = add_sep
                if add_sep and not special_sep and cfg:
                    cfg["sep_token"] = special_eos
    return special_bos, special_cls, special_eos


def _load_from_config_json(vocab: SpecialVocab, model_dir: Path) -> None:
    config_file = model_dir / "config.json"
    if not present(config_file):
        return
    config = read_json(config_file)
    for typ in vocab.special_token_types:
        token_id = config.get(f"{typ}_token_id")
        if token_id is None and isinstance(config.get("text_config"), dict):
            token_id = config["text_config"].get(f"{typ}_token_id")
        _set_special_token(vocab, typ, token_id)
