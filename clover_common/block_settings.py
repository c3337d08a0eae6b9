"""The block-diffusion settings of a checkpoint, found as spec v2 section 2.2 says.

The released checkpoint's names for the mask token, block size and threshold are not public, so each is
looked for under several names: in config.json (top level, then ``text_config``), then in
generation_config.json, the first present name winning. The mask token may instead be the one added special
token whose text contains "mask" (case-insensitive), when there is exactly one. Command-line options override
everything (``Overrides``). Where a setting was found under another name is logged at INFO level.

Each value is checked by its CloverConfig field's rule (clover_common.config_numbers) where it is found: a bad
one is refused naming the file and the name it was found under, or the option that gave it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config_numbers import GENERATION_RULES, I32_MAX, RULE, first_violation
from .errors import BadInput, CloverInputError
from .input_files import CONFIG, TOKENIZER, InputKind, present, read_json
from .long_numbers import shown

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


# CloverConfig field -> the clover-convert option that overrides it
OPTIONS = {"mask_token_id": "--mask-token", "block_size": "--block-size", "confidence_threshold": "--threshold",
           "coreset_top_p": "--coreset-top-p", "history_rows": "--history-rows",
           "history_readout_scale": "--history-readout-scale"}


@dataclass(frozen=True)
class _Source:
    file: str  # the file's name in the checkpoint folder
    prefix: str  # "" at the file's top level, "text_config." under that object
    data: dict[str, Any]


def _first(sources: list[_Source], names: tuple[str, ...]) -> tuple[Any, _Source, str] | None:
    """The first present name, searched source by source: (value, source, name)."""
    for source in sources:
        for name in names:
            if name in source.data and source.data[name] is not None:
                return source.data[name], source, name
    return None


def _checked(field_name: str, value: Any, path: Path, name: str) -> Any:
    """``value``, found in ``path`` under ``name``, when it is valid for CloverConfig's ``field_name``
    (config_numbers.RULES); else CloverInputError naming that file and name."""
    if (why := RULE[field_name].check(value)) is not None:
        raise CloverInputError(path, why, field=name)
    return value


def _checked_option(field_name: str, value: Any) -> Any:
    """An override's ``value`` when it is valid for ``field_name``; else BadInput naming the option."""
    if (why := RULE[field_name].check(value)) is not None:
        raise BadInput(f"{OPTIONS[field_name]}: {why}")
    return value


def _mask_token_option(model_dir: Path, text: str) -> int:
    """--mask-token ID|TEXT: the id given, or the id of the token with that text."""
    digits = text.strip()
    if not (digits.isascii() and digits.isdigit()):
        return _token_id(model_dir, text)
    if len(digits) > len(str(I32_MAX)):  # no token id; and int() refuses more than 4,300 digits
        raise BadInput(f"{OPTIONS['mask_token_id']}: must be {RULE['mask_token_id'].range_text()} or a token's "
                       f"text, got {shown(digits)}")
    return _checked_option("mask_token_id", int(digits))


def _read_object(path: Path, kind: InputKind = CONFIG) -> dict[str, Any]:
    """A JSON file's object; {} when the file is absent or holds another kind of value."""
    if not present(path):
        return {}
    data = read_json(path, kind)
    return data if isinstance(data, dict) else {}


def added_tokens(model_dir: Path, tokenizer: dict[str, Any] | None = None) -> dict[int, tuple[str, bool]]:
    """The tokenizer's added tokens, id -> (text, special): tokenizer.json's ``added_tokens`` (``tokenizer``,
    when the caller has read that file already), else tokenizer_config.json's ``added_tokens_decoder``.
    Empty when neither file has them."""
    if tokenizer is None:
        tokenizer = _read_object(model_dir / TOKENIZER_FILE, TOKENIZER)
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
    tokenizer = _read_object(path, TOKENIZER)
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
    """generation_config.json's object, or None when the checkpoint has none; anything but an object is refused,
    and so are the numbers clover-convert writes that break their rule (config_numbers.GENERATION_RULES)."""
    path = model_dir / GENERATION_CONFIG_FILE
    if not present(path):
        return None
    generation = read_json(path)
    if not isinstance(generation, dict):
        raise CloverInputError(path, "must be a JSON object")
    if (found := first_violation(generation, GENERATION_RULES)) is not None:
        raise CloverInputError(path, found[1], field=found[0])
    return generation


def resolve(model_dir: Path, config: dict[str, Any], overrides: Overrides = Overrides()) -> dict[str, Any]:
    """``config`` (config.json's dict) with the block-diffusion settings filled in under the first name of
    each (the CloverConfig field): from the names of spec 2.2, generation_config.json, the mask token by
    name, and ``overrides``. A setting found nowhere keeps CloverConfig's default; a missing mask token is
    refused here, naming the candidates."""
    config_path = model_dir / CONFIG_FILE
    sources = [_Source(CONFIG_FILE, "", config)]
    if isinstance(config.get("text_config"), dict):
        sources.append(_Source(CONFIG_FILE, "text_config.", config["text_config"]))
    generation = read_generation_config(model_dir)
    if generation is not None:
        sources.append(_Source(GENERATION_CONFIG_FILE, "", generation))
    every_name = {name for names in NAMES.values() for name in names}
    out = {k: v for k, v in config.items() if k not in every_name}
    text = out.get("text_config")
    if isinstance(text, dict):
        out["text_config"] = {k: v for k, v in text.items() if k not in every_name}
    for field_name, names in NAMES.items():
        found = _first(sources, names)
        if found is not None:
            value, source, name = found
            out[field_name] = _checked(field_name, value, model_dir / source.file, source.prefix + name)
            if (source.file, source.prefix + name) != (CONFIG_FILE, field_name):
                log.info("%s: %s: %s%s", field_name, source.file, source.prefix, name)
    if overrides.block_size is not None:
        out["block_size"] = _checked_option("block_size", overrides.block_size)
    if overrides.threshold is not None:
        out["confidence_threshold"] = _checked_option("confidence_threshold", overrides.threshold)
    if overrides.block_size is not None or overrides.threshold is not None:
        # calibrated lists belong to the settings they were calibrated for
        for name in ("calibrated_block_sizes", "calibrated_thresholds"):
            if out.pop(name, None) is not None:
                log.warning("%s: %s is dropped: --block-size/--threshold override the settings it was made for",
                            config_path, name)
    for field_name in ("coreset_top_p", "history_rows", "history_readout_scale"):
        value = getattr(overrides, field_name)
        if value is not None:
            out[field_name] = _checked_option(field_name, value)
    if overrides.mask_token is not None:
        out["mask_token_id"] = _mask_token_option(model_dir, overrides.mask_token)
    elif "mask_token_id" not in out:
        out["mask_token_id"], where = _mask_by_name(model_dir, config_path)
        log.warning("mask_token_id is not in %s: using %d, %s", CONFIG_FILE, out["mask_token_id"], where)
    return out
