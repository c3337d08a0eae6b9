"""The converter's bad-input matrix (docs/gguf-format.md): each case gives a one-line error naming the problem, exit
code 2, and no output file left behind (neither the GGUF nor the hidden temporary directory)."""

from __future__ import annotations

import errno
import json
import os
import resource
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from clover_convert import output
from clover_ref.factory import init_checkpoint_streaming
from clover_dev import VENV_PYTHON
from tests.support.convert import copy_checkpoint, edit_config, rewrite_weights, run_convert


@pytest.fixture
def model(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny checkpoint to break."""
    return copy_checkpoint(tiny_checkpoint, tmp_path / "model")


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    path = tmp_path / "out"
    path.mkdir()
    return path


def listing(*dirs: Path) -> list[str]:
    return sorted(str(p) for d in dirs for p in d.rglob("*"))


def assert_fails(capsys: pytest.CaptureFixture[str], model_dir: Path, out_dir: Path, *fragments: str,
                 extra: tuple[str, ...] = ()) -> str:
    """Run the CLI and check: exit 2, one stderr line naming the problem, no output anywhere."""
    before = listing(model_dir, out_dir) if model_dir.exists() else listing(out_dir)
    code, stdout, stderr = run_convert(capsys, model_dir, "--outfile", out_dir / "out.gguf", "--outtype", "q8_0",
                                       *extra)
    assert code == 2, stderr
    assert stdout == ""
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("clover-convert: error: "), stderr
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    after = listing(model_dir, out_dir) if model_dir.exists() else listing(out_dir)
    assert after == before, "output left behind"
    return lines[0]


def test_missing_config_json(model: Path, out_dir: Path, capsys) -> None:
    (model / "config.json").unlink()
    assert_fails(capsys, model, out_dir, str(model / "config.json"), "not found")


def test_missing_shard_named_in_the_index(tmp_path: Path, out_dir: Path, capsys) -> None:
    model = tmp_path / "sharded"
    init_checkpoint_streaming(model, "tiny", seed=0, max_shard_bytes=300_000)
    shard = model / "model-00002-of-00005.safetensors"
    assert json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    shard.unlink()
    assert_fails(capsys, model, out_dir, str(shard), "model.safetensors.index.json", "does not exist")


def test_truncated_safetensors(model: Path, out_dir: Path, capsys) -> None:
    path = model / "model.safetensors"
    os.truncate(path, path.stat().st_size - 1000)
    assert_fails(capsys, model, out_dir, str(path), "truncated")


def test_header_shape_disagreeing_with_config(model: Path, out_dir: Path, capsys) -> None:
    def reshape(tensors: dict) -> None:
        name = "model.layers.1.linear_attn.in_proj_z.weight"
        tensors[name] = tensors[name].reshape(32, -1).contiguous()

    rewrite_weights(model, reshape)
    assert_fails(capsys, model, out_dir, "model.layers.1.linear_attn.in_proj_z.weight", "[32, 128]", "[64, 64]",
                 "config.json")


def test_unknown_tensor(model: Path, out_dir: Path, capsys) -> None:
    def add(tensors: dict) -> None:
        tensors["model.layers.0.linear_attn.extra_gate.weight"] = torch.zeros(4, 64, dtype=torch.bfloat16)

    rewrite_weights(model, add)
    assert_fails(capsys, model, out_dir, "model.layers.0.linear_attn.extra_gate.weight", "does not have")


def test_missing_clover_tensor(model: Path, out_dir: Path, capsys) -> None:
    rewrite_weights(model, lambda tensors: tensors.pop("model.layers.2.linear_attn.bd_softmax_logit_scale"))
    assert_fails(capsys, model, out_dir, "model.layers.2.linear_attn.bd_softmax_logit_scale", "missing")


# ----- spec v2 (sections 2.1-2.3): v1 files, K_r, the block-diffusion tensors' ranks and lengths, the settings
def test_v1_architecture_is_refused_naming_v2(model: Path, out_dir: Path, capsys) -> None:
    edit_config(model, architectures=["CloverMoeForBlockDiffusion"])
    assert_fails(capsys, model, out_dir, "config.json", "field 'architectures'", "spec v1", "spec v2",
                 "CloverMoeModelLM")


def test_v1_config_field_is_refused(model: Path, out_dir: Path, capsys) -> None:
    edit_config(model, linear_conv_right_kernel_dim=4)
    assert_fails(capsys, model, out_dir, "config.json", "field 'linear_conv_right_kernel_dim'", "spec v1")


def test_v1_block_tensors_are_refused_naming_v2(model: Path, out_dir: Path, capsys) -> None:
    def to_v1(tensors: dict) -> None:
        a = "model.layers.0.linear_attn."
        tensors[a + "hist_key"] = torch.zeros(4, 16, dtype=torch.bfloat16)
        del tensors[a + "bd_softmax_history_c"]

    rewrite_weights(model, to_v1)
    assert_fails(capsys, model, out_dir, "model.layers.0.linear_attn.hist_key", "spec v1", "spec v2")


@pytest.mark.parametrize("shape, why", [((128, 4), "K_r = 4"), ((128, 2, 3), "must be"), ((128 * 3 + 1,), "must be"),
                                        ((3, 128), "must be")])
def test_conv_right_weight_of_a_wrong_rank_or_kernel(model: Path, out_dir: Path, capsys, shape, why) -> None:
    name = "model.layers.1.linear_attn.conv_right_weight"
    rewrite_weights(model, lambda tensors: tensors.__setitem__(name, torch.zeros(shape, dtype=torch.bfloat16)))
    assert_fails(capsys, model, out_dir, name, why)


@pytest.mark.parametrize("shape", [(5,), (4, 1), ()])
def test_block_diffusion_vector_of_a_wrong_length(model: Path, out_dir: Path, capsys, shape) -> None:
    name = "model.layers.0.linear_attn.bd_softmax_history_bias"
    rewrite_weights(model, lambda tensors: tensors.__setitem__(name, torch.zeros(shape, dtype=torch.bfloat16)))
    assert_fails(capsys, model, out_dir, name, "[4]")


@pytest.mark.parametrize("value", [0, -0.5, 1.5, "0.9"])
def test_coreset_top_p_outside_the_unit_interval(model: Path, out_dir: Path, capsys, value) -> None:
    edit_config(model, coreset_top_p=value)
    assert_fails(capsys, model, out_dir, "config.json", "field 'coreset_top_p'", "(0, 1]")


@pytest.mark.parametrize("dtype, label", [(torch.float64, "F64"), (torch.int32, "I32")])
def test_unsupported_dtype(model: Path, out_dir: Path, capsys, dtype: torch.dtype, label: str) -> None:
    name = "model.layers.0.mlp.gate.weight"

    def retype(tensors: dict) -> None:
        tensors[name] = tensors[name].to(dtype)

    rewrite_weights(model, retype)
    assert_fails(capsys, model, out_dir, name, f"dtype {label}", "BF16, F16 or F32")


def test_mask_token_id_outside_the_vocabulary(model: Path, out_dir: Path, capsys) -> None:
    edit_config(model, mask_token_id=3072)
    assert_fails(capsys, model, out_dir, "config.json", "field 'mask_token_id'", "3072")


def test_two_shared_experts(model: Path, out_dir: Path, capsys) -> None:
    edit_config(model, num_shared_experts=2)
    assert_fails(capsys, model, out_dir, "config.json", "field 'num_shared_experts'", "only 1")


@pytest.mark.parametrize("kinds, fragment", [
    (["linear_attention"] * 4, "only 'linear_attention'"),
    (["full_attention"] * 4, "only 'full_attention'"),
])
def test_one_layer_kind_is_refused_as_llama_cpp_refuses_it(model: Path, out_dir: Path, capsys, kinds: list[str],
                                                             fragment: str) -> None:
    """docs/gguf-format.md "Checks at load": llama.cpp's clover_moe loader needs GDN and full-attention layers, so
    the converter refuses the config before reading any weight."""
    edit_config(model, layer_types=kinds)
    assert_fails(capsys, model, out_dir, "config.json", "field 'layer_types'", fragment, "both")


def test_gdn_value_heads_narrower_than_key_heads_are_refused(model: Path, out_dir: Path, capsys) -> None:
    edit_config(model, linear_value_head_dim=8)
    assert_fails(capsys, model, out_dir, "config.json", "field 'linear_value_head_dim'", "linear_key_head_dim = 16")


def test_zero_full_attention_interval_is_refused(model: Path, out_dir: Path, capsys) -> None:
    data = json.loads((model / "config.json").read_text())
    data.pop("layer_types", None)
    data["full_attention_interval"] = 0
    (model / "config.json").write_text(json.dumps(data))
    assert_fails(capsys, model, out_dir, "config.json", "field 'full_attention_interval'", "an integer in 1 .. ")


def _drop_mask_id(model: Path) -> None:
    data = json.loads((model / "config.json").read_text())
    del data["mask_token_id"]
    (model / "config.json").write_text(json.dumps(data))


def test_no_mask_token_and_two_candidates(model: Path, out_dir: Path, capsys) -> None:
    """spec 2.2: the mask token by name only when exactly one candidate exists; the message lists them."""
    _drop_mask_id(model)
    path = model / "tokenizer.json"
    data = json.loads(path.read_text())
    data["added_tokens"].append({"id": 3070, "content": "<|MASK_2|>", "special": True, "single_word": False,
                                 "lstrip": False, "rstrip": False, "normalized": False})
    path.write_text(json.dumps(data))
    assert_fails(capsys, model, out_dir, "config.json", "field 'mask_token_id'", "3007 '<|mask|>'",
                 "3070 '<|MASK_2|>'", "--mask-token")


def test_no_mask_token_and_no_candidate(model: Path, out_dir: Path, capsys) -> None:
    _drop_mask_id(model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        path = model / name
        path.write_text(path.read_text().replace("<|mask|>", "<|blank|>"))
    assert_fails(capsys, model, out_dir, "config.json", "field 'mask_token_id'", "are none", "--mask-token")


@pytest.mark.parametrize(("option", "fragment"), [
    (("--mask-token", "<|nope|>"), "--mask-token '<|nope|>' is not a token"),
    (("--threshold", "1.5"), "expected a number in [0, 1]"),
    (("--block-size", "0"), "expected a positive integer"),
    (("--coreset-top-p", "0"), "expected a number in (0, 1]"),
    (("--coreset-top-p", "1.01"), "expected a number in (0, 1]"),
    (("--history-rows", "0"), "expected a positive integer"),
    (("--history-readout-scale", "nan"), "expected a finite number"),
    (("--arch-name", "clover moe"), "expected an architecture name"),
])
def test_bad_block_setting_options(model: Path, out_dir: Path, capsys, option: tuple[str, str],
                                   fragment: str) -> None:
    assert_fails(capsys, model, out_dir, fragment, extra=option)


def test_calibrated_lists_of_different_lengths(model: Path, out_dir: Path, capsys) -> None:
    edit_config(model, calibrated_block_sizes=[4, 8, 16], calibrated_thresholds=[0.9, 0.95])
    assert_fails(capsys, model, out_dir, "config.json", "field 'calibrated_thresholds'", "2 entries", "has 3")


def test_unwritable_output_directory(model: Path, out_dir: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    out_dir.chmod(0o555)
    if os.geteuid() == 0:  # root ignores permission bits: give the answer the kernel gives everyone else
        def refuse(directory: Path, stem: str) -> Path:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(directory))

        monkeypatch.setattr(output, "make_temp_dir", refuse)
    try:
        assert_fails(capsys, model, out_dir, str(out_dir), "cannot be written", "Permission denied")
    finally:
        out_dir.chmod(0o755)


def test_full_disk(model: Path, out_dir: Path) -> None:
    """The file system refuses a write half-way (RLIMIT_FSIZE makes write() fail with EFBIG, as a full disk
    fails with ENOSPC): the partial file is removed."""
    limit = 1_000_000  # the f32 GGUF of tiny is about 2.9 MB

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    before = listing(model, out_dir)
    done = subprocess.run([str(VENV_PYTHON), "-m", "clover_convert", str(model), "--outfile", str(out_dir / "out.gguf"),
                           "--outtype", "f32"], capture_output=True, text=True, preexec_fn=limit_file_size)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("clover-convert: error: "), done.stderr
    assert str(out_dir / "out.gguf") in lines[0] and "File too large" in lines[0]
    assert listing(model, out_dir) == before


def test_not_enough_free_space_is_refused_before_writing(model: Path, out_dir: Path, capsys,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(output.shutil, "disk_usage", lambda path: SimpleNamespace(total=10**12, used=10**12, free=1000))
    assert_fails(capsys, model, out_dir, str(out_dir), "GiB free", "needs")


def test_bad_metadata_file(model: Path, out_dir: Path, tmp_path: Path, capsys) -> None:
    meta = tmp_path / "meta.json"
    meta.write_text("{not json")
    assert_fails(capsys, model, out_dir, str(meta), "not valid JSON", extra=("--metadata", str(meta)))


def test_config_only_directory_needs_dry_run(model: Path, out_dir: Path, capsys) -> None:
    (model / "model.safetensors").unlink()
    assert_fails(capsys, model, out_dir, str(model), "holds no safetensors weights")


def test_model_directory_must_exist(tmp_path: Path, out_dir: Path, capsys) -> None:
    assert_fails(capsys, tmp_path / "nowhere", out_dir, "nowhere", "no such directory")


def test_nonfinite_weights_refused_then_allowed(model: Path, out_dir: Path, capsys) -> None:
    """NaN/inf weights: an error naming the tensor and the count; --allow-nonfinite converts with that warning."""
    name = "model.layers.1.post_attention_layernorm.weight"

    def poison(tensors: dict) -> None:
        t = tensors[name].clone()
        t[:3] = float("nan")
        t[5] = float("-inf")
        tensors[name] = t
    rewrite_weights(model, poison)
    assert_fails(capsys, model, out_dir, name, "4 non-finite values", "--allow-nonfinite")
    code, _, err = run_convert(capsys, model, "--outfile", out_dir / "out.gguf", "--outtype", "f32",
                               "--allow-nonfinite")
    assert code == 0, err
    assert err.strip().splitlines() == [f"clover-convert: warning: {model / 'model.safetensors'}: tensor '{name}' "
                                        "(GGUF blk.1.post_attention_norm.weight) holds 4 non-finite values "
                                        "(NaN or inf)"]
    assert (out_dir / "out.gguf").is_file()


@pytest.mark.parametrize("args, fragments", [
    (("--bd-only", "OUT", "--outfile", "OUT2"), ("--bd-only", "leave out OUT.gguf and --outfile")),
    (("--bd-only", "OUT", "--outtype", "q8_0"), ("--bd-only", "--outtype q8_0 does not apply")),
    (("--bd-only", "OUT", "--split-max-tensors", "3"), ("--split-max-*", "does not apply")),
    (("--bd-only", "OUT", "--bd-sidecar"), ("--bd-sidecar", "not allowed with argument --bd-only")),
    (("--bd-sidecar", "--dry-run", "--skeleton", "--outfile", "OUT"), ("--skeleton", "--bd-sidecar")),
])
def test_sidecar_option_conflicts(model: Path, out_dir: Path, capsys, args: tuple[str, ...],
                                  fragments: tuple[str, ...]) -> None:
    """--bd-only and --bd-sidecar (spec 5, "Files") with options that do not apply: one line, exit 2, no output."""
    before = listing(model, out_dir)
    argv = [str(out_dir / "x.bd.gguf") if a == "OUT" else str(out_dir / "y.gguf") if a == "OUT2" else a for a in args]
    code, stdout, stderr = run_convert(capsys, model, *argv)
    lines = stderr.splitlines()
    assert code == 2 and stdout == "" and len(lines) == 1 and lines[0].startswith("clover-convert: error: "), stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert listing(model, out_dir) == before


def test_sidecar_missing_tensor_leaves_nothing(model: Path, out_dir: Path, capsys) -> None:
    """A checkpoint without a block-diffusion tensor fails --bd-sidecar and --bd-only alike, naming it, and writes
    neither the trunk nor the sidecar."""
    rewrite_weights(model, lambda t: t.pop("model.layers.2.linear_attn.bd_softmax_history_c"))
    assert_fails(capsys, model, out_dir, "model.layers.2.linear_attn.bd_softmax_history_c", "missing",
                 extra=("--bd-sidecar",))
    before = listing(model, out_dir)
    code, _, stderr = run_convert(capsys, model, "--bd-only", out_dir / "x.bd.gguf")
    assert code == 2 and "bd_softmax_history_c" in stderr and len(stderr.splitlines()) == 1, stderr
    assert listing(model, out_dir) == before


def test_sidecar_and_trunk_are_published_together(model: Path, out_dir: Path, capsys) -> None:
    """--bd-sidecar writes the sidecar first, then the trunk: a trunk tensor that fails while streaming (NaN) leaves
    neither file, nor the temporary directory."""
    name = "model.norm.weight"  # the last tensor streamed, after the whole sidecar

    def poison(tensors: dict) -> None:
        tensors[name] = torch.full_like(tensors[name], float("nan"))
    rewrite_weights(model, poison)
    assert_fails(capsys, model, out_dir, name, "non-finite", extra=("--bd-sidecar",))
