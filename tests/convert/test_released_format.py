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

from clover_dev.convert import clover_convert, make_qwen_twin, vendored_convert
from tests.support.convert import copy_checkpoint, llama_cpp_clover_file, rewrite_weights
from tests.support.native import rewrite_gguf
from tests.support.tmp import MkTemp

PROMPT = list(range(40, 72))
BD_SUFFIXES = ("bd_conv_right.weight", "bd_logit_scale", "bd_history_bias", "bd_history_c")


@pytest.fixture(scope="module")
def released(tiny_checkpoint: Path, module_tmp: MkTemp) -> Path:
    model = copy_checkpoint(tiny_checkpoint, module_tmp("released") / "Clover-Tiny-Preview")
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
def released_files(released: Path, module_tmp: MkTemp) -> dict[str, Path]:
    out = module_tmp("released-gguf")
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
def llama_cpp_file(tiny_checkpoint: Path, module_tmp: MkTemp) -> tuple[Path, Path]:
    """(llama.cpp's qwen35moe file of the trunk, the same as llama.cpp's Clover converter would write it)."""
    out = module_tmp("llama-cpp-clover")
    twin = make_qwen_twin(tiny_checkpoint, out / "twin" / tiny_checkpoint.name)
    stock = vendored_convert(twin, out / "stock.gguf", "f32")
    return stock, llama_cpp_clover_file(stock, out / "clover_moe-trunk.gguf")


@pytest.mark.native
def test_llama_cpp_clover_file_gives_stock_qwen35moe_logits(llama_cpp_file: tuple[Path, Path]) -> None:
    """spec 6: causal mode on llama.cpp's Clover file == stock qwen35moe on the same trunk."""
    from clover_native import bindings

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
    from clover_native.loader import NativeError

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
def tiny(tiny_checkpoint: Path, module_tmp: MkTemp) -> Path:
    return clover_convert(tiny_checkpoint, module_tmp("tiny-f32") / "tiny.gguf", "f32")


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


# ------------------------------------------------------------------ a checkpoint that transformers itself wrote
# (the `handmade` fixture, tests/support/handmade.py)
HANDMADE_WINDOWS = [(1, [1, 2, 3, 4, 5, 6, 7]), (9, [2, 4, 6])]  # (boundary, masked rows of an 8-wide window)


@pytest.mark.native
def test_a_checkpoint_written_by_transformers_converts_and_matches_it(handmade: tuple[Path, object],
                                                                       tmp_path: Path) -> None:
    """Native causal logits equal transformers' own on its weights, and block logits the reference's (REF_TOL of
    tests/native/test_native_clover.py, relative to max(1, |logit|)); greedy ar equals transformers' generate,
    spec and auto equal ar, and trunk + sidecar equal the single file in every mode."""
    import torch

    from clover_cpp import Model
    from clover_ref.checkpoint import load_model
    from clover_dev.native import causal_and_block_logits
    from tests.support.native import assert_parity

    checkpoint, hf = handmade
    single = clover_convert(checkpoint, tmp_path / "handmade.gguf", "f32")
    clover_convert(checkpoint, tmp_path / "trunk.gguf", "f32", "--bd-sidecar")
    tokens = [int(t) for t in np.random.default_rng(0).integers(10, 3000, 24)]
    causal, block = causal_and_block_logits(single, [(tokens, HANDMADE_WINDOWS)], window=8)
    with torch.no_grad():
        theirs = hf(torch.tensor([tokens])).logits[0].numpy()
    assert_parity("handmade/causal-vs-transformers", causal, theirs, 1e-3)
    ref = load_model(checkpoint)
    want = []
    for p, masked in HANDMADE_WINDOWS:
        history = ref.new_history()
        ref.forward_causal(tokens[:p], history)
        canvas = [3007 if j in masked else t for j, t in enumerate(tokens[p:p + 8])]
        want.append(ref.forward_block(canvas, history, rows=masked).numpy())
    assert_parity("handmade/block-vs-reference", block, np.concatenate(want), 1e-3)

    with torch.no_grad():
        generated = hf.generate(torch.tensor([tokens]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                pad_token_id=3000)[0, len(tokens):].tolist()
    runs = {}
    for path, bd in ((single, None), (tmp_path / "trunk.gguf", tmp_path / "trunk.bd.gguf")):
        with Model(path, bd_path=bd) as m:
            for mode, opts in (("ar", {}), ("auto", {}), ("spec", {"block_size": 4}),
                               ("diffusion", {"block_size": 8, "threshold": 0.9})):
                m.reset()
                runs[path.name, mode] = m.run(tokens, mode=mode, max_tokens=12, stop_ids=[], **opts).tokens
    assert runs["handmade.gguf", "ar"] == generated
    assert runs["handmade.gguf", "spec"] == runs["handmade.gguf", "auto"] == generated
    for mode in ("ar", "auto", "spec", "diffusion"):
        assert runs["trunk.gguf", mode] == runs["handmade.gguf", mode], mode


@pytest.mark.native
def test_the_fused_pass_on_a_checkpoint_written_by_transformers(handmade: tuple[Path, object],
                                                                tmp_path: Path) -> None:
    """A fused verify + draft pass (docs/native.md, "The fused pass") on transformers' own weights: its causal rows
    equal transformers' logits, and its window the reference's block pass over the history those rows extend."""
    import torch

    from clover_native import bindings
    from clover_ref.checkpoint import load_model
    from tests.support.native import assert_parity

    checkpoint, hf = handmade
    path = clover_convert(checkpoint, tmp_path / "handmade.gguf", "f32")
    tokens = [int(t) for t in np.random.default_rng(1).integers(10, 3000, 24)]
    h, c, mask = 17, 5, 3007
    window = [tokens[h + c]] + [mask] * 7
    ctx = bindings.Context(bindings.LlamaModel(path), n_ctx=256, n_ubatch=64, n_rs_seq=15)
    ctx.causal(tokens[:h])
    got_causal, got_window = ctx.fused(tokens[h:h + c], window)
    with torch.no_grad():
        theirs = hf(torch.tensor([tokens[:h + c]])).logits[0, h:].numpy()
    assert_parity("handmade/fused-causal-vs-transformers", got_causal, theirs, 1e-3)
    ref = load_model(checkpoint)
    history = ref.new_history()
    with torch.no_grad():
        ref.forward_causal(tokens[:h + c], history)
        want = ref.forward_block(window, history).float().numpy()
    assert_parity("handmade/fused-window-vs-reference", got_window, want, 1e-3)
