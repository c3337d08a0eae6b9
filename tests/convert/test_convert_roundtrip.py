"""clover-convert round trips (spec 5, docs/gguf-format.md): every GGUF tensor equals the Hugging Face tensor under the
documented transform, and every metadata key the spec names is present with the right value and type."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from clover_convert import encoding, streaming
from clover_convert.converter import ConvertOptions, convert as convert_api
from clover_ref.checkpoint import save_model
from clover_common.config import CloverConfig
from clover_ref.factory import init_checkpoint, init_checkpoint_streaming, preset_config, random_model
from clover_common.tokenizer import MASK_TOKEN, special_token_ids
from clover_dev import VENV_PYTHON
from tests.support.convert import (assert_tensor_matches, convert, expected_gguf, expected_type, fields, hf_state,
                                   run_convert, tensor_values)

V = gguf.GGUFValueType
FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}


def assert_round_trip(model_dir: Path, path: Path, outtype: str) -> None:
    config = CloverConfig.load(model_dir)
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    expected = dict(expected_gguf(hf_state(model_dir), config))
    assert sorted(tensors) == sorted(expected)
    for name, want in expected.items():
        t = tensors[name]
        want_np = want.numpy()
        assert t.tensor_type == expected_type(name, want_np.shape, outtype), name
        assert_tensor_matches(name, tensor_values(t), want_np, t.tensor_type)


def assert_spec_keys(path: Path, config: CloverConfig, outtype: str) -> None:
    """Spec section 5: the qwen35moe keys under clover_moe., the clover keys, tokenizer and general keys."""
    c = config
    got = fields(path, "clover_moe")
    f32 = lambda x: float(np.float32(x))  # noqa: E731
    want = {
        "general.architecture": ([V.STRING], "clover_moe"),
        "general.type": ([V.STRING], "model"),
        "general.file_type": ([V.UINT32], FILE_TYPES[outtype]),
        "general.quantization_version": ([V.UINT32], 2),
        "ARCH.block_count": ([V.UINT32], c.num_hidden_layers),
        "ARCH.context_length": ([V.UINT32], c.max_position_embeddings),
        "ARCH.embedding_length": ([V.UINT32], c.hidden_size),
        "ARCH.attention.head_count": ([V.UINT32], c.num_attention_heads),
        "ARCH.attention.head_count_kv": ([V.UINT32], c.num_key_value_heads),
        "ARCH.rope.dimension_sections": ([V.ARRAY, V.INT32], [*c.rope_parameters["mrope_section"], 0][:4]),
        "ARCH.rope.freq_base": ([V.FLOAT32], f32(c.rope_theta)),
        "ARCH.attention.layer_norm_rms_epsilon": ([V.FLOAT32], f32(c.rms_norm_eps)),
        "ARCH.expert_count": ([V.UINT32], c.num_experts),
        "ARCH.expert_used_count": ([V.UINT32], c.num_experts_per_tok),
        "ARCH.attention.key_length": ([V.UINT32], c.head_dim),
        "ARCH.attention.value_length": ([V.UINT32], c.head_dim),
        "ARCH.expert_feed_forward_length": ([V.UINT32], c.moe_intermediate_size),
        "ARCH.expert_shared_feed_forward_length": ([V.UINT32], c.shared_expert_intermediate_size),
        "ARCH.ssm.conv_kernel": ([V.UINT32], c.linear_conv_kernel_dim),
        "ARCH.ssm.state_size": ([V.UINT32], c.linear_key_head_dim),
        "ARCH.ssm.group_count": ([V.UINT32], c.linear_num_key_heads),
        "ARCH.ssm.time_step_rank": ([V.UINT32], c.linear_num_value_heads),
        "ARCH.ssm.inner_size": ([V.UINT32], c.value_dim),
        "ARCH.attention.recurrent_layers": ([V.ARRAY, V.BOOL], [c.is_linear(i) for i in range(c.num_hidden_layers)]),
        "ARCH.full_attention_interval": ([V.UINT32], c.full_attention_interval),
        "ARCH.rope.dimension_count": ([V.UINT32], c.rotary_dim),
        # clover keys
        "ARCH.block_size": ([V.UINT32], c.block_size),
        "ARCH.diffusion.threshold": ([V.FLOAT32], f32(c.confidence_threshold)),
        "ARCH.diffusion.calibrated_block_sizes": ([V.ARRAY, V.UINT32], c.calibrated_block_sizes),
        "ARCH.diffusion.calibrated_thresholds": ([V.ARRAY, V.FLOAT32], [f32(t) for t in c.calibrated_thresholds]),
        "ARCH.diffusion.coreset_top_p": ([V.FLOAT32], f32(c.coreset_top_p)),
        "ARCH.diffusion.history_rows": ([V.UINT32], c.history_rows),
        "ARCH.bd.history_readout_scale": ([V.FLOAT32], f32(1 / math.sqrt(c.linear_key_head_dim))),
        "ARCH.expert_shared_count": ([V.UINT32], 1),
        "diffusion.shift_logits": ([V.BOOL], True),
        "tokenizer.ggml.mask_token_id": ([V.UINT32], c.mask_token_id),
        # tokenizer
        "tokenizer.ggml.model": ([V.STRING], "gpt2"),
        "tokenizer.ggml.pre": ([V.STRING], "qwen35"),
        "tokenizer.ggml.eos_token_id": ([V.UINT32], special_token_ids()["<|im_end|>"]),
        "tokenizer.ggml.padding_token_id": ([V.UINT32], special_token_ids()["<|endoftext|>"]),
        "tokenizer.ggml.add_bos_token": ([V.BOOL], False),
        "tokenizer.ggml.add_eos_token": ([V.BOOL], False),
    }
    for key, (types, value) in want.items():
        assert key in got, f"missing key {key}"
        assert got[key] == ([int(t) for t in types], value), key
    assert len(got["tokenizer.ggml.tokens"][1]) == c.vocab_size
    assert len(got["tokenizer.ggml.token_type"][1]) == c.vocab_size
    assert len(got["tokenizer.ggml.merges"][1]) > 0
    assert "<|im_start|>" in got["tokenizer.chat_template"][1]
    assert got["general.name"][0] == [V.STRING] and got["general.size_label"][0] == [V.STRING]
    assert got["tokenizer.ggml.tokens"][1][c.mask_token_id] == MASK_TOKEN


# ------------------------------------------------------------------------------------------------ tiny
@pytest.mark.parametrize("outtype", ["f32", "f16", "bf16", "q8_0"])
def test_tiny_round_trip(tiny_checkpoint: Path, tmp_path: Path, capsys, outtype: str) -> None:
    out = convert(capsys, tiny_checkpoint, tmp_path / "tiny.gguf", outtype)
    assert_round_trip(tiny_checkpoint, out, outtype)
    assert_spec_keys(out, CloverConfig.load(tiny_checkpoint), outtype)


def test_value_heads_are_tiled(tiny_checkpoint: Path, tmp_path: Path, capsys) -> None:
    """Spec 5: GGUF value head h' uses key head h' mod n_k, i.e. it holds HF head (h' mod n_k) * r + h' // n_k."""
    config = CloverConfig.load(tiny_checkpoint)
    n_k, n_v = config.linear_num_key_heads, config.linear_num_value_heads
    assert n_v == 2 * n_k, "the test preset must have n_v = 2 n_k to catch ordering mistakes"
    out = convert(capsys, tiny_checkpoint, tmp_path / "t.gguf", "f32")
    tensors = {t.name: tensor_values(t) for t in gguf.GGUFReader(out).tensors}
    state = hf_state(tiny_checkpoint)
    for h in range(n_v):
        hf_head = (h % n_k) * (n_v // n_k) + h // n_k
        for hf, name in (("bd_softmax_logit_scale", "bd_logit_scale"), ("bd_softmax_history_bias", "bd_history_bias"),
                         ("bd_softmax_history_c", "bd_history_c")):
            assert tensors[f"blk.0.{name}"][h] == state[f"model.layers.0.linear_attn.{hf}"][hf_head]
        v = 2 * config.key_dim + h * config.linear_value_head_dim  # first channel of GGUF value head h
        hf_v = 2 * config.key_dim + hf_head * config.linear_value_head_dim
        np.testing.assert_array_equal(tensors["blk.0.bd_conv_right.weight"][v],
                                      state["model.layers.0.linear_attn.conv_right_weight"][hf_v].numpy())
    assert n_v > 1 and not np.array_equal(tensors["blk.0.bd_history_bias"],
                                          state["model.layers.0.linear_attn.bd_softmax_history_bias"].numpy())


def _same_tensors(a: Path, b: Path) -> None:
    ta = {t.name: (t.tensor_type, np.asarray(t.data).tobytes()) for t in gguf.GGUFReader(a).tensors}
    tb = {t.name: (t.tensor_type, np.asarray(t.data).tobytes()) for t in gguf.GGUFReader(b).tensors}
    assert ta == tb


def test_nested_sharded_and_fused_layouts_convert_identically(tiny_checkpoint: Path, tmp_path: Path, capsys) -> None:
    """model.language_model. prefix + text_config + shards, and fused gate_up_proj experts, give the same tensors."""
    base = convert(capsys, tiny_checkpoint, tmp_path / "base.gguf", "q8_0")
    nested = tmp_path / "nested"
    init_checkpoint(nested, "tiny", seed=0, nested=True, max_shard_bytes=300_000)
    assert json.loads((nested / "config.json").read_text()).get("text_config")
    assert (nested / "model.safetensors.index.json").exists()
    _same_tensors(base, convert(capsys, nested, tmp_path / "nested.gguf", "q8_0"))
    fused = tmp_path / "fused"
    config = preset_config("tiny")
    model = random_model(config, 0)
    from clover_ref.checkpoint import round_to_dtype
    round_to_dtype(model, "bfloat16")
    save_model(model, fused, fused_experts=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (fused / name).write_bytes((tiny_checkpoint / name).read_bytes())
    assert "model.layers.0.mlp.experts.gate_up_proj" in hf_state(fused)
    _same_tensors(base, convert(capsys, fused, tmp_path / "fused.gguf", "q8_0"))


def test_vision_and_mtp_tensors_are_skipped_with_a_warning(tiny_checkpoint: Path, tmp_path: Path, capsys) -> None:
    from tests.support.convert import copy_checkpoint, rewrite_weights

    model = copy_checkpoint(tiny_checkpoint, tmp_path / "tiny")

    def add_extras(tensors: dict) -> None:
        tensors["mtp.fc.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
        tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)

    rewrite_weights(model, add_extras)
    code, _, err = run_convert(capsys, model, "--outfile", tmp_path / "x.gguf", "--outtype", "bf16")
    assert code == 0, err
    assert "skipping 2 vision/MTP tensors" in err
    _same_tensors(tmp_path / "x.gguf", convert(capsys, tiny_checkpoint, tmp_path / "base.gguf", "bf16"))


@pytest.mark.parametrize("source_dtype, auto_type", [("float32", "f16"), ("float16", "f16")])
def test_f32_and_f16_sources(tmp_path: Path, capsys, source_dtype: str, auto_type: str) -> None:
    model = tmp_path / "m"
    init_checkpoint(model, "tiny", seed=3, dtype=source_dtype)
    out = convert(capsys, model, tmp_path / "x.gguf", "f32")
    assert_round_trip(model, out, "f32")
    code, _, err = run_convert(capsys, model, "--outfile", tmp_path / "auto-{ftype}.gguf")
    assert code == 0, err
    assert (tmp_path / f"auto-{auto_type}.gguf").exists()


def test_auto_is_bf16_for_bf16_sources_and_default_name(tiny_checkpoint: Path, tmp_path: Path, capsys) -> None:
    from tests.support.convert import copy_checkpoint

    model = copy_checkpoint(tiny_checkpoint, tmp_path / "tiny")
    code, out, err = run_convert(capsys, model)
    assert code == 0, err
    (path,) = model.glob("*.gguf")
    got = fields(path, "clover_moe")
    assert path.name == f"{got['general.name'][1]}-{got['general.size_label'][1]}-BF16.gguf"
    assert got["general.file_type"][1] == FILE_TYPES["bf16"]
    assert out.strip() == str(path)


def test_metadata_override(tiny_checkpoint: Path, tmp_path: Path, capsys) -> None:
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"general.name": "Clover Test", "general.license": "apache-2.0",
                                "general.base_models": [{"name": "Qwen3.6 35B A3B", "organization": "Qwen"}]}))
    code, _, err = run_convert(capsys, tiny_checkpoint, "--outfile", tmp_path, "--outtype", "bf16", "--metadata", meta)
    assert code == 0, err
    (path,) = tmp_path.glob("*.gguf")
    got = fields(path, "clover_moe")
    assert got["general.name"][1] == "Clover Test"
    assert got["general.license"][1] == "apache-2.0"
    assert got["general.base_model.0.name"][1] == "Qwen3.6 35B A3B"
    assert path.name.startswith("Clover-Test-")


def test_licence_and_base_model_from_the_model_card(tiny_checkpoint: Path, tmp_path: Path, capsys) -> None:
    from tests.support.convert import copy_checkpoint

    model = copy_checkpoint(tiny_checkpoint, tmp_path / "Clover-Tiny-Preview")
    (model / "README.md").write_text("---\nlicense: apache-2.0\nbase_model: Qwen/Qwen3.6-35B-A3B\n---\n# Clover\n")
    out = convert(capsys, model, tmp_path / "x.gguf", "bf16")
    got = fields(out, "clover_moe")
    assert got["general.license"][1] == "apache-2.0"
    assert got["general.base_model.count"][1] == 1
    assert got["general.base_model.0.repo_url"][1] == "https://huggingface.co/Qwen/Qwen3.6-35B-A3B"


def test_streamed_random_checkpoint(tmp_path: Path, capsys) -> None:
    """The bench's checkpoint writer: sharded, Clover tensors in a shard of their own, loadable, convertible."""
    from clover_ref.checkpoint import load_model
    from clover_common.layout import is_clover_tensor

    model = tmp_path / "streamed"
    init_checkpoint_streaming(model, "tiny", seed=5, max_shard_bytes=500_000, separate_clover_shard=True)
    weight_map = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    last = max(weight_map.values())
    assert {is_clover_tensor(n) for n, f in weight_map.items() if f == last} == {True}
    assert not any(is_clover_tensor(n) for n, f in weight_map.items() if f != last)
    load_model(model)
    assert_round_trip(model, convert(capsys, model, tmp_path / "s.gguf", "q8_0"), "q8_0")


# ------------------------------------------------------------------------------------------------ streaming
def test_chunk_and_slice_sizes_and_threads_do_not_change_the_bytes(tiny_checkpoint: Path, tmp_path: Path, capsys,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    reference = convert(capsys, tiny_checkpoint, tmp_path / "ref.gguf", "q8_0", "--threads", "1")
    monkeypatch.setattr(streaming, "CHUNK_ELEMENTS", 100)  # smaller than most rows: one row per chunk
    monkeypatch.setattr(encoding, "SLICE_ELEMENTS", 64)
    small = convert(capsys, tiny_checkpoint, tmp_path / "small.gguf", "q8_0", "--threads", "3")
    assert small.read_bytes() == reference.read_bytes()


def test_every_chunk_of_the_35b_plan_is_bounded(tmp_path: Path) -> None:
    """Memory is bounded by one chunk: no chunk of the full 35B model exceeds CHUNK_ELEMENTS values."""
    from clover_convert.tensor_plan import OutType, build_plan

    config = preset_config("35b-shape")
    plan = build_plan(config, OutType.Q8_0, None)
    largest = 0
    for tensor in plan.tensors:
        covered = 0
        for chunk in streaming.iter_chunks(tensor):
            elements = sum(s.count for s in chunk.spans)
            assert elements == chunk.rows * tensor.row_length
            assert elements <= max(streaming.CHUNK_ELEMENTS, tensor.row_length)
            covered += elements
            largest = max(largest, elements)
        assert covered == tensor.n_elements, tensor.name
    assert largest == streaming.CHUNK_ELEMENTS  # the embedding and expert stacks are split


def test_progress_bar_counts_bytes_on_stderr(tiny_checkpoint: Path, tmp_path: Path, capsys) -> None:
    result = convert_api(ConvertOptions(tiny_checkpoint, tmp_path / "p.gguf", "bf16", progress=True))
    err = capsys.readouterr().err
    assert "clover-convert" in err and "100%" in err and "B" in err
    assert result.paths == [tmp_path / "p.gguf"]


def test_split_output(tiny_checkpoint: Path, tmp_path: Path, capsys) -> None:
    whole = convert(capsys, tiny_checkpoint, tmp_path / "whole.gguf", "bf16")
    code, out, err = run_convert(capsys, tiny_checkpoint, "--outfile", tmp_path / "split.gguf", "--outtype", "bf16",
                                 "--split-max-tensors", "30")
    assert code == 0, err
    shards = sorted(tmp_path.glob("split-*.gguf"))
    n = len(shards)
    assert n == 3 and [s.name for s in shards] == [f"split-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    assert out.split() == [str(s) for s in shards]
    assert not (tmp_path / "split.gguf").exists()
    names: dict[str, bytes] = {}
    for i, shard in enumerate(shards):
        reader = gguf.GGUFReader(shard)
        assert reader.fields["split.no"].contents() == i
        assert reader.fields["split.count"].contents() == n
        assert reader.fields["split.tensors.count"].contents() == 88
        assert len(reader.tensors) <= 30
        names.update({t.name: np.asarray(t.data).tobytes() for t in reader.tensors})
    assert names == {t.name: np.asarray(t.data).tobytes() for t in gguf.GGUFReader(whole).tensors}
    code, _, err = run_convert(capsys, tiny_checkpoint, "--outfile", tmp_path / "bysize.gguf", "--outtype", "f32",
                               "--split-max-size", "1M")
    assert code == 0, err
    sizes = [p.stat().st_size for p in sorted(tmp_path.glob("bysize-*.gguf"))]
    assert len(sizes) >= 3 and all(s < 1_000_000 + 200_000 for s in sizes)


# ------------------------------------------------------------------------------------------------ dry run
def test_dry_run_prints_the_plan_without_reading_data(tiny_checkpoint: Path, tmp_path: Path, capsys,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    real = convert(capsys, tiny_checkpoint, tmp_path / "real.gguf", "q8_0")
    sizes = {t.name: (t.tensor_type.name, int(t.n_bytes), list(t.shape)) for t in gguf.GGUFReader(real).tensors}

    def no_reading(*args: object) -> None:
        raise AssertionError("the dry run read tensor data")

    monkeypatch.setattr(streaming.SourceReader, "read", no_reading)
    before = sorted(p.name for p in tmp_path.iterdir())
    code, out, err = run_convert(capsys, tiny_checkpoint, "--outfile", tmp_path / "dry.gguf", "--outtype", "q8_0",
                                 "--dry-run")
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    lines = out.splitlines()
    plan = {}
    for line in lines[:-2]:
        name, rest = line.split(maxsplit=1)
        shape = rest[rest.index("{") + 1:rest.index("}")]
        kind, nbytes = rest[rest.index("}") + 1:].split()
        plan[name] = (kind, int(nbytes.replace(",", "")), [int(x) for x in shape.split(",")])
    assert plan == sizes
    total = sum(s[1] for s in sizes.values())
    assert f"{len(sizes)} tensors, {total:,d} bytes" in lines[-2]
    assert lines[-1].startswith(f"would write {tmp_path / 'dry.gguf'}")


def test_dry_run_of_the_full_35b_config(tmp_path: Path, capsys) -> None:
    """--dry-run works on a config-only directory; the 35B plan has the real tensor count and sizes."""
    model = tmp_path / "clover-35b"
    init_checkpoint(model, "35b-shape", config_only=True)
    totals = {}
    for outtype in ("bf16", "q8_0"):
        code, out, err = run_convert(capsys, model, "--outtype", outtype, "--dry-run")
        assert code == 0, err
        assert "holds no weights" in err
        summary = out.splitlines()[-2]
        assert summary.startswith("853 tensors"), summary  # 30 GDN layers x 23 + 10 attention layers x 16 + 3
        totals[outtype] = int(summary.split()[2].replace(",", ""))
    assert not list(model.glob("*.gguf"))
    (model / "tokenizer.json").unlink()  # a bare config.json is enough for a plan
    code, out, err = run_convert(capsys, model, "--outtype", "q8_0", "--dry-run")
    assert code == 0 and "no tokenizer.json" in err
    assert int(out.splitlines()[-2].split()[2].replace(",", "")) == totals["q8_0"]
    # BF16: 2 bytes per matrix value; Q8_0: 34/32 bytes; F32 norms/router/conv are the same in both
    assert 0.52 < totals["q8_0"] / totals["bf16"] < 0.56
    assert 64e9 < totals["bf16"] < 72e9


# ------------------------------------------------------------------------------------------------ mid
@pytest.mark.slow
@pytest.mark.parametrize("outtype", ["bf16", "q8_0"])
def test_mid_round_trip(mid_checkpoint: Path, tmp_path: Path, capsys, outtype: str) -> None:
    out = convert(capsys, mid_checkpoint, tmp_path / "mid.gguf", outtype)
    assert_round_trip(mid_checkpoint, out, outtype)
    assert_spec_keys(out, CloverConfig.load(mid_checkpoint), outtype)


@pytest.mark.slow
def test_mid_peak_memory_is_bounded(mid_checkpoint: Path, tmp_path: Path) -> None:
    """A regression guard for the streaming design: converting the 680 MB mid checkpoint to q8_0 with the
    default threads stays well below 512 MiB (the bench shows the same for a 5 GB checkpoint).

    The converter runs under a small Python parent that reports its children's peak RSS: a child forked
    straight from pytest would count pytest's own pages in ru_maxrss."""
    measure = ("import resource, subprocess, sys; rc = subprocess.call(sys.argv[1:], stdout=subprocess.DEVNULL); "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", measure, str(VENV_PYTHON), "-m", "clover_convert",
                           str(mid_checkpoint), "--outfile", str(tmp_path / "m.gguf"), "--outtype", "q8_0"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    peak_mib = int(done.stdout.split()[-1]) / 1024
    assert (tmp_path / "m.gguf").stat().st_size > 300e6
    assert peak_mib < 512, f"peak RSS {peak_mib:.0f} MiB"


# ------------------------------------------------------------------------------------------------ spec v2 format
@pytest.mark.parametrize("rank", ["3d", "flat", "flat-dc"])
def test_conv_right_weight_in_every_accepted_rank(tiny_checkpoint: Path, tmp_path: Path, capsys, rank: str) -> None:
    """spec 2.3: [conv_dim, K_r], [conv_dim, 1, K_r] and flat [conv_dim*K_r] ([c][d-1], or [d-1][c] with
    --conv-right-order dc) give the same GGUF."""
    from tests.support.convert import copy_checkpoint, rewrite_weights

    want = convert(capsys, tiny_checkpoint, tmp_path / "want.gguf", "f32")
    model = copy_checkpoint(tiny_checkpoint, tmp_path / "model")

    def reshape(tensors: dict) -> None:
        for name in [n for n in tensors if n.endswith("linear_attn.conv_right_weight")]:
            t = tensors[name]
            tensors[name] = {"3d": t[:, None, :], "flat": t.reshape(-1), "flat-dc": t.T.reshape(-1)}[rank].contiguous()

    rewrite_weights(model, reshape)
    extra = ("--conv-right-order", "dc") if rank == "flat-dc" else ()
    got = convert(capsys, model, tmp_path / "got.gguf", "f32", *extra)
    _same_tensors(want, got)


def test_arch_name_option_and_sampling_keys(tiny_checkpoint: Path, tmp_path: Path, capsys) -> None:
    """spec 5: --arch-name writes another spelling under its own prefix; general.sampling.* come from
    generation_config.json, as llama.cpp's converter writes them."""
    from tests.support.convert import copy_checkpoint

    model = copy_checkpoint(tiny_checkpoint, tmp_path / "model")
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                              "repetition_penalty": 1.05}))
    out = convert(capsys, model, tmp_path / "x.gguf", "f32", "--arch-name", "clover-moe")
    got = fields(out, "clover-moe")
    assert got["general.architecture"][1] == "clover-moe"
    assert got["ARCH.block_size"][1] == 8 and got["ARCH.expert_shared_count"][1] == 1
    assert got["general.sampling.temp"][1] == pytest.approx(0.6)
    assert got["general.sampling.top_k"][1] == 20
    assert got["general.sampling.penalty_repeat"][1] == pytest.approx(1.05)


def test_penalty_keys_from_generation_config(tiny_checkpoint: Path, tmp_path: Path, capsys) -> None:
    """spec 2.2 ("penalties") and 4: generation_config.json's presence_penalty and frequency_penalty become
    llama.cpp's general.sampling.penalty_present and general.sampling.penalty_freq (f32; repetition_penalty is
    general.sampling.penalty_repeat), in the single file and in a --bd-sidecar trunk, where the engine and
    common_sampler read them; the single file has general.sampling.penalty_response_only true (spec 4.5), the
    trunk does not (spec 6); absent or null: no key; anything but a finite number is refused, naming the field."""
    from tests.support.convert import copy_checkpoint

    model = copy_checkpoint(tiny_checkpoint, tmp_path / "model")
    generation = model / "generation_config.json"
    generation.write_text(json.dumps({"repetition_penalty": 1.1, "presence_penalty": 1.5, "frequency_penalty": -0.25}))
    single = fields(convert(capsys, model, tmp_path / "single.gguf", "f32"), "clover_moe")
    convert(capsys, model, tmp_path / "trunk.gguf", "f32", "--bd-sidecar")
    trunk, sidecar = fields(tmp_path / "trunk.gguf", "clover_moe"), fields(tmp_path / "trunk.bd.gguf", "clover_moe")
    for got in (single, trunk):
        assert got["general.sampling.penalty_present"] == ([V.FLOAT32], pytest.approx(1.5))
        assert got["general.sampling.penalty_freq"] == ([V.FLOAT32], pytest.approx(-0.25))
        assert got["general.sampling.penalty_repeat"][1] == pytest.approx(1.1)
        assert not any(key.startswith("ARCH.sampling.") for key in got)
    assert single["general.sampling.penalty_response_only"] == ([V.BOOL], True)
    assert "general.sampling.penalty_response_only" not in trunk
    assert [key for key in sidecar if "sampling" in key] == ["general.sampling.penalty_response_only"]

    generation.write_text(json.dumps({"presence_penalty": None, "temperature": 0.7}))
    got = fields(convert(capsys, model, tmp_path / "none.gguf", "f32"), "clover_moe")
    assert "general.sampling.penalty_present" not in got and "general.sampling.penalty_freq" not in got
    assert got["general.sampling.penalty_response_only"] == ([V.BOOL], True)

    for bad in ("high", True, math.nan, math.inf, [1], 1e39, 10**400):
        generation.write_text(json.dumps({"frequency_penalty": bad}))
        code, _, err = run_convert(capsys, model, "--outfile", tmp_path / "bad.gguf", "--outtype", "f32")
        assert code == 2 and "generation_config.json: field 'frequency_penalty'" in err and "finite" in err, err
        assert not (tmp_path / "bad.gguf").exists()
