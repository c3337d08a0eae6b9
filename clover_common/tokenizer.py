"""The Clover test tokenizer: a small byte-level BPE with Qwen3.5's pre-tokenizer and special tokens.

The real Clover checkpoint ships Qwen3.5's 248K-token tokenizer. Test checkpoints ship this one instead:
the same pipeline (NFC, Qwen3.5's split regex, byte-level BPE), a 3000-token base vocabulary trained on
Python standard-library sources, then the Qwen special tokens at ids 3000.. (``<|mask|>`` last).

The trained files live in ``data/tokenizer/`` next to this module and are shipped, not rebuilt at run
time. Regenerate them (deterministically) with ``python -m clover_common.tokenizer --retrain``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import sysconfig
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers import processors, trainers

try:
    from . import chat_render
    from .errors import CloverInputError
except ImportError:  # run as a plain script: python clover_common/tokenizer.py --retrain
    import chat_render  # type: ignore[no-redef]
    from errors import CloverInputError  # type: ignore[no-redef]

# transformers' Qwen3_5Tokenizer split regex, verbatim.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

BASE_VOCAB_SIZE = 3000
MODEL_MAX_LENGTH = 131072
MASK_TOKEN = "<|mask|>"
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
# Added tokens in id order, from BASE_VOCAB_SIZE on.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    MASK_TOKEN,
]
# As in Qwen3, the think and tool-call tags are added tokens but not special (decode keeps them).
NON_SPECIAL_TOKENS = frozenset({"<think>", "</think>", "<tool_call>", "</tool_call>"})

TOKENIZER_DIR = Path(__file__).resolve().parent / "data" / "tokenizer"
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
SHIPPED_FILES = (TOKENIZER_FILE, CONFIG_FILE, TEMPLATE_FILE)

# Training corpus: files of the CPython 3.11 standard library, relative to its Lib/ directory.
TRAINING_FILES = (
    "LICENSE.txt", "email/architecture.rst", "pydoc_data/topics.py",
    "argparse.py", "ast.py", "asyncio/base_events.py", "asyncio/tasks.py", "base64.py", "bisect.py",
    "calendar.py", "collections/__init__.py", "configparser.py", "contextlib.py", "copy.py", "csv.py",
    "dataclasses.py", "datetime.py", "difflib.py", "dis.py", "enum.py", "fractions.py", "functools.py",
    "gettext.py", "heapq.py", "inspect.py", "ipaddress.py", "json/decoder.py", "json/encoder.py",
    "logging/__init__.py", "os.py", "pathlib.py", "pickle.py", "pprint.py", "random.py", "shutil.py",
    "statistics.py", "string.py", "subprocess.py", "tempfile.py", "textwrap.py", "threading.py",
    "tokenize.py", "traceback.py", "typing.py", "unittest/case.py", "urllib/parse.py", "uuid.py",
    "zipfile.py",
)


def default_training_files() -> list[Path]:
    """The sorted, fixed list of standard-library files the shipped tokenizer was trained on."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(lib / name for name in TRAINING_FILES)
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"training files missing from the standard library: {missing}")
    return files


def _empty_tokenizer() -> Tokenizer:
    """An untrained BPE tokenizer with Qwen3.5's normalizer, pre-tokenizer, decoder and post-processor."""
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False, add_prefix_space=False, use_regex=False)
    return tokenizer


def _added_tokens() -> list[AddedToken]:
    """SPECIAL_TOKENS as AddedToken objects, flagged as Qwen flags them."""
    return [AddedToken(t, special=t not in NON_SPECIAL_TOKENS, normalized=False) for t in SPECIAL_TOKENS]


def train_tokenizer(files: list[Path], vocab_size: int = BASE_VOCAB_SIZE) -> Tokenizer:
    """Train the byte-level BPE on ``files`` to ``vocab_size`` base tokens, then add SPECIAL_TOKENS.

    Deterministic: the same files give a byte-identical ``tokenizer.to_str()``.
    """
    tokenizer = _empty_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train([str(f) for f in files], trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"training reached {tokenizer.get_vocab_size()} tokens, not {vocab_size}: corpus too small")
    tokenizer.add_tokens(_added_tokens())
    return tokenizer


def chat_template() -> str:
    """The shipped Jinja chat template text."""
    return (TOKENIZER_DIR / TEMPLATE_FILE).read_text(encoding="utf-8")


def tokenizer_config(template: str) -> dict[str, Any]:
    """The tokenizer_config.json contents for transformers (AutoTokenizer) and llama.cpp's converter."""
    return {
        # TokenizersBackend uses tokenizer.json as is. Named classes (Qwen2Tokenizer, Qwen3_5Tokenizer) keep
        # only its vocab, merges and post-processor and rebuild the rest from their own code: Qwen2Tokenizer's
        # regex lacks \p{M}, so it would silently pre-tokenize differently from this file.
        "tokenizer_class": "TokenizersBackend",
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "mask_token": MASK_TOKEN,
        "errors": "replace",
        "split_special_tokens": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "chat_template": template,
    }


def write_tokenizer(tokenizer: Tokenizer, out_dir: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    template = chat_template()
    (out_dir / TOKENIZER_FILE).write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    config = json.dumps(tokenizer_config(template), indent=2, ensure_ascii=False)
    (out_dir / CONFIG_FILE).write_text(config + "\n", encoding="utf-8")
    (out_dir / TEMPLATE_FILE).write_text(template, encoding="utf-8")


def copy_tokenizer(out_dir: Path) -> None:
    """Copy the shipped tokenizer files into a checkpoint directory."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in SHIPPED_FILES:
        shutil.copyfile(TOKENIZER_DIR / name, out_dir / name)


def special_token_ids() -> dict[str, int]:
    """Token -> id of every added token of the shipped tokenizer.json (``<|mask|>`` among them)."""
    data = json.loads((TOKENIZER_DIR / TOKENIZER_FILE).read_text(encoding="utf-8"))
    return {entry["content"]: entry["id"] for entry in data["added_tokens"]}


def load_tokenizer(model_dir: Path) -> Tokenizer:
    """Load ``model_dir/tokenizer.json``; raise CloverInputError naming the file if missing or invalid."""
    from .input_files import TOKENIZER, present, read_input_text  # here: --retrain runs this file as a script

    path = Path(model_dir) / TOKENIZER_FILE
    if not present(path):
        raise CloverInputError(path, "tokenizer file not found (a checkpoint needs tokenizer.json)")
    text = read_input_text(path, TOKENIZER)
    try:
        return Tokenizer.from_str(text)
    except Exception as exc:  # tokenizers raises a bare Exception for malformed files
        raise CloverInputError(path, f"not a valid tokenizers file: {exc}") from exc


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    enable_thinking: bool = True,
    add_generation_prompt: bool = True,
    template: str | None = None,
) -> str:
    """Render a conversation with the chat template (the shipped one unless ``template`` is given; chat_render.py):
    the same text as transformers' ``apply_chat_template(..., tokenize=False)``, and as llama.cpp's common/chat, which
    chat and serve render with."""
    return chat_render.render_chat(messages, template if template is not None else chat_template(), tools=tools,
                  enable_thinking=enable_thinking, add_generation_prompt=add_generation_prompt)


def main(argv: list[str] | None = None) -> int:
    """Command line: ``--retrain`` rebuilds the shipped files; otherwise print a summary."""
    parser = argparse.ArgumentParser(prog="python -m clover_common.tokenizer", description=__doc__.splitlines()[0])
    parser.add_argument("--retrain", action="store_true", help="retrain on the standard library and write the files")
    parser.add_argument("--out", type=Path, default=TOKENIZER_DIR, help="output directory (default: shipped dir)")
    args = parser.parse_args(argv)
    if args.retrain:
        write_tokenizer(train_tokenizer(default_training_files()), args.out)
        print(f"wrote {', '.join(SHIPPED_FILES)} to {args.out}")
    else:
        tokenizer = load_tokenizer(TOKENIZER_DIR)
        print(f"{TOKENIZER_DIR}: {tokenizer.get_vocab_size()} tokens; added: {special_token_ids()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
