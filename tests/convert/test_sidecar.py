"""The block-diffusion sidecar (spec v2 section 5, "Files"; docs/gguf-format.md).

``clover-convert --bd-sidecar`` writes the trunk-only file that llama.cpp's Clover converter writes plus NAME.bd.gguf;
``--bd-only`` writes the sidecar alone, reading only the block-diffusion tensors. A trunk (ours, or llama.cpp's file
from tests.support.convert.llama_cpp_clover_file) with its sidecar must equal the single file bit for bit in every
mode; a sidecar of another trunk is refused with the differing fingerprint fields named.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from clover_convert.sidecar import config_fingerprint, gguf_fingerprint, is_bd_tensor, sidecar_path
from clover_common.config import CloverConfig
from clover_dev import VENV_PYTHON
from clover_dev.convert import clover_convert, make_qwen_twin, vendored_convert
from clover_dev.native import causal_and_block_logits
from tests.support.convert import copy_checkpoint, fields, llama_cpp_clover_file, rewrite_weights, run_convert
from tests.support.native import rewrite_gguf
from tests.support.tmp import MkTemp

PROMPT = list(range(40, 72))
MODES = ("ar", "diffusion", "spec", "auto")
# the size label counts parameters: ours computes it from the trunk's (moe_size_label), the vendored converter its own
DIFFERENT_VALUES = {"general.size_label"}


@pytest.fixture(scope="module")
def files(tiny_checkpoint: Path, module_tmp: MkTemp) -> dict[str, Path]:
    """Our single file, our trunk + sidecar (--bd-sidecar), a --bd-only sidecar, and llama.cpp's Clover file of the
    same trunk; all F32."""
    out = module_tmp("sidecar")
    single = clover_convert(tiny_checkpoint, out / "single.gguf", "f32")
    trunk = clover_convert(tiny_checkpoint, out / "trunk.gguf", "f32", "--bd-sidecar")
    done = subprocess.run([str(VENV_PYTHON), "-m", "clover_convert", str(tiny_checkpoint), "--bd-only",
                           str(out / "only.bd.gguf")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    twin = make_qwen_twin(tiny_checkpoint, out / "twin" / tiny_checkpoint.name)
    llama_cpp = llama_cpp_clover_file(vendored_convert(twin, out / "stock.gguf", "f32"), out / "llama-cpp.gguf")
    return {"single": single, "trunk": trunk, "sidecar": sidecar_path(trunk), "only": out / "only.bd.gguf",
            "llama_cpp": llama_cpp}


def test_sidecar_outputs(files: dict[str, Path]) -> None:
    """--bd-sidecar splits the single file: the trunk has everything but the block-diffusion tensors and keys, the
    sidecar exactly those (F32, same bytes) plus the fingerprint; --bd-only writes the same sidecar."""
    assert files["sidecar"].name == "trunk.bd.gguf" and files["sidecar"].is_file()
    assert files["only"].read_bytes() == files["sidecar"].read_bytes()
    single = {t.name: t for t in gguf.GGUFReader(files["single"]).tensors}
    trunk = {t.name: t for t in gguf.GGUFReader(files["trunk"]).tensors}
    side = {t.name: t for t in gguf.GGUFReader(files["sidecar"]).tensors}
    assert set(trunk) == {n for n in single if not is_bd_tensor(n)}
    assert set(side) == {n for n in single if is_bd_tensor(n)} and side
    for name, t in {**trunk, **side}.items():
        assert t.tensor_type == single[name].tensor_type
        assert np.asarray(t.data).tobytes() == np.asarray(single[name].data).tobytes(), name
    side_keys = fields(files["sidecar"], "clover_moe")
    assert side_keys["general.type"][1] == "bd_sidecar"
    assert side_keys["ARCH.bd.trunk_fingerprint"][1] == gguf_fingerprint(files["trunk"])
    single_keys, trunk_keys = fields(files["single"], "clover_moe"), fields(files["trunk"], "clover_moe")
    bd_keys = set(single_keys) - set(trunk_keys)
    assert bd_keys and bd_keys <= set(side_keys)
    for key in bd_keys | {"tokenizer.ggml.mask_token_id"}:
        assert side_keys[key] == single_keys[key], key


def test_our_trunk_is_the_llama_cpp_clover_file(files: dict[str, Path]) -> None:
    """spec 6: our --bd-sidecar trunk == llama.cpp's Clover converter's file, key for key and tensor for tensor
    (ssm_a within one ULP: torch's float32 exp against our correctly rounded one), and both give one fingerprint."""
    ours = {t.name: t for t in gguf.GGUFReader(files["trunk"]).tensors}
    theirs = {t.name: t for t in gguf.GGUFReader(files["llama_cpp"]).tensors}
    assert set(ours) == set(theirs)
    for name, t in theirs.items():
        a, b = np.asarray(ours[name].data), np.asarray(t.data)
        assert ours[name].tensor_type == t.tensor_type and a.shape == b.shape, name
        if name.endswith("ssm_a"):
            assert np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32)).max() <= 1, name
        else:
            assert a.tobytes() == b.tobytes(), name
    our_keys, their_keys = fields(files["trunk"], "clover_moe"), fields(files["llama_cpp"], "clover_moe")
    assert set(our_keys) == set(their_keys)
    for key, value in their_keys.items():
        if key not in DIFFERENT_VALUES:
            assert our_keys[key] == value, key
    assert gguf_fingerprint(files["llama_cpp"]) == gguf_fingerprint(files["trunk"])


def test_fingerprint_from_the_checkpoint(tiny_checkpoint: Path, files: dict[str, Path]) -> None:
    """The converter's fingerprint (config + token list) is the trunk GGUF's: the fields of spec 5, the token digest
    over the GGUF's token list."""
    tokens = gguf.GGUFReader(files["trunk"]).fields["tokenizer.ggml.tokens"].contents()
    text = config_fingerprint(CloverConfig.load(tiny_checkpoint), tokens)
    assert text == gguf_fingerprint(files["trunk"])
    assert text.startswith("L=4;gdn=0,1,2;nk=2;nv=4;dk=16;dv=16;kc=4;vocab=3072;tok="), text


def test_bd_only_never_reads_the_trunk(tiny_checkpoint: Path, files: dict[str, Path], tmp_path: Path,
                                       capsys) -> None:
    """--bd-only reads the block-diffusion tensors by name only: with every trunk tensor of the checkpoint holding
    NaN (which a whole conversion refuses), it writes the same sidecar."""
    model = copy_checkpoint(tiny_checkpoint, tmp_path / tiny_checkpoint.name)  # the same general.name

    def poison(tensors: dict[str, torch.Tensor]) -> None:
        for name in tensors:
            if not any(name.endswith(s) for s in ("conv_right_weight", "bd_softmax_logit_scale",
                                                   "bd_softmax_history_bias", "bd_softmax_history_c")):
                tensors[name] = torch.full_like(tensors[name], float("nan"))

    rewrite_weights(model, poison)
    code, _, stderr = run_convert(capsys, model, tmp_path / "whole.gguf", "--outtype", "f32")
    assert code == 2 and "NaN" in stderr, stderr
    code, _, stderr = run_convert(capsys, model, "--bd-only", tmp_path / "x.bd.gguf")
    assert code == 0, stderr
    assert (tmp_path / "x.bd.gguf").read_bytes() == files["only"].read_bytes()


def _run(path: Path, mode: str, bd: Path | None = None) -> list[int]:
    from clover_cpp.model import Model

    with Model(path, n_ctx=512, bd_path=bd) as model:
        return model.run(PROMPT, mode=mode, max_tokens=24, stop_ids=[]).tokens


@pytest.mark.parametrize("trunk", ["trunk", "llama_cpp"])
@pytest.mark.native
def test_trunk_and_sidecar_equal_the_single_file(files: dict[str, Path], trunk: str) -> None:
    """spec 6: a trunk plus its sidecar == the single file, bit for bit: causal and block logits, and the tokens of
    every mode. llama.cpp's Clover file takes the --bd-only sidecar."""
    tokens = list(range(30, 94))
    docs = [(tokens, [(16, [1, 3, 5, 7]), (40, list(range(8)))])]
    want = causal_and_block_logits(files["single"], docs, 8)
    got = causal_and_block_logits(files[trunk], docs, 8, bd_path=files["only"])
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)
    for mode in MODES:
        assert _run(files[trunk], mode, files["only"]) == _run(files["single"], mode), mode


@pytest.fixture(scope="module")
def other_sidecar(tiny_checkpoint: Path, module_tmp: MkTemp) -> Path:
    """The sidecar of a trunk with 8 layers (another L and other GDN layers, the same vocabulary)."""
    from clover_ref.factory import init_checkpoint

    out = module_tmp("other")
    init_checkpoint(out / "ckpt", "tiny", seed=1, layers=8)
    done = subprocess.run([str(VENV_PYTHON), "-m", "clover_convert", str(out / "ckpt"), "--bd-only",
                           str(out / "other.bd.gguf")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return out / "other.bd.gguf"


def _generate(model: Path, bd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(VENV_PYTHON.parent / "clover-cpp"), "generate", "-m", str(model), "--bd", str(bd),
                           "-p", "def f(x):", "-n", "4"], capture_output=True, text=True, timeout=300)


@pytest.mark.native
def test_bad_sidecars_are_refused(files: dict[str, Path], other_sidecar: Path, tmp_path: Path) -> None:
    """Each bad sidecar is one line naming the file and the problem, exit 2, never a crash: another trunk's (the
    differing fingerprint fields named), a truncated one, a file that is no sidecar, a sidecar for a file that
    already has the tensors, and a sidecar with a tensor of the wrong length."""
    truncated = tmp_path / "truncated.bd.gguf"
    truncated.write_bytes(files["only"].read_bytes()[:3000])
    short = tmp_path / "short.bd.gguf"
    rewrite_gguf(files["only"], short, tensor_edit=lambda name, v: v[:2] if name == "blk.1.bd_history_c" else v)
    cases = [
        (files["trunk"], other_sidecar, ["is the sidecar of another trunk", "fields L, gdn differ"]),
        (files["trunk"], truncated, ["truncated.bd.gguf", "the file has 3000 bytes"]),
        (files["trunk"], files["single"], ["single.gguf", "bd.trunk_fingerprint is missing", "--bd-only"]),
        (files["single"], files["only"], ["already holds the block-diffusion tensors"]),
        (files["trunk"], short, ["short.bd.gguf", "blk.1.bd_history_c", "shape"]),
    ]
    for model, bd, fragments in cases:
        done = _generate(model, bd)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("clover-cpp: error: "), done.stderr
        for fragment in fragments:
            assert fragment in lines[0], (fragment, lines[0])
