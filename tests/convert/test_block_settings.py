"""The block-diffusion settings of a checkpoint (spec v2 section 2.2, clover_common.block_settings): the names tried in
order, generation_config.json, the mask token found by name when exactly one candidate exists, and
clover-convert's --mask-token, --block-size and --threshold. Bad cases are in tests/convert/test_convert_errors.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clover_common.block_settings import Overrides, mask_candidates, resolve
from clover_common.config import CloverConfig
from tests.support.convert import copy_checkpoint, fields, run_convert

MASK = 3007  # <|mask|> of the shipped tokenizer


@pytest.fixture
def model(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    return copy_checkpoint(tiny_checkpoint, tmp_path / "model")


def _config(model: Path, drop: tuple[str, ...] = (), **changes: object) -> dict:
    data = json.loads((model / "config.json").read_text())
    for name in drop:
        data.pop(name, None)
    data.update(changes)
    (model / "config.json").write_text(json.dumps(data))
    return data


def _add_special_token(model: Path, token_id: int, text: str) -> None:
    path = model / "tokenizer.json"
    data = json.loads(path.read_text())
    data["added_tokens"].append({"id": token_id, "content": text, "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True})
    path.write_text(json.dumps(data))


def test_the_first_present_name_wins_in_config_then_generation_config(model: Path) -> None:
    data = _config(model, drop=("block_size", "confidence_threshold", "mask_token_id"),
                   block_length=16, diffusion_block_size=4, mask_id=MASK)
    (model / "generation_config.json").write_text(json.dumps({"threshold": 0.8, "block_size": 8}))
    got = resolve(model, data)
    assert got["block_size"] == 16          # config.json before generation_config.json
    assert got["confidence_threshold"] == 0.8
    assert got["mask_token_id"] == MASK
    assert "block_length" not in got and "mask_id" not in got


def test_nested_text_config_names_are_read(model: Path) -> None:
    data = _config(model, drop=("block_size",), text_config={"diffusion_block_size": 4})
    assert resolve(model, data)["block_size"] == 4


def test_defaults_when_no_name_is_present(model: Path) -> None:
    data = _config(model, drop=("block_size", "confidence_threshold", "calibrated_block_sizes",
                                "calibrated_thresholds"))
    config = CloverConfig.load(model)
    assert (config.block_size, config.confidence_threshold) == (32, 0.95)
    assert "block_size" not in resolve(model, data)


def test_the_mask_token_by_name(model: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """No mask id anywhere: the one added special token containing "mask" is the mask, with a warning, and
    the GGUF says so."""
    _config(model, drop=("mask_token_id",))
    assert mask_candidates(model) == [(MASK, "<|mask|>")]
    assert CloverConfig.load(model).mask_token_id == MASK
    code, _, err = run_convert(capsys, model, tmp_path / "x.gguf", "--outtype", "f32")
    assert code == 0, err
    assert "mask_token_id is not in config.json: using 3007" in err
    assert fields(tmp_path / "x.gguf", "clover_moe")["tokenizer.ggml.mask_token_id"][1] == MASK


def test_command_line_overrides(model: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    _config(model, drop=("mask_token_id",))
    _add_special_token(model, 3070, "<|MASK_2|>")  # two candidates: only --mask-token decides
    code, _, err = run_convert(capsys, model, tmp_path / "x.gguf", "--outtype", "f32", "--mask-token", "<|mask|>",
                               "--block-size", "4", "--threshold", "0.5")
    assert code == 0, err
    assert "calibrated_block_sizes is dropped" in err
    got = fields(tmp_path / "x.gguf", "clover_moe")
    assert got["tokenizer.ggml.mask_token_id"][1] == MASK
    assert got["ARCH.block_size"][1] == 4
    assert got["ARCH.diffusion.threshold"][1] == pytest.approx(0.5)
    assert CloverConfig.load(model, Overrides(mask_token="3070")).mask_token_id == 3070
