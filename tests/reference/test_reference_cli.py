"""`clover-ref`: init for every preset, generate in every mode, and bad input (exit 2, one line, no traceback)."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from clover_ref.checkpoint import load_model
from clover_ref.cli import main
from clover_common.config import CloverConfig
from clover_ref.factory import init_checkpoint
from clover_common.tokenizer import SHIPPED_FILES
from tests.support.tmp import MkTemp

REPO = Path(__file__).resolve().parents[1]
PROMPT = "def fibonacci(n):"
HIST_KEY = "model.layers.0.linear_attn.bd_softmax_history_bias"


def clover_ref_command() -> list[str]:
    script = REPO / ".venv" / "bin" / "clover-ref"
    if script.is_file():
        return [str(script)]
    script = Path(sys.executable).parent / "clover-ref"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "clover_ref.cli"]


def run_main(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc: int, err: str, file: Path, field: str | None = None) -> str:
    assert rc == 2, err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, f"expected exactly one line on stderr, got {lines!r}"
    line = lines[0]
    assert line.startswith("clover-ref: error: "), line
    assert str(file) in line, f"{line!r} does not name {file}"
    if field is not None:
        assert f"field '{field}'" in line, line
    return line


def generate_args(model_dir: Path, *extra: str) -> list[str]:
    return ["generate", str(model_dir), "-p", PROMPT, "--mode", "ar", "-n", "1", *extra]


# ------------------------------------------------------------------------------------- broken checkpoints
@pytest.fixture
def broken(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny checkpoint to break."""
    out = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, out)
    return out


@pytest.fixture(scope="module")
def sharded_checkpoint(module_tmp: MkTemp) -> Path:
    out = module_tmp("sharded")
    init_checkpoint(out, "tiny", seed=0, max_shard_bytes=150_000)
    return out


@pytest.fixture
def broken_sharded(sharded_checkpoint: Path, tmp_path: Path) -> Path:
    out = tmp_path / "sharded"
    shutil.copytree(sharded_checkpoint, out)
    return out


def edit_config(model_dir: Path, edit: Callable[[dict], None]) -> None:
    path = model_dir / "config.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2))


def edit_tensors(model_dir: Path, edit: Callable[[dict], None]) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_missing_config(broken: Path, capsys) -> None:
    (broken / "config.json").unlink()
    rc, _, err = run_main(capsys, *generate_args(broken))
    assert_one_line_error(rc, err, broken / "config.json")


@pytest.mark.parametrize("text", ["{\"vocab_size\": 3072,", "", "\xff\xfe not json", "[1, 2, 3]", "null"])
def test_invalid_json_config(broken: Path, capsys, text: str) -> None:
    (broken / "config.json").write_bytes(text.encode("latin-1"))
    rc, _, err = run_main(capsys, *generate_args(broken))
    assert_one_line_error(rc, err, broken / "config.json")


@pytest.mark.parametrize("nested", [False, True])
def test_missing_mask_token_id(tmp_path: Path, capsys, nested: bool) -> None:
    """No mask id and no added token to find it by name (spec 2.2): refused, naming the field."""
    init_checkpoint(tmp_path, "tiny", seed=0, config_only=True, nested=nested)
    edit_config(tmp_path, lambda d: d.pop("mask_token_id"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((tmp_path / name).read_text().replace("<|mask|>", "<|blank|>"))
    rc, _, err = run_main(capsys, *generate_args(tmp_path))
    line = assert_one_line_error(rc, err, tmp_path / "config.json", "mask_token_id")
    assert "add mask_token_id to config.json" in line


def _set(key: str, value) -> Callable[[dict], None]:
    def edit(data: dict) -> None:
        data[key] = value
    return edit


def _set_rope(section) -> Callable[[dict], None]:
    def edit(data: dict) -> None:
        data["rope_parameters"]["mrope_section"] = section
    return edit


INVALID_VALUES = {
    "mask_id_eq_vocab": (_set("mask_token_id", 3072), "mask_token_id"),
    "mask_id_negative": (_set("mask_token_id", -1), "mask_token_id"),
    "mask_id_string": (_set("mask_token_id", "<|mask|>"), "mask_token_id"),
    "calibrated_lengths": (_set("calibrated_thresholds", [0.9, 0.9]), "calibrated_thresholds"),
    "calibrated_not_list": (_set("calibrated_block_sizes", 8), "calibrated_block_sizes"),
    "calibrated_threshold_range": (_set("calibrated_thresholds", [0.9, 1.5, 0.9]), "calibrated_thresholds"),
    "mrope_sum": (_set_rope([2, 2, 2]), "rope_parameters.mrope_section"),
    "mrope_not_list": (_set_rope(4), "rope_parameters.mrope_section"),
    "layer_types_length": (_set("layer_types", ["linear_attention"] * 3 + ["full_attention"] * 2), "layer_types"),
    "layer_types_unknown": (_set("layer_types", ["linear_attention"] * 3 + ["sliding_attention"]), "layer_types"),
    "layer_types_not_list": (_set("layer_types", 4), "layer_types"),
    "threshold_range": (_set("confidence_threshold", 1.5), "confidence_threshold"),
    "threshold_string": (_set("confidence_threshold", "high"), "confidence_threshold"),
    "block_size_zero": (_set("block_size", 0), "block_size"),
    "vocab_string": (_set("vocab_size", "3072"), "vocab_size"),
    "experts_per_tok": (_set("num_experts_per_tok", 9), "num_experts_per_tok"),
    "eos_outside_vocab": (_set("eos_token_id", [3005, 99999]), "eos_token_id"),
    "eos_string": (_set("eos_token_id", "<|im_end|>"), "eos_token_id"),
    "rope_not_object": (_set("rope_parameters", [1, 2]), "rope_parameters"),
    "hidden_act": (_set("hidden_act", "gelu"), "hidden_act"),
}


@pytest.mark.parametrize("case", sorted(INVALID_VALUES))
def test_invalid_field_values(broken: Path, capsys, case: str) -> None:
    edit, field = INVALID_VALUES[case]
    edit_config(broken, edit)
    rc, _, err = run_main(capsys, *generate_args(broken))
    assert_one_line_error(rc, err, broken / "config.json", field)


def test_invalid_field_value_in_nested_text_config(tmp_path: Path, capsys) -> None:
    init_checkpoint(tmp_path, "tiny", seed=0, config_only=True, nested=True)
    edit_config(tmp_path, lambda d: d["text_config"]["rope_parameters"].update(mrope_section=[1, 1, 1]))
    rc, _, err = run_main(capsys, *generate_args(tmp_path))
    assert_one_line_error(rc, err, tmp_path / "config.json", "rope_parameters.mrope_section")


def test_missing_shard(broken_sharded: Path, capsys) -> None:
    index = json.loads((broken_sharded / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (broken_sharded / shard).unlink()
    rc, _, err = run_main(capsys, *generate_args(broken_sharded))
    line = assert_one_line_error(rc, err, broken_sharded / shard)
    assert "model.safetensors.index.json" in line


@pytest.mark.parametrize("text", ["{not json", "{\"metadata\": {}}", "{\"weight_map\": [1, 2]}"])
def test_invalid_index(broken_sharded: Path, capsys, text: str) -> None:
    (broken_sharded / "model.safetensors.index.json").write_text(text)
    rc, _, err = run_main(capsys, *generate_args(broken_sharded))
    assert_one_line_error(rc, err, broken_sharded / "model.safetensors.index.json", "weight_map")


def test_tensor_missing_from_index(broken_sharded: Path, capsys) -> None:
    path = broken_sharded / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    del index["weight_map"][HIST_KEY]
    path.write_text(json.dumps(index))
    rc, _, err = run_main(capsys, *generate_args(broken_sharded))
    line = assert_one_line_error(rc, err, path)
    assert HIST_KEY in line


def test_index_names_a_tensor_the_shard_lacks(broken_sharded: Path, capsys) -> None:
    path = broken_sharded / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    real = index["weight_map"][HIST_KEY]
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != real)
    index["weight_map"][HIST_KEY] = other
    path.write_text(json.dumps(index))
    rc, _, err = run_main(capsys, *generate_args(broken_sharded))
    line = assert_one_line_error(rc, err, broken_sharded / other)
    assert HIST_KEY in line


@pytest.mark.parametrize("keep", ["tail", "header", "length"])
def test_truncated_safetensors(broken: Path, capsys, keep: str) -> None:
    path = broken / "model.safetensors"
    data = path.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    cut = {"tail": len(data) - 1000, "header": 8 + header_len // 2, "length": 5}[keep]
    path.write_bytes(data[:cut])
    rc, _, err = run_main(capsys, *generate_args(broken))
    line = assert_one_line_error(rc, err, path)
    assert "truncated" in line


def test_truncated_shard(broken_sharded: Path, capsys) -> None:
    path = sorted(broken_sharded.glob("model-*.safetensors"))[-1]
    path.write_bytes(path.read_bytes()[:-64])
    rc, _, err = run_main(capsys, *generate_args(broken_sharded))
    assert_one_line_error(rc, err, path)


def test_corrupt_safetensors_header(broken: Path, capsys) -> None:
    path = broken / "model.safetensors"
    data = path.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + header_len])
    header["model.norm.weight"]["shape"] = [header["model.norm.weight"]["shape"][0] - 1]  # disagrees with offsets
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + header_len:])
    rc, _, err = run_main(capsys, *generate_args(broken))
    assert_one_line_error(rc, err, path)


def test_tensor_shape_disagrees_with_config(broken: Path, capsys) -> None:
    def edit(tensors: dict) -> None:
        tensors[HIST_KEY] = torch.zeros(4, 8, dtype=torch.bfloat16)
    edit_tensors(broken, edit)
    rc, _, err = run_main(capsys, *generate_args(broken))
    line = assert_one_line_error(rc, err, broken / "model.safetensors")
    assert HIST_KEY in line and "[4, 8]" in line and "implies [4]" in line


def test_config_disagrees_with_tensors(broken: Path, capsys) -> None:
    edit_config(broken, _set("moe_intermediate_size", 48))
    rc, _, err = run_main(capsys, *generate_args(broken))
    line = assert_one_line_error(rc, err, broken / "model.safetensors")
    assert "shape" in line


def test_unknown_tensor(broken: Path, capsys) -> None:
    def edit(tensors: dict) -> None:
        tensors["model.layers.0.linear_attn.extra_gate"] = torch.zeros(4, dtype=torch.bfloat16)
    edit_tensors(broken, edit)
    rc, _, err = run_main(capsys, *generate_args(broken))
    line = assert_one_line_error(rc, err, broken / "model.safetensors")
    assert "model.layers.0.linear_attn.extra_gate" in line


@pytest.mark.parametrize("name", [HIST_KEY, "model.layers.3.mlp.experts.5.up_proj.weight", "lm_head.weight"])
def test_missing_tensor(broken: Path, capsys, name: str) -> None:
    edit_tensors(broken, lambda tensors: tensors.pop(name))
    rc, _, err = run_main(capsys, *generate_args(broken))
    line = assert_one_line_error(rc, err, broken / "model.safetensors")
    assert f"'{name}'" in line and "missing" in line


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int64])
def test_unsupported_dtype(broken: Path, capsys, dtype: torch.dtype) -> None:
    def edit(tensors: dict) -> None:
        tensors[HIST_KEY] = tensors[HIST_KEY].to(dtype)
    edit_tensors(broken, edit)
    rc, _, err = run_main(capsys, *generate_args(broken))
    line = assert_one_line_error(rc, err, broken / "model.safetensors")
    assert HIST_KEY in line and "dtype" in line


def test_no_weights(broken: Path, capsys) -> None:
    (broken / "model.safetensors").unlink()
    rc, _, err = run_main(capsys, *generate_args(broken))
    assert_one_line_error(rc, err, broken)


def test_model_dir_missing(tmp_path: Path, capsys) -> None:
    rc, _, err = run_main(capsys, *generate_args(tmp_path / "nowhere"))
    assert_one_line_error(rc, err, tmp_path / "nowhere")


def test_missing_tokenizer(broken: Path, capsys) -> None:
    (broken / "tokenizer.json").unlink()
    rc, _, err = run_main(capsys, *generate_args(broken))
    assert_one_line_error(rc, err, broken / "tokenizer.json")


@pytest.mark.parametrize("text", ["{\"version\": \"1.0\", \"model\": ", "{}", "not json at all\n\nsecond line"])
def test_corrupt_tokenizer(broken: Path, capsys, text: str) -> None:
    (broken / "tokenizer.json").write_text(text)
    rc, _, err = run_main(capsys, *generate_args(broken))
    assert_one_line_error(rc, err, broken / "tokenizer.json")


@pytest.mark.parametrize(("option", "needle"), [
    (("--block-size", "99999999999"), "block size must be in 1 .. 256, got 99999999999"),
    (("--threshold", "nan"), "threshold must be in [0, 1], got NaN"),
    (("--temperature", "inf"), "temperature must be a finite number >= 0, got Infinity"),
    (("--top-p", "0"), "top_p must be in (0, 1], got 0.0"),
    (("--top-k", "-1"), "top_k must be an integer in 0 .. 2147483647, got -1"),
    (("--seed", "9" * 30), "seed must be an integer in 0 .. 9223372036854775807, got an integer of 30 digits"),
])
def test_bad_generate_options(tiny_checkpoint: Path, capsys, option: tuple[str, str], needle: str) -> None:
    """Values the decoders cannot use are one line naming the setting, not a traceback from torch."""
    rc, _, err = run_main(capsys, *generate_args(tiny_checkpoint, *option))
    assert rc == 2 and err.splitlines() == [f"clover-ref: error: {needle}"], err


def test_bad_input_via_console_script(broken: Path, broken_sharded: Path) -> None:
    """The installed entry point: exit code 2, one line on stderr, no traceback."""
    edit_config(broken, _set("mask_token_id", 5000))
    shard = sorted(broken_sharded.glob("model-*.safetensors"))[0]
    shard.unlink()
    cases = [(broken, broken / "config.json", "mask_token_id"), (broken_sharded, shard, None)]
    for model_dir, file, field in cases:
        proc = subprocess.run(clover_ref_command() + generate_args(model_dir), capture_output=True, text=True,
                              timeout=120)
        assert proc.stdout == ""
        assert_one_line_error(proc.returncode, proc.stderr, file, field)


# ------------------------------------------------------------------------------------------------- init
@pytest.mark.parametrize("preset", ["tiny", "mid", "35b-shape"])
def test_init_config_only(tmp_path: Path, capsys, preset: str) -> None:
    rc, out, err = run_main(capsys, "init", tmp_path, "--preset", preset, "--config-only")
    assert rc == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(("config.json", *SHIPPED_FILES))
    config = CloverConfig.load(tmp_path)
    assert config.mask_token_id == json.loads((tmp_path / "tokenizer.json").read_text())["added_tokens"][-1]["id"]
    assert sum(config.rope_parameters["mrope_section"]) == config.rotary_dim // 2
    if preset == "35b-shape":
        assert config.num_hidden_layers == 40
        assert config.num_experts == 256 and config.num_experts_per_tok == 8
        assert config.vocab_size == 248320
        assert config.hidden_size == 2048
        assert (config.linear_num_key_heads, config.linear_num_value_heads) == (16, 32)
        assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (16, 2, 256)
        assert config.layer_types.count("full_attention") == 10
        assert config.layer_types[3] == "full_attention" and config.layer_types[0] == "linear_attention"
    elif preset == "mid":
        assert (config.hidden_size, config.num_hidden_layers, config.num_experts) == (2048, 4, 16)
    else:
        assert config.num_hidden_layers == 4 and config.layer_types.count("linear_attention") == 3
        assert config.linear_num_key_heads < config.linear_num_value_heads
        assert (config.num_experts, config.num_experts_per_tok, config.block_size) == (8, 2, 8)


def test_init_layers_slice_config_only(tmp_path: Path, capsys) -> None:
    rc, _, err = run_main(capsys, "init", tmp_path, "--preset", "35b-shape", "--layers", "6", "--config-only")
    assert rc == 0, err
    config = CloverConfig.load(tmp_path)
    assert config.num_hidden_layers == len(config.layer_types) == 6
    assert config.num_experts == 256


@pytest.mark.parametrize("layers", ["0", "1"])
def test_init_rejects_fewer_than_two_layers(tmp_path: Path, capsys, layers: str) -> None:
    rc, _, err = run_main(capsys, "init", tmp_path, "--preset", "tiny", "--layers", layers)
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err
    assert "at least 2" in err


@pytest.mark.parametrize("layers", [2, 3])
def test_init_few_layers_keep_both_layer_kinds(tmp_path: Path, capsys, layers: int) -> None:
    """Fewer layers than the full-attention interval end with a full-attention layer (llama.cpp needs both kinds)."""
    rc, _, err = run_main(capsys, "init", tmp_path, "--preset", "35b-shape", "--layers", str(layers), "--config-only")
    assert rc == 0, err
    config = CloverConfig.load(tmp_path)
    assert config.layer_types == ["linear_attention"] * (layers - 1) + ["full_attention"]


def test_init_sharded_and_nested_flags(tmp_path: Path, capsys, tiny_model) -> None:
    rc, _, err = run_main(capsys, "init", tmp_path, "--preset", "tiny", "--seed", "0", "--shard-size", "120000",
                          "--nested")
    assert rc == 0, err
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert "text_config" in json.loads((tmp_path / "config.json").read_text())
    loaded = load_model(tmp_path)
    for name, tensor in tiny_model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name


def test_init_is_deterministic(tmp_path: Path, tiny_checkpoint: Path, capsys) -> None:
    rc, _, err = run_main(capsys, "init", tmp_path, "--preset", "tiny", "--seed", "0")
    assert rc == 0, err
    for name in ("config.json", "model.safetensors", *SHIPPED_FILES):
        assert (tmp_path / name).read_bytes() == (tiny_checkpoint / name).read_bytes(), name
    run_main(capsys, "init", tmp_path / "other", "--preset", "tiny", "--seed", "1")
    assert (tmp_path / "other" / "model.safetensors").read_bytes() != (tmp_path / "model.safetensors").read_bytes()


# --------------------------------------------------------------------------------------------- generate
@pytest.fixture(scope="module")
def cli_checkpoint(module_tmp: MkTemp) -> Path:
    out = module_tmp("cli")
    assert main(["init", str(out), "--preset", "tiny", "--seed", "0"]) == 0
    return out


@pytest.fixture(scope="module")
def generations(cli_checkpoint: Path) -> dict[str, dict]:
    """`generate --json` in every mode (greedy); diffusion is kept to one block (block passes are slow)."""
    import contextlib
    import io

    results = {}
    for mode, n in (("ar", 12), ("spec", 12), ("diffusion", 8)):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(["generate", str(cli_checkpoint), "-p", PROMPT, "--mode", mode, "-n", str(n), "--json"])
        assert rc == 0, err.getvalue()
        lines = out.getvalue().splitlines()
        assert len(lines) == 1, lines
        results[mode] = json.loads(lines[0])
    return results


@pytest.mark.parametrize("mode", ["ar", "spec", "diffusion"])
def test_generate_json(generations: dict, cli_checkpoint: Path, mode: str) -> None:
    result = generations[mode]
    config = CloverConfig.load(cli_checkpoint)
    assert {"text", "prompt_ids", "tokens", "stats"} <= set(result)
    tokens, stats = result["tokens"], result["stats"]
    assert tokens and all(isinstance(t, int) and 0 <= t < config.vocab_size for t in tokens)
    assert config.mask_token_id not in tokens
    assert len(tokens) <= (8 if mode == "diffusion" else 12)
    assert stats["mode"] == mode
    assert stats["generated_tokens"] == len(tokens)
    assert stats["prompt_tokens"] == len(result["prompt_ids"])
    assert stats["block_size"] == config.block_size
    for key in ("block_passes", "causal_passes", "tokens_per_pass", "steps_per_block", "accepted_lengths",
                "seconds", "stop_reason"):
        assert key in stats
    if mode == "ar":
        assert stats["block_passes"] == 0 and stats["causal_passes"] >= 1
    elif mode == "diffusion":
        assert stats["block_passes"] >= 1
        assert all(1 <= int(s) <= config.block_size for s in stats["steps_per_block"])  # {"steps": blocks}
        assert sum(stats["steps_per_block"].values()) == stats["causal_passes"]  # one commit per block
    else:
        assert stats["block_passes"] >= 1 and stats["accepted_lengths"]


def test_spec_equals_ar_greedy(generations: dict) -> None:
    assert generations["spec"]["tokens"] == generations["ar"]["tokens"]
    assert generations["spec"]["text"] == generations["ar"]["text"]
    assert generations["spec"]["prompt_ids"] == generations["ar"]["prompt_ids"]


def test_generate_plain_text_output(cli_checkpoint: Path, generations: dict, capsys) -> None:
    rc, out, err = run_main(capsys, "generate", cli_checkpoint, "-p", PROMPT, "--mode", "ar", "-n", "12")
    assert rc == 0, err
    assert out == PROMPT + generations["ar"]["text"] + "\n"
    assert "[ar]" in err and "Traceback" not in err
