"""A checkpoint in the released format (spec v2 section 2) and llama.cpp's own Clover GGUFs, end to end.

The released checkpoint is not reachable from here; this one has its shape as public implementations show it:
``CloverMoeModelLM`` with an ``auto_map``, no ``mask_token_id`` in config.json (the mask is the tokenizer's added
special token ``<|mask|>``), and ``conv_right_weight`` stored flat ([c][d-1], cortiq's layout). It must convert
to f16, Q8_0 and one-pass Q4_K_M and run every mode. llama.cpp's converter's file (trunk only, arch
``clover_moe``; tests.support.convert.llama_cpp_clover_file) must run ``ar`` and ``auto`` and refuse the block
modes in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.support.convert import (copy_checkpoint, llama_cpp_clover_file, make_qwen_twin, rewrite_weights,
                                   vendored_convert)
from tests.support.native import clover_convert, rewrite_gguf

PROMPT = list(range(40, 72))
BD_SUFFIXES = ("bd_conv_right.weight", "bd_logit_scale", "bd_history_bias", "bd_history_c")


@pytest.fixture(scope="module")
def released(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = copy_checkpoint(tiny_checkpoint, tmp_path_factory.mktemp("released") / "Clover-Tiny-Preview")
    path = model / "config.json"
    config = json.loads(path.read_text())
    del config["mask_token_id"]
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_clover.CloverMoeModelLM"}
    assert config["architectures"] == ["CloverMoeModelLM"]
    path.write_text(json.dumps(config, indent=2))

    def flatten(tensors: dict) -> None:
        for name in [n for n in tensors if n.endswith("conv_right_weight")]:
            tensors[name] = tensors[name].reshape(-1).contiguous()

    rewrite_weights(model, flatten)
    return model


@pytest.fixture(scope="module")
def released_files(released: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("released-gguf")
    return {t: clover_convert(released, out / f"released-{t}.gguf", t) for t in ("f16", "Q8_0", "Q4_K_M")}


def test_released_format_converts_with_the_mask_found_by_name(released_files: dict[str, Path]) -> None:
    import gguf

    for path in released_files.values():
        reader = gguf.GGUFReader(str(path))
        assert reader.fields["tokenizer.ggml.mask_token_id"].contents() == 3007
        assert reader.fields["general.architecture"].contents() == "clover_moe"
        names = {t.name for t in reader.tensors}
        assert {f"blk.0.{s}" for s in BD_SUFFIXES} <= names


def _run(path: Path, mode: str, **options):
    from clover_cpp.model import Model

    with Model(path, n_ctx=512) as model:
        return model.run(PROMPT, mode=mode, max_tokens=24, stop_ids=[], **options).tokens


@pytest.mark.parametrize("outtype", ["f16", "Q8_0", "Q4_K_M"])
@pytest.mark.native
def test_released_format_runs_every_mode(released_files: dict[str, Path], outtype: str) -> None:
    """Every mode runs; greedy spec and auto equal greedy ar (spec 4.2)."""
    path = released_files[outtype]
    ar = _run(path, "ar")
    assert len(ar) == 24
    assert _run(path, "spec", block_size=4) == ar
    assert _run(path, "auto") == ar
    assert len(_run(path, "diffusion")) == 24


@pytest.fixture(scope="module")
def llama_cpp_file(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(llama.cpp's qwen35moe file of the trunk, the same as llama.cpp's Clover converter would write it)."""
    out = tmp_path_factory.mktemp("llama-cpp-clover")
    twin = make_qwen_twin(tiny_checkpoint, out / "twin" / tiny_checkpoint.name)
    stock = vendored_convert(twin, out / "stock.gguf", "f32")
    return stock, llama_cpp_clover_file(stock, out / "clover_moe-trunk.gguf")


@pytest.mark.native
def test_llama_cpp_clover_file_gives_stock_qwen35moe_logits(llama_cpp_file: tuple[Path, Path]) -> None:
    """spec 6: causal mode on llama.cpp's Clover file == stock qwen35moe on the same trunk."""
    from clover_cpp import bindings

    stock, trunk = llama_cpp_file
    logits = []
    for path in (stock, trunk):
        ctx = bindings.Context(bindings.LlamaModel(path), n_ctx=256, n_ubatch=64)
        logits.append(ctx.causal(PROMPT))
    np.testing.assert_array_equal(logits[0], logits[1])


@pytest.mark.native
def test_llama_cpp_clover_file_runs_ar_and_auto(llama_cpp_file: tuple[Path, Path], tiny: Path) -> None:
    """A trunk-only file runs ar and auto (n-gram drafts only), with our single file's ar output; diffusion and
    spec say in one line what is missing and how to add it."""
    from clover_cpp.loader import NativeError

    _, trunk = llama_cpp_file
    ar = _run(trunk, "ar")
    assert ar == _run(tiny, "ar")
    assert _run(trunk, "auto") == ar
    for mode in ("diffusion", "spec"):
        with pytest.raises(NativeError) as info:
            _run(trunk, mode)
        text = str(info.value)
        assert "\n" not in text.strip() and "block-diffusion" in text and "--bd-only" in text, text


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return clover_convert(tiny_checkpoint, tmp_path_factory.mktemp("tiny-f32") / "tiny.gguf", "f32")


@pytest.mark.native
def test_our_file_without_block_tensors_is_a_trunk_only_file(tiny: Path, tmp_path: Path) -> None:
    """Dropping the four block-diffusion tensors of every GDN layer leaves a loadable trunk-only file; dropping
    some of them is a load error that names the first one missing."""
    import gguf

    from tests.support.native import load_in_subprocess

    names = [t.name for t in gguf.GGUFReader(str(tiny)).tensors]
    bd = [n for n in names if n.endswith(BD_SUFFIXES)]
    trunk = rewrite_gguf(tiny, tmp_path / "trunk.gguf", drop_tensors=bd)
    assert _run(trunk, "ar") == _run(tiny, "ar")
    partial = rewrite_gguf(tiny, tmp_path / "partial.gguf", drop_tensors=[n for n in bd if n.startswith("blk.1.")])
    done = load_in_subprocess(partial)
    assert done.returncode == 3 and "blk.1.bd_" in done.stdout + done.stderr, done.stdout + done.stderr
