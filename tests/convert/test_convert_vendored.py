"""Equality with llama.cpp's own converter (docs/gguf-format.md).

The same checkpoint without the Clover tensors and keys is a plain Qwen3.5-MoE checkpoint. The vendored
convert_hf_to_gguf.py of the pinned sdist, run with its own gguf-py, turns it into a ``qwen35moe`` GGUF.
For every outtype, each of its tensors must be byte-identical to ours (``ssm_a`` may differ by one ULP:
torch's float32 exp against our correctly rounded one), and its keys must equal ours apart from the arch
prefix; ours add exactly the Clover tensors and keys.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from clover_dev.convert import make_qwen_twin, vendored_convert
from tests.support.convert import CLOVER_KEYS, convert, fields, llama_cpp_clover_file
from tests.support.tmp import MkTemp

CLOVER_TENSOR_SUFFIXES = ("bd_conv_right.weight", "bd_logit_scale", "bd_history_bias", "bd_history_c")
# general.size_label counts parameters, and ours has the Clover tensors too
DIFFERENT_VALUES = {"general.architecture", "general.size_label"}


def twin_of(checkpoint: Path, mktemp: MkTemp) -> Path:
    """The Qwen3.5-MoE twin, in a directory with the same name (general.name derives from it)."""
    return make_qwen_twin(checkpoint, mktemp("twin") / checkpoint.name)


@pytest.fixture(scope="module")
def tiny_twin(tiny_checkpoint: Path, module_tmp: MkTemp) -> Path:
    return twin_of(tiny_checkpoint, module_tmp)


@pytest.fixture(scope="module")
def mid_twin(mid_checkpoint: Path, module_tmp: MkTemp) -> Path:
    return twin_of(mid_checkpoint, module_tmp)


def assert_same_as_vendored(ours: Path, theirs: Path, their_arch: str = "qwen35moe") -> None:
    our_tensors = {t.name: t for t in gguf.GGUFReader(ours).tensors}
    their_tensors = {t.name: t for t in gguf.GGUFReader(theirs).tensors}
    extra = set(our_tensors) - set(their_tensors)
    assert extra and all(name.endswith(CLOVER_TENSOR_SUFFIXES) for name in extra)
    assert set(their_tensors) <= set(our_tensors)
    ulp_differences = 0
    for name, theirs_t in their_tensors.items():
        ours_t = our_tensors[name]
        assert ours_t.tensor_type == theirs_t.tensor_type, name
        assert list(ours_t.shape) == list(theirs_t.shape), name
        a, b = np.asarray(ours_t.data), np.asarray(theirs_t.data)
        if name.endswith("ssm_a"):
            bits = np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32))
            assert bits.max() <= 1, name
            ulp_differences += int(bits.sum())
        else:
            assert a.tobytes() == b.tobytes(), f"{name} differs from llama.cpp's converter"
    assert ulp_differences < sum(n.endswith("ssm_a") for n in their_tensors) * 64  # a few values, not a pattern

    our_keys, their_keys = fields(ours, "clover_moe"), fields(theirs, their_arch)
    # upstream's Clover converter adds expert_shared_count to qwen35moe's keys (spec 5)
    shared = set() if their_arch == "clover_moe" else {"ARCH.expert_shared_count"}
    assert set(our_keys) - set(their_keys) == CLOVER_KEYS | shared
    assert set(their_keys) <= set(our_keys)
    for key, value in their_keys.items():
        if key not in DIFFERENT_VALUES:
            assert our_keys[key] == value, key
    assert our_keys["general.architecture"][1] == "clover_moe" and their_keys["general.architecture"][1] == their_arch


@pytest.mark.parametrize("outtype", ["f32", "bf16", "q8_0"])
def test_tiny_equals_llama_cpp_converter(tiny_checkpoint: Path, tiny_twin: Path, tmp_path: Path, capsys,
                                         outtype: str) -> None:
    theirs = vendored_convert(tiny_twin, tmp_path / "theirs.gguf", outtype)
    ours = convert(capsys, tiny_checkpoint, tmp_path / "ours.gguf", outtype)
    assert_same_as_vendored(ours, theirs)


def test_trunk_equals_the_llama_cpp_clover_converter_file(tiny_checkpoint: Path, tiny_twin: Path, tmp_path: Path,
                                                          capsys) -> None:
    """spec 6: our trunk == what llama.cpp's Clover converter writes, key for key and tensor for tensor (that file
    made by tests.support.convert.llama_cpp_clover_file from the vendored qwen35moe converter)."""
    theirs = llama_cpp_clover_file(vendored_convert(tiny_twin, tmp_path / "q.gguf", "f32"), tmp_path / "theirs.gguf")
    ours = convert(capsys, tiny_checkpoint, tmp_path / "ours.gguf", "f32")
    assert_same_as_vendored(ours, theirs, their_arch="clover_moe")


@pytest.mark.slow
@pytest.mark.parametrize("outtype", ["bf16", "q8_0"])
def test_mid_equals_llama_cpp_converter(mid_checkpoint: Path, mid_twin: Path, tmp_path: Path, capsys,
                                        outtype: str) -> None:
    theirs = vendored_convert(mid_twin, tmp_path / "theirs.gguf", outtype)
    ours = convert(capsys, mid_checkpoint, tmp_path / "ours.gguf", outtype)
    assert_same_as_vendored(ours, theirs)
