"""The shipped Clover test tokenizer: ids, round trips, transformers parity, chat template, retraining."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path
from typing import Any

import pytest
import transformers
from tokenizers import Tokenizer

from clover_common import tokenizer as ctok
from clover_common.errors import CloverInputError

TEXTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "class Foo(Bar):\r\n\tpass  # TODO: x != y && z >= 3.14e-10\r\n",
    "你好，世界！这是一个测试。こんにちは、世界。안녕하세요",
    "emoji 🦙🚀 😶‍🌫️ 👍🏽 ✅",
    "   leading, trailing and    internal runs   \n\n\n\t\t  \n",
    "",
    " ",
    "I'VE it's we'll THEY'D 3333 3.3 3..3 ------======= нещо на Български",
    "café, e\u0301, ax\u0301y, नमस्ते दुनिया, กรุงเทพ, ﬁ Å",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nok<|im_end|>",
    "<|mask|><|mask|> <|mask|>x<|endoftext|><tool_call>\n{}\n</tool_call>",
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city (°C), e.g. <Paris> & \"Zürich\".",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    }
]

CHATS: dict[str, list[dict[str, Any]]] = {
    "two_turn": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hi, how can I help?"},
        {"role": "user", "content": "Write fibonacci in Python."},
    ],
    "history_with_thinking": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": "and 3+3?"},
    ],
    "tools": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Zürich?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}}
            ],
        },
        {"role": "tool", "content": "{\"temp\": 21}"},
        {"role": "tool", "content": "sunny"},
    ],
}


@pytest.fixture(scope="module")
def shipped() -> Tokenizer:
    return ctok.load_tokenizer(ctok.TOKENIZER_DIR)


@pytest.fixture(scope="module")
def hf() -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(ctok.TOKENIZER_DIR))


def test_shipped_sizes(shipped: Tokenizer) -> None:
    assert shipped.get_vocab_size(with_added_tokens=False) == ctok.BASE_VOCAB_SIZE == 3000
    assert shipped.get_vocab_size() == 3000 + len(ctok.SPECIAL_TOKENS)


def test_special_token_ids(shipped: Tokenizer) -> None:
    expected = {token: 3000 + i for i, token in enumerate(ctok.SPECIAL_TOKENS)}
    assert ctok.SPECIAL_TOKENS[0] == "<|endoftext|>" and ctok.SPECIAL_TOKENS[-1] == ctok.MASK_TOKEN
    assert ctok.special_token_ids() == expected
    assert {t: shipped.token_to_id(t) for t in ctok.SPECIAL_TOKENS} == expected
    specials = {t.content: t.special for t in shipped.get_added_tokens_decoder().values()}
    special = [t for t, is_special in specials.items() if is_special]
    assert special == ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(shipped: Tokenizer, text: str) -> None:
    """Decoding gives the text back, NFC-normalized (the normalizer is NFC)."""
    ids = shipped.encode(text).ids
    assert shipped.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)


def test_special_tokens_are_single_ids(shipped: Tokenizer) -> None:
    ids = shipped.encode("a<|mask|><|mask|>b<|im_end|>").ids
    assert ids.count(3007) == 2 and 3002 in ids


def test_transformers_loads_shipped(hf: Any) -> None:
    assert len(hf) == 3008
    assert (hf.eos_token, hf.eos_token_id) == ("<|im_end|>", 3002)
    assert (hf.pad_token, hf.pad_token_id) == ("<|endoftext|>", 3000)
    assert (hf.mask_token, hf.mask_token_id) == ("<|mask|>", 3007)
    assert hf.bos_token is None
    assert hf.chat_template == ctok.chat_template()


@pytest.mark.parametrize("text", TEXTS)
def test_transformers_matches_tokenizers(shipped: Tokenizer, hf: Any, text: str) -> None:
    assert hf.encode(text) == shipped.encode(text).ids
    assert hf.decode(hf.encode(text)) == unicodedata.normalize("NFC", text)
    # Same pieces before BPE: catches a class that swaps in another pre-tokenizer regex.
    ours = shipped.pre_tokenizer.pre_tokenize_str(shipped.normalizer.normalize_str(text))
    theirs = hf.backend_tokenizer.pre_tokenizer.pre_tokenize_str(hf.backend_tokenizer.normalizer.normalize_str(text))
    assert theirs == ours


def test_config_embeds_the_template() -> None:
    config = json.loads((ctok.TOKENIZER_DIR / ctok.CONFIG_FILE).read_text(encoding="utf-8"))
    assert config["chat_template"] == ctok.chat_template()
    assert config == ctok.tokenizer_config(ctok.chat_template())


@pytest.mark.parametrize("name", sorted(CHATS))
@pytest.mark.parametrize("thinking", [True, False, None])
def test_chat_template_matches_transformers(hf: Any, name: str, thinking: bool | None) -> None:
    messages = CHATS[name]
    tools = TOOLS if name == "tools" else None
    extra = {} if thinking is None else {"enable_thinking": thinking}
    theirs = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False, **extra)
    ours = ctok.render_chat(messages, tools=tools, **extra)
    assert ours == theirs
    suffix = "<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if thinking is False else "<think>\n")
    assert ours.endswith(suffix)


def test_chat_template_shapes() -> None:
    plain = ctok.render_chat(CHATS["two_turn"], add_generation_prompt=False)
    assert plain == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHello!<|im_end|>\n"
        "<|im_start|>assistant\nHi, how can I help?<|im_end|>\n"
        "<|im_start|>user\nWrite fibonacci in Python.<|im_end|>\n"
    )
    history = ctok.render_chat(CHATS["history_with_thinking"])
    assert "<|im_start|>assistant\n4<|im_end|>" in history  # old reasoning is dropped
    # The Qwen3.5 family's tool format: the tool list first, the system prompt after it, XML calls.
    tools = ctok.render_chat(CHATS["tools"], tools=TOOLS)
    assert tools.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n")
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n</tools>" in tools
    assert "</IMPORTANT>\n\nBe brief.<|im_end|>\n" in tools
    assert ("<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n"
            "<parameter=unit>\nc\n</parameter>\n</function>\n</tool_call>") in tools
    assert "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n<tool_response>\nsunny" in tools


def test_load_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(CloverInputError, match="tokenizer.json"):
        ctok.load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(CloverInputError, match="tokenizer.json"):
        ctok.load_tokenizer(tmp_path)


def test_copy_tokenizer(tmp_path: Path, shipped: Tokenizer) -> None:
    ctok.copy_tokenizer(tmp_path / "ckpt")
    for name in ctok.SHIPPED_FILES:
        assert (tmp_path / "ckpt" / name).read_bytes() == (ctok.TOKENIZER_DIR / name).read_bytes()
    assert ctok.load_tokenizer(tmp_path / "ckpt").to_str() == shipped.to_str()


def test_retraining_is_deterministic(tmp_path: Path) -> None:
    files = [f for f in ctok.default_training_files() if f.name in {"argparse.py", "LICENSE.txt", "textwrap.py"}]
    assert len(files) == 3
    first = ctok.train_tokenizer(files, vocab_size=1000)
    second = ctok.train_tokenizer(files, vocab_size=1000)
    assert first.to_str() == second.to_str()
    assert first.get_vocab_size(with_added_tokens=False) == 1000
    assert first.token_to_id(ctok.MASK_TOKEN) == 1000 + len(ctok.SPECIAL_TOKENS) - 1
    # Written files: same bytes, and the same pipeline as the shipped tokenizer.
    ctok.write_tokenizer(first, tmp_path / "a")
    ctok.write_tokenizer(second, tmp_path / "b")
    for name in ctok.SHIPPED_FILES:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    shipped = json.loads((ctok.TOKENIZER_DIR / ctok.TOKENIZER_FILE).read_text(encoding="utf-8"))
    written = json.loads((tmp_path / "a" / ctok.TOKENIZER_FILE).read_text(encoding="utf-8"))
    for key in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
        assert written[key] == shipped[key]
