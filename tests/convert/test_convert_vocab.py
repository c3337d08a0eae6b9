"""The GGUF vocabulary: its token list equals the Hugging Face tokenizer's vocabulary (padded to vocab_size
with llama.cpp's [PAD{i}] tokens), with llama.cpp's token types and special-token ids."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import transformers

from clover_common.config import CloverConfig
from clover_common.tokenizer import NON_SPECIAL_TOKENS, SPECIAL_TOKENS
from tests.support.convert import copy_checkpoint, fields, run_convert
from tests.support.tmp import MkTemp

T = gguf.TokenType


@pytest.fixture(scope="module")
def tiny_gguf_fields(tiny_checkpoint: Path, module_tmp: MkTemp) -> dict:
    from clover_convert.cli import main

    out = module_tmp("vocab") / "tiny.gguf"
    assert main([str(tiny_checkpoint), "--outfile", str(out), "--outtype", "bf16"]) == 0
    return fields(out, "clover_moe")


def test_token_list_equals_the_hf_vocabulary(tiny_checkpoint: Path, tiny_gguf_fields: dict) -> None:
    hf = transformers.AutoTokenizer.from_pretrained(tiny_checkpoint)
    vocab_size = CloverConfig.load(tiny_checkpoint).vocab_size
    by_id = {i: token for token, i in hf.get_vocab().items()}
    tokens = tiny_gguf_fields["tokenizer.ggml.tokens"][1]
    assert len(tokens) == vocab_size > len(by_id)
    assert tokens == [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    # and the HF tokenizer's own encodings index the GGUF list to the same strings
    ids = hf.encode("def fibonacci(n):\n    return n<|mask|>", add_special_tokens=False)
    assert [tokens[i] for i in ids] == hf.convert_ids_to_tokens(ids)


def test_token_types_and_special_ids(tiny_checkpoint: Path, tiny_gguf_fields: dict) -> None:
    tokens = tiny_gguf_fields["tokenizer.ggml.tokens"][1]
    types = tiny_gguf_fields["tokenizer.ggml.token_type"][1]
    for token in SPECIAL_TOKENS:
        i = tokens.index(token)
        assert types[i] == (T.USER_DEFINED if token in NON_SPECIAL_TOKENS else T.CONTROL), token
    first_pad = tokens.index("[PAD3008]")
    assert set(types[first_pad:]) == {T.UNUSED}
    assert set(types[:3000]) == {T.NORMAL}
    config = CloverConfig.load(tiny_checkpoint)
    assert tiny_gguf_fields["tokenizer.ggml.mask_token_id"][1] == config.mask_token_id == tokens.index("<|mask|>")
    merges = json.loads((tiny_checkpoint / "tokenizer.json").read_text())["model"]["merges"]
    assert tiny_gguf_fields["tokenizer.ggml.merges"][1] == [" ".join(pair) for pair in merges]


def test_config_mask_token_id_wins_over_tokenizer_config(tiny_checkpoint: Path, tmp_path: Path, capsys) -> None:
    model = copy_checkpoint(tiny_checkpoint, tmp_path / "tiny")
    config = json.loads((model / "config.json").read_text())
    config["mask_token_id"] = 3001
    (model / "config.json").write_text(json.dumps(config))
    code, _, err = run_convert(capsys, model, "--outfile", tmp_path / "x.gguf", "--outtype", "bf16")
    assert code == 0, err
    assert "mask token is id 3007 but config.json's mask_token_id is 3001" in err
    assert fields(tmp_path / "x.gguf", "clover_moe")["tokenizer.ggml.mask_token_id"][1] == 3001


def test_a_foreign_split_regex_is_warned_about(tiny_checkpoint: Path, tmp_path: Path, capsys) -> None:
    model = copy_checkpoint(tiny_checkpoint, tmp_path / "tiny")
    data = json.loads((model / "tokenizer.json").read_text())
    data["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\s+|\S+"
    (model / "tokenizer.json").write_text(json.dumps(data))
    code, _, err = run_convert(capsys, model, "--outfile", tmp_path / "x.gguf", "--outtype", "bf16")
    assert code == 0, err
    assert "does not use Qwen3.5's split regex" in err
    assert fields(tmp_path / "x.gguf", "clover_moe")["tokenizer.ggml.pre"][1] == "qwen35"


@pytest.mark.parametrize("where", ["model.vocab", "added_tokens"])
@pytest.mark.native
def test_a_real_token_with_a_filler_text_keeps_every_text_unique(tiny_checkpoint: Path, tmp_path: Path, capsys,
                                                                  where: str) -> None:
    """A real token whose text is the [PAD{i}] of a padded id (llama.cpp's converter would then write that text
    twice, and llama.cpp refuses such a vocabulary): the filler of id i becomes [PAD{i}.1], with a warning, every
    text stays unique, and llama.cpp loads the file."""
    from clover_native.bindings import check_model

    model = copy_checkpoint(tiny_checkpoint, tmp_path / "tiny")
    data = json.loads((model / "tokenizer.json").read_text())
    if where == "model.vocab":
        data["model"]["vocab"]["[PAD3071]"] = 3030
    else:
        data["added_tokens"].append({"id": 3008, "content": "[PAD3071]", "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})
    (model / "tokenizer.json").write_text(json.dumps(data))
    code, _, err = run_convert(capsys, model, "--outfile", tmp_path / "x.gguf", "--outtype", "bf16")
    assert code == 0, err
    assert "so the filler of the unused id 3071 is '[PAD3071.1]'" in err
    tokens = fields(tmp_path / "x.gguf", "clover_moe")["tokenizer.ggml.tokens"][1]
    real = 3030 if where == "model.vocab" else 3008
    assert (tokens[real], tokens[3071]) == ("[PAD3071]", "[PAD3071.1]")
    assert len(set(tokens)) == len(tokens) == 3072
    check_model(tmp_path / "x.gguf")
