"""The Hugging Face checkpoint format (spec section 2): save/load round trips, sharding, nested
``text_config``, the fused-expert layout, config (de)serialisation, and compatibility with transformers."""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from clover_ref import hf_io
from clover_ref.checkpoint import load_model, round_to_dtype, save_model
from clover_common.config import CLOVER_FIELDS, TEXT_MODEL_TYPE, CloverConfig
from clover_ref.factory import init_checkpoint, preset_config, random_model
from clover_common.layout import is_clover_tensor, tensor_shapes
from clover_common.tokenizer import load_tokenizer

PROMPT = [17, 250, 3, 999, 42, 1800, 7, 2047, 64]
SHARD_RE = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")

# the clover fields a config writes: an unset history_readout_scale (the default) is left out
WRITTEN_FIELDS = tuple(n for n in CLOVER_FIELDS if n != "history_readout_scale")


# ----------------------------------------------------------------------------------------------- helpers
def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert sa[name].dtype == sb[name].dtype == torch.float32, name
        assert torch.equal(sa[name], sb[name]), f"{name} differs after the round trip"


def assert_same_logits(a, b, block: bool = False) -> None:
    """Same causal logits; with ``block``, also the same block-mode logits (a slower pass)."""
    la = a.forward_causal(PROMPT, a.new_history())
    lb = b.forward_causal(PROMPT, b.new_history())
    assert torch.equal(la, lb)
    if not block:
        return
    window = [a.config.mask_token_id] * a.config.block_size
    ha, hb = a.new_history(), b.new_history()
    a.forward_causal(PROMPT[:4], ha)
    b.forward_causal(PROMPT[:4], hb)
    assert torch.equal(a.forward_block(window, ha), b.forward_block(window, hb))


def assert_same_config(a: CloverConfig, b: CloverConfig) -> None:
    """Equal fields and equal config.json (``extra`` may differ only by keys to_dict writes anyway)."""
    assert a.replace(extra={}) == b.replace(extra={})
    assert a.to_dict() == b.to_dict()


def stored_names(model_dir: Path) -> list[str]:
    return sorted(hf_io.shard_files(model_dir))


@pytest.fixture(scope="module")
def f32_model():
    """A fresh random tiny model in float32 (values not representable in bf16, so the test is exacting)."""
    return random_model(preset_config("tiny"), seed=1)


@pytest.fixture(scope="module")
def bf16_model(f32_model):
    model = copy.deepcopy(f32_model)
    round_to_dtype(model, "bfloat16")
    return model


# ------------------------------------------------------------------------------------------ round trips
def test_float32_round_trip_is_bitwise(f32_model, tmp_path: Path) -> None:
    save_model(f32_model, tmp_path, dtype="float32")
    assert (tmp_path / "model.safetensors").is_file()
    assert not (tmp_path / "model.safetensors.index.json").exists()
    assert not list(tmp_path.glob("*.tmp")), "temporary files left behind"
    loaded = load_model(tmp_path)
    assert_same_config(loaded.config, f32_model.config)
    assert_same_state(f32_model, loaded)
    assert_same_logits(f32_model, loaded, block=True)


def test_bfloat16_round_trip_after_rounding(f32_model, bf16_model, tmp_path: Path) -> None:
    save_model(bf16_model, tmp_path, dtype="bfloat16")
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    loaded = load_model(tmp_path)
    assert_same_state(bf16_model, loaded)
    assert_same_logits(bf16_model, loaded)
    # Sanity: rounding changed the weights, so the comparison above is not vacuous.
    assert not torch.equal(f32_model.lm_head.weight, loaded.lm_head.weight)


def test_stored_names_and_shapes_follow_the_spec(tiny_checkpoint: Path, tiny_model) -> None:
    """Per-expert names as transformers writes them, and the four clover tensors of every GDN layer."""
    config = tiny_model.config
    expected = tensor_shapes(config, fused_experts=False)
    header = hf_io.read_header(tiny_checkpoint / "model.safetensors")
    assert {k: v.shape for k, v in header.items()} == expected
    assert {v.dtype for v in header.values()} == {"BF16"}
    for layer in range(config.num_hidden_layers):
        clover = [k for k in expected if k.startswith(f"model.layers.{layer}.") and is_clover_tensor(k)]
        assert len(clover) == (4 if config.is_linear(layer) else 0)
    c = config
    assert expected["model.layers.0.linear_attn.conv_right_weight"] == (c.conv_dim, c.linear_conv_kernel_dim - 1)
    for name in ("bd_softmax_logit_scale", "bd_softmax_history_bias", "bd_softmax_history_c"):
        assert expected[f"model.layers.0.linear_attn.{name}"] == (c.linear_num_value_heads,)
    # Clover tensors are random, not zero, in every preset.
    state = tiny_model.state_dict()
    for name in ("conv_right_weight", "bd_softmax_history_bias", "bd_softmax_history_c"):
        assert state[f"model.layers.0.linear_attn.{name}"].abs().sum() > 0


def test_sharded_round_trip(bf16_model, tmp_path: Path) -> None:
    max_bytes = 100_000
    save_model(bf16_model, tmp_path, dtype="bfloat16", max_shard_bytes=max_bytes)
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) >= 3
    assert "model.safetensors" not in shards
    n = len(shards)
    for i, name in enumerate(shards, start=1):
        m = SHARD_RE.fullmatch(name)
        assert m and int(m.group(1)) == i and int(m.group(2)) == n, name
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    total = 0
    for shard in shards:
        header = hf_io.read_header(tmp_path / shard)
        assert {k for k, v in index["weight_map"].items() if v == shard} == set(header)
        sizes = [v.n_elements * v.itemsize for v in header.values()]
        assert sum(sizes) <= max_bytes or len(sizes) == 1, f"{shard} exceeds the shard size"
        total += sum(sizes)
    assert index["metadata"]["total_size"] == total
    assert set(index["weight_map"]) == set(tensor_shapes(bf16_model.config))
    assert not list(tmp_path.glob("*.tmp"))
    loaded = load_model(tmp_path)
    assert_same_state(bf16_model, loaded)
    assert_same_logits(bf16_model, loaded)


def test_resaving_replaces_the_previous_layout(f32_model, bf16_model, tmp_path: Path) -> None:
    """Saving single after sharded (and back) into one directory must load the newest weights."""
    save_model(f32_model, tmp_path, dtype="float32", max_shard_bytes=200_000)
    save_model(bf16_model, tmp_path, dtype="bfloat16")
    assert not (tmp_path / "model.safetensors.index.json").exists()
    assert_same_state(bf16_model, load_model(tmp_path))
    save_model(f32_model, tmp_path, dtype="float32", max_shard_bytes=200_000)
    assert not (tmp_path / "model.safetensors").exists()
    assert_same_state(f32_model, load_model(tmp_path))


def test_nested_text_config_round_trip(tmp_path: Path) -> None:
    flat_dir, nested_dir = tmp_path / "flat", tmp_path / "nested"
    init_checkpoint(flat_dir, "tiny", seed=3, dtype="float32")
    init_checkpoint(nested_dir, "tiny", seed=3, dtype="float32", nested=True)
    data = json.loads((nested_dir / "config.json").read_text())
    text = data["text_config"]
    assert text["model_type"] == TEXT_MODEL_TYPE == "qwen3_5_moe_text"
    assert data["model_type"] == "clover_moe"
    assert data["architectures"] == ["CloverMoeModelLM"]
    for name in WRITTEN_FIELDS:
        assert name in data, f"clover field {name} must sit at the top level"
        assert name not in text
    for name in ("hidden_size", "num_hidden_layers", "layer_types", "rope_parameters", "vocab_size"):
        assert name in text and name not in data
    names = stored_names(nested_dir)
    assert names and all(n.startswith("model.language_model.") or n == "lm_head.weight" for n in names)
    assert "lm_head.weight" in names
    assert "model.language_model.layers.0.linear_attn.conv_right_weight" in names

    flat, nested = load_model(flat_dir), load_model(nested_dir)
    assert nested.config.nested_text_config and not flat.config.nested_text_config
    assert nested.config.text_fields() == flat.config.text_fields()
    assert nested.config.clover_fields() == flat.config.clover_fields()
    assert_same_state(flat, nested)
    assert_same_logits(flat, nested, block=True)

    # Saving a nested model keeps it nested, and sharding works with the nested prefix too.
    again = tmp_path / "again"
    save_model(nested, again, dtype="float32", max_shard_bytes=150_000)
    assert "text_config" in json.loads((again / "config.json").read_text())
    assert all(n.startswith("model.language_model.") or n == "lm_head.weight" for n in stored_names(again))
    reloaded = load_model(again)
    assert_same_config(reloaded.config, nested.config)
    assert_same_state(nested, reloaded)


def test_fused_expert_layout_round_trip(bf16_model, tmp_path: Path) -> None:
    save_model(bf16_model, tmp_path, dtype="bfloat16", fused_experts=True)
    names = stored_names(tmp_path)
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    assert "model.layers.0.mlp.experts.down_proj" in names
    assert not any(".experts.0." in n for n in names)
    loaded = load_model(tmp_path)
    assert_same_state(bf16_model, loaded)
    assert_same_logits(bf16_model, loaded)


def test_fused_and_per_expert_files_hold_the_same_values(tiny_checkpoint: Path, tiny_model, tmp_path) -> None:
    save_model(tiny_model, tmp_path, dtype="bfloat16", fused_experts=True)
    fused = load_file(str(tmp_path / "model.safetensors"))
    split = load_file(str(tiny_checkpoint / "model.safetensors"))
    c = tiny_model.config
    inter = c.moe_intermediate_size
    for layer in range(c.num_hidden_layers):
        p = f"model.layers.{layer}.mlp.experts"
        for e in range(c.num_experts):
            assert torch.equal(fused[f"{p}.gate_up_proj"][e, :inter], split[f"{p}.{e}.gate_proj.weight"])
            assert torch.equal(fused[f"{p}.gate_up_proj"][e, inter:], split[f"{p}.{e}.up_proj.weight"])
            assert torch.equal(fused[f"{p}.down_proj"][e], split[f"{p}.{e}.down_proj.weight"])


def test_vision_and_mtp_tensors_are_ignored_with_a_warning(tiny_checkpoint: Path, tiny_model, tmp_path) -> None:
    model_dir = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, model_dir)
    tensors = load_file(str(model_dir / "model.safetensors"))
    tensors["mtp.fc.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(2, 3, dtype=torch.bfloat16)
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.warns(UserWarning, match="vision/MTP"):
        loaded = load_model(model_dir)
    assert_same_state(tiny_model, loaded)


# ------------------------------------------------------------------------------------------------ config
def test_config_dict_round_trip_top_level(tiny_model) -> None:
    config = tiny_model.config
    data = config.to_dict()
    assert data["model_type"] == "clover_moe" and "text_config" not in data
    for name in WRITTEN_FIELDS:
        assert name in data
    again = CloverConfig.from_dict(json.loads(json.dumps(data)))
    assert_same_config(again, config)
    assert again.to_dict() == data


def test_config_dict_round_trip_nested(tiny_model) -> None:
    nested = tiny_model.config.replace(nested_text_config=True)
    data = nested.to_dict()
    assert set(data) >= set(WRITTEN_FIELDS) | {"text_config", "model_type", "architectures"}
    again = CloverConfig.from_dict(json.loads(json.dumps(data)))
    assert_same_config(again, nested)
    assert again.to_dict() == data
    assert again.text_fields() == tiny_model.config.text_fields()


def test_config_save_load(tiny_model, tmp_path: Path) -> None:
    for nested in (False, True):
        config = tiny_model.config.replace(nested_text_config=nested)
        path = config.save(tmp_path)
        assert path == tmp_path / "config.json"
        assert_same_config(CloverConfig.load(tmp_path), config)


def test_config_clover_fields_inside_text_config_are_read(tiny_model) -> None:
    """A nested config with clover fields only inside text_config still reads; writing moves them up."""
    data = tiny_model.config.replace(nested_text_config=True).to_dict()
    for name in WRITTEN_FIELDS:
        data["text_config"][name] = data.pop(name)
    config = CloverConfig.from_dict(data)
    assert config.clover_fields() == tiny_model.config.clover_fields()
    out = config.to_dict()
    assert all(name in out and name not in out["text_config"] for name in WRITTEN_FIELDS)


def test_config_unknown_keys_are_preserved(tiny_model) -> None:
    data = tiny_model.config.to_dict()
    data["transformers_version"] = "5.23.0"
    data["my_tool"] = {"note": "kept", "values": [1, 2.5, None]}
    config = CloverConfig.from_dict(data)
    out = config.to_dict()
    assert out["transformers_version"] == "5.23.0"
    assert out["my_tool"] == {"note": "kept", "values": [1, 2.5, None]}
    assert CloverConfig.from_dict(out) == config

    nested = tiny_model.config.replace(nested_text_config=True).to_dict()
    nested["vision_config"] = {"depth": 27, "hidden_size": 1152}
    nested["image_token_id"] = 248056
    nested["text_config"]["attn_output_gate"] = True
    nested["text_config"]["router_aux_loss_coef"] = 0.001
    config = CloverConfig.from_dict(nested)
    out = config.to_dict()
    assert out["vision_config"] == {"depth": 27, "hidden_size": 1152}
    assert out["image_token_id"] == 248056
    assert out["text_config"]["attn_output_gate"] is True
    assert out["text_config"]["router_aux_loss_coef"] == 0.001
    assert out["text_config"]["model_type"] == TEXT_MODEL_TYPE
    assert CloverConfig.from_dict(out) == config


def test_config_defaults_of_clover_fields(tiny_model) -> None:
    data = tiny_model.config.to_dict()
    for name in ("block_size", "confidence_threshold", "calibrated_block_sizes", "calibrated_thresholds",
                 "coreset_top_p", "history_rows", "num_shared_experts"):
        del data[name]
    config = CloverConfig.from_dict(data)
    assert config.block_size == 32
    assert config.confidence_threshold == 0.95
    assert config.calibrated_block_sizes == [32]
    assert config.calibrated_thresholds == [0.95]
    assert config.coreset_top_p == 1.0 and config.history_rows == 32 and config.history_readout_scale is None
    assert config.readout_scale == 1 / math.sqrt(config.linear_key_head_dim)
    assert config.conv_right_kernel == config.linear_conv_kernel_dim - 1 == 3


def test_all_presets_have_consistent_rotary_sections() -> None:
    for name in ("tiny", "mid", "35b-shape"):
        config = preset_config(name)
        assert sum(config.rope_parameters["mrope_section"]) == config.rotary_dim // 2, name
        config.validate()


# ------------------------------------------------------------------------------------- transformers side
def test_transformers_tokenizer_loads_the_checkpoint_tokenizer(tiny_checkpoint: Path, tiny_model) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_checkpoint))
    ours = load_tokenizer(tiny_checkpoint)
    text = "def f(x):\n    return x * 2  # <|im_end|> café"
    assert hf(text)["input_ids"] == ours.encode(text).ids
    assert hf.convert_tokens_to_ids("<|mask|>") == tiny_model.config.mask_token_id
    assert hf.convert_tokens_to_ids("<|im_end|>") in tiny_model.config.eos_token_ids
    assert len(hf) <= tiny_model.config.vocab_size


def _hf_text_config(config: CloverConfig):
    from transformers import Qwen3_5MoeTextConfig

    fields = config.text_fields()
    while True:  # drop whatever keys this transformers version rejects
        try:
            return Qwen3_5MoeTextConfig(**fields)
        except TypeError as exc:
            match = re.search(r"argument '(\w+)'", str(exc))
            if not match or match.group(1) not in fields:
                raise
            del fields[match.group(1)]


@pytest.mark.parametrize("layout", ["single", "sharded", "nested"])
def test_transformers_loads_every_non_clover_tensor(tiny_model, tmp_path: Path, layout: str) -> None:
    from transformers import Qwen3_5MoeForCausalLM
    from transformers.utils import logging as hf_logging

    config = tiny_model.config.replace(nested_text_config=layout == "nested")
    model = copy.copy(tiny_model)
    model.config = config
    save_model(model, tmp_path, dtype="float32", max_shard_bytes=150_000 if layout == "sharded" else None)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        hf, info = Qwen3_5MoeForCausalLM.from_pretrained(
            str(tmp_path), config=_hf_text_config(config), dtype=torch.float32, output_loading_info=True)
    finally:
        hf_logging.set_verbosity(verbosity)
    assert info["missing_keys"] in (set(), [])
    assert not info["mismatched_keys"]
    assert not info.get("error_msgs")
    assert all(is_clover_tensor(k) for k in info["unexpected_keys"])
    ours = tiny_model.state_dict()
    theirs = hf.state_dict()
    assert set(theirs) == {k for k in ours if not is_clover_tensor(k)}
    for name, tensor in theirs.items():
        assert torch.equal(tensor, ours[name]), name
