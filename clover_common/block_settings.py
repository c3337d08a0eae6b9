"""The block-diffusion settings of a checkpoint, found as spec v2 section 2.2 says.

The released checkpoint's names for the mask token, block size and threshold are not public, so each is
looked for under several names: in config.json (top level, then ``text_config``), then in
generation_config.json, the first present name winning. The mask token may instead be the one added special
token whose text contains "mask" (case-insensitive), when there is exactly one. Command-line options override
everything (``Overrides``). Where a setting was found under another name is logged at INFO level.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import CloverInputError, read_json

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

# CloverConfig field -> the names tried, in order (spec 2.2); the toolkit's own checkpoints write the first
NAMES: dict[str, tuple[str, ...]] = {
    "mask_token_id": ("mask_token_id", "mask_id"),
    "block_size": ("block_size", "block_length", "diffusion_block_size"),
    "confidence_threshold": ("confidence_threshold", "threshold", "diffusion_threshold"),
    "coreset_top_p": ("coreset_top_p", "block_coreset_top_p"),
    "history_rows": ("history_rows",),
}


@dataclass(frozen=True)
class Overrides:
    """clover-convert's --mask-token (an id or the token's text), --block-size, --threshold, --coreset-top-p,
    --history-rows and --history-readout-scale (no name for the last is known: spec 2.2)."""
    mask_token: str | None = None
    block_size: int | None = None
    threshold: float | None = None
    coreset_top_p: float | None = None
    history_rows: int | None = None
    history_readout_scale: float | None = None


def _first(sources: list[tuple[str, dict[str, Any]]], names: tuple[str, ...]) -> tuple[Any, str] | None:
    """The first present name, searched source by source: (value, "file: name")."""
    for where, data in sources:
        for name in names:
            if name in data and data[name] is not None:
                return data[name], f"{where}: {name}"
    return None


def _read_object(path: Path) -> dict[str, Any]:
    """A JSON file's object; {} when the file is absent or holds another kind of value."""
    if not path.is_file():
        return {}
    data = read_json(path)
    return data if isinstance(data, dict) else {}


def added_tokens(model_dir: Path, tokenizer: dict[str, Any] | None = None) -> dict[int, tuple[str, bool]]:
    """The tokenizer's added tokens, id -> (text, special): tokenizer.json's ``added_tokens`` (``tokenizer``,
    when the caller has read that file already), else tokenizer_config.json's ``added_tokens_decoder``.
    Empty when neither file has them."""
    if tokenizer is None:
        tokenizer = _read_object(model_dir / TOKENIZER_FILE)
    found: dict[int, tuple[str, bool]] = {}
    for entry in tokenizer.get("added_tokens") or []:
        if isinstance(entry, dict) and isinstance(entry.get("id"), int) and isinstance(entry.get("content"), str):
            found[entry["id"]] = (entry["content"], bool(entry.get("special", False)))
    if not found:
        decoder = _read_object(model_dir / TOKENIZER_CONFIG_FILE).get("added_tokens_decoder")
        for key, entry in (decoder if isinstance(decoder, dict) else {}).items():
            if str(key).isdigit() and isinstance(entry, dict) and isinstance(entry.get("content"), str):
                found[int(key)] = (entry["content"], bool(entry.get("special", False)))
    return found


def mask_candidates(model_dir: Path) -> list[tuple[int, str]]:
    """Added special tokens whose text contains "mask", in id order."""
    return sorted((i, text) for i, (text, special) in added_tokens(model_dir).items()
                  if special and "mask" in text.lower())


def _token_id(model_dir: Path, text: str) -> int:
    """--mask-token TEXT: the id of that token, among the added tokens, then the BPE vocabulary."""
    path = model_dir / TOKENIZER_FILE
    tokenizer = _read_object(path)
    for i, (content, _) in added_tokens(model_dir, tokenizer).items():
        if content == text:
            return i
    model = tokenizer.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if isinstance(vocab, dict) and isinstance(vocab.get(text), int):
        return vocab[text]
    raise CloverInputError(None, f"--mask-token {text!r} is not a token of {path}")


def _mask_by_name(model_dir: Path, config_path: Path) -> tuple[int, str]:
    candidates = mask_candidates(model_dir)
    if len(candidates) == 1:
        i, text = candidates[0]
        return i, f"the added special token {text!r} of the tokenizer"
    listed = ", ".join(f"{i} {text!r}" for i, text in candidates) or "none"
    raise CloverInputError(config_path, "no mask token: none of "
                           f"{', '.join(NAMES['mask_token_id'])} is in {CONFIG_FILE} or {GENERATION_CONFIG_FILE}, "
                           f"and the tokenizer's added special tokens containing 'mask' are {listed}: "
                           "add mask_token_id to config.json, or name it with clover-convert --mask-token ID|TEXT",
                           field="mask_token_id")


def read_generation_config(model_dir: Path) -> dict[str, Any] | None:
    """generation_config.json's object, or None when the checkpoint has none; anything but an object is refused."""
    path = model_dir / GENERATION_CONFIG_FILE
    if not path.is_file():
        return None
    generation = read_json(path)
    if not isinstance(generation, dict):
        raise CloverInputError(path, "must be a JSON object")
    return generation


def resolve(model_dir: Path, config: dict[str, Any], overrides: Overrides = Overrides()) -> dict[str, Any]:
    """``config`` (config.json's dict) with the block-diffusion settings filled in under the first name of
    each (the CloverConfig field): from the names of spec 2.2, generation_config.json, the mask token by
    name, and ``overrides``. A setting found nowhere keeps CloverConfig's default; a missing mask token is
    refused here, naming the candidates."""
    config_path = model_dir / CONFIG_FILE
    sources: list[tuple[str, dict[str, Any]]] = [(CONFIG_FILE, config)]
    if isinstance(config.get("text_config"), dict):
        sources.append((f"{CONFIG_FILE} text_config", config["text_config"]))
    generation = read_generation_config(model_dir)
    if generation is not None:
        sources.append((GENERATION_CONFIG_FILE, generation))
    every_name = {name for names in NAMES.values() for name in names}
    out = {k: v for k, v in config.items() if k not in every_name}
    text = out.get("text_config")
    if isinstance(text, dict):
        out["text_config"] = {k: v for k, v in text.items() if k not in every_name}
    for field_name, names in NAMES.items():
        found = _first(sources, names)
        if found is not None:
            out[field_name] = found[0]
            if found[1] != f"{CONFIG_FILE}: {field_name}":
                log.info("%s: %s", field_name, found[1])
    if overrides.block_size is not None:
        out["block_size"] = overrides.block_size
    if overrides.threshold is not None:
        out["confidence_threshold"] = overrides.threshold
    if overrides.block_size is not None or overrides.threshold is not None:
        # calibrated lists belong to the settings they were calibrated for
        for name in ("calibrated_block_sizes", "calibrated_thresholds"):
            if out.pop(name, None) is not None:
                log.warning("%s: %s is dropped: --block-size/--threshold override the settings it was made for",
                            config_path, name)
    for field_name in ("coreset_top_p", "history_rows", "history_readout_scale"):
        value = getattr(overrides, field_name)
        if value is not None:
            out[field_name] = value
    if overrides.mask_token is not None:
        text = overrides.mask_token.strip()
        out["mask_token_id"] = int(text) if text.isdigit() else _token_id(model_dir, overrides.mask_token)
    elif "mask_token_id" not in out:
        out["mask_token_id"], where = _mask_by_name(model_dir, config_path)
        log.warning("mask_token_id is not in %s: using %d, %s", CONFIG_FILE, out["mask_token_id"], where)
    return out
