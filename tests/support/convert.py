"""Helpers shared by the clover-convert tests (this module holds no tests).

``expected_gguf`` is an independent statement of the documented HF -> GGUF transforms, written with torch
the way llama.cpp's converter writes them (reshape + permute for the value-head reorder, stack for the
experts), so the converter's span-based implementation is checked against a different one.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from clover_convert.cli import main
from clover_common.config import CloverConfig
from clover_common.layout import canonical_name

CLOVER_KEYS = {"ARCH.block_size", "ARCH.diffusion.threshold", "ARCH.diffusion.coreset_top_p",
               "ARCH.diffusion.history_rows", "ARCH.bd.history_readout_scale", "ARCH.diffusion.calibrated_block_sizes",
               "ARCH.diffusion.calibrated_thresholds", "diffusion.shift_logits",
               "general.sampling.penalty_response_only"}  # spec 4.5: a Clover file's penalties count the response


# ----------------------------------------------------------------------------------------------- running
def run_convert(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    """Run clover-convert in-process; returns (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def convert(capsys: pytest.CaptureFixture[str], model_dir: Path, out: Path, outtype: str, *extra: str) -> Path:
    code, _, err = run_convert(capsys, model_dir, "--outfile", out, "--outtype", outtype, *extra)
    assert code == 0, err
    return out


# ----------------------------------------------------------------------------------------------- HF side
def hf_state(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every text-model tensor as float32, keyed by canonical (``model.``) name."""
    index = model_dir / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    state = {}
    for file_name in files:
        with safe_open(str(model_dir / file_name), framework="pt") as f:
            for name in f.keys():
                canonical = canonical_name(name)
                if canonical is not None:
                    state[canonical] = f.get_tensor(name).to(torch.float32)
    return state


def _reorder_v_heads(t: torch.Tensor, dim: int, n_k: int, r: int, head_dim: int) -> torch.Tensor:
    """llama.cpp's ``_reorder_v_heads``: grouped -> tiled along ``dim``."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], n_k, r, head_dim, *shape[dim + 1:])
    perm = list(range(t.dim()))
    perm[dim], perm[dim + 1] = perm[dim + 1], perm[dim]
    return t.permute(*perm).contiguous().reshape(*shape)


def expected_gguf(state: dict[str, torch.Tensor], c: CloverConfig) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, float32 values in numpy order) for every tensor, under the documented transforms."""
    n_k, r = c.linear_num_key_heads, c.linear_num_value_heads // c.linear_num_key_heads
    hv, qk = c.linear_value_head_dim, 2 * c.key_dim

    def heads(t: torch.Tensor, head_dim: int, dim: int = 0) -> torch.Tensor:
        return _reorder_v_heads(t, dim, n_k, r, head_dim)

    yield "token_embd.weight", state["model.embed_tokens.weight"]
    for i in range(c.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        yield b + "attn_norm.weight", state[p + "input_layernorm.weight"] + 1
        yield b + "post_attention_norm.weight", state[p + "post_attention_layernorm.weight"] + 1
        if c.is_linear(i):
            a = p + "linear_attn."
            qkv = state[a + "in_proj_qkv.weight"]
            yield b + "attn_qkv.weight", torch.cat([qkv[:qk], heads(qkv[qk:], hv)])
            yield b + "attn_gate.weight", heads(state[a + "in_proj_z.weight"], hv)
            yield b + "ssm_alpha.weight", heads(state[a + "in_proj_a.weight"], 1)
            yield b + "ssm_beta.weight", heads(state[a + "in_proj_b.weight"], 1)
            for hf, name in (("conv1d.weight", "ssm_conv1d.weight"), ("conv_right_weight", "bd_conv_right.weight")):
                conv = state[a + hf].reshape(c.conv_dim, -1)
                yield b + name, torch.cat([conv[:qk], heads(conv[qk:], hv)])
            yield b + "ssm_a", -torch.exp(heads(state[a + "A_log"], 1))
            yield b + "ssm_dt.bias", heads(state[a + "dt_bias"], 1)
            yield b + "ssm_norm.weight", state[a + "norm.weight"]
            yield b + "ssm_out.weight", heads(state[a + "out_proj.weight"], hv, dim=1)
            for hf, name in (("bd_softmax_logit_scale", "bd_logit_scale"),
                             ("bd_softmax_history_bias", "bd_history_bias"), ("bd_softmax_history_c", "bd_history_c")):
                yield b + name, heads(state[a + hf], 1)
        else:
            for hf, name in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"),
                             ("o_proj", "attn_output")):
                yield f"{b}{name}.weight", state[f"{p}self_attn.{hf}.weight"]
            for hf, name in (("q_norm", "attn_q_norm"), ("k_norm", "attn_k_norm")):
                yield f"{b}{name}.weight", state[f"{p}self_attn.{hf}.weight"] + 1
        yield b + "ffn_gate_inp.weight", state[p + "mlp.gate.weight"]
        yield b + "ffn_gate_inp_shexp.weight", state[p + "mlp.shared_expert_gate.weight"]
        for part in ("gate", "up", "down"):
            yield f"{b}ffn_{part}_shexp.weight", state[f"{p}mlp.shared_expert.{part}_proj.weight"]
        if p + "mlp.experts.gate_up_proj" in state:
            gate, up = state[p + "mlp.experts.gate_up_proj"].chunk(2, dim=1)
            down = state[p + "mlp.experts.down_proj"]
        else:
            gate, up, down = (torch.stack([state[f"{p}mlp.experts.{e}.{part}_proj.weight"]
                                           for e in range(c.num_experts)])
                              for part in ("gate", "up", "down"))
        yield b + "ffn_gate_exps.weight", gate
        yield b + "ffn_up_exps.weight", up
        yield b + "ffn_down_exps.weight", down
    yield "output_norm.weight", state["model.norm.weight"] + 1
    if not c.tie_word_embeddings:
        yield "output.weight", state["lm_head.weight"]


F32_ALWAYS = ("_norm.weight", "ssm_a", "ssm_dt.bias", "ssm_conv1d.weight", "ffn_gate_inp.weight",
              "ffn_gate_inp_shexp.weight", "bd_conv_right.weight", "bd_logit_scale", "bd_history_bias",
              "bd_history_c")


def expected_type(name: str, shape: tuple[int, ...], outtype: str) -> gguf.GGMLQuantizationType:
    if name.endswith(F32_ALWAYS) or len(shape) == 1:
        return gguf.GGMLQuantizationType.F32
    return {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
            "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}[outtype]


def tensor_values(t: gguf.ReaderTensor) -> np.ndarray:
    """A GGUF tensor dequantized to float32, numpy order."""
    return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))


def assert_tensor_matches(name: str, got: np.ndarray, want: np.ndarray, ggml_type: gguf.GGMLQuantizationType) -> None:
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    if name.endswith("ssm_a"):  # -exp: ours is rounded from float64, torch's float32 exp is within one ULP
        np.testing.assert_array_max_ulp(got, want, maxulp=1)
    elif ggml_type == gguf.GGMLQuantizationType.Q8_0:
        blocks = want.reshape(-1, 32)
        step = np.abs(blocks).max(axis=1, keepdims=True) / 127  # one quantization step per block
        err = np.abs(got.reshape(-1, 32) - blocks)
        # round-to-nearest gives half a step; storing the scale as f16 adds up to 127 * 2^-11 of a step
        assert (err <= step * 0.57 + 1e-12).all(), f"{name}: Q8_0 error beyond its rounding bound"
        assert err.max() > 0, f"{name}: Q8_0 output is suspiciously exact"
    elif ggml_type == gguf.GGMLQuantizationType.F16:
        np.testing.assert_allclose(got, want, rtol=2**-11, atol=2**-24, err_msg=name)
    else:  # F32 and BF16 from a BF16 checkpoint are exact
        np.testing.assert_array_equal(got, want, err_msg=name)


# ----------------------------------------------------------------------------------------------- GGUF keys
def fields(path: Path, arch: str) -> dict[str, tuple[list[int], Any]]:
    """Key -> (value types, value), with the arch prefix replaced by ``ARCH`` and GGUF.* pseudo-keys dropped."""
    reader = gguf.GGUFReader(path)
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        out[key.replace(f"{arch}.", "ARCH.", 1) if key.startswith(f"{arch}.") else key] = \
            ([int(t) for t in field.types], field.contents())
    return out


# ----------------------------------------------------------------------------------------------- checkpoints
def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite_weights(model_dir: Path, edit: Any) -> None:
    """Apply ``edit(dict of stored tensors)`` to a single-file checkpoint and save it back."""
    path = model_dir / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def edit_config(model_dir: Path, **changes: Any) -> None:
    path = model_dir / "config.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data, indent=2))


def llama_cpp_clover_file(qwen35moe: Path, dst: Path, arch: str = "clover_moe") -> Path:
    """The file llama.cpp's own Clover converter would write (spec 5; docs/gguf-format.md says what this assumes):
    the vendored ``qwen35moe`` converter's output for the same trunk (an F32 file), with the architecture and its
    keys renamed to ``arch`` and ``expert_shared_count`` added, as upstream's ``CloverMoeModel`` does
    (``add_expert_shared_count(num_shared_experts)``). The arch string itself is a guess (spec 0): upstream's
    llama-arch.cpp could not be read."""
    from tests.support.native import rewrite_gguf

    return rewrite_gguf(qwen35moe, dst, arch=arch,
                        add_kv={f"{arch}.expert_shared_count": (1, gguf.GGUFValueType.UINT32)})


def n_elements(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def slowed_convert_script(module: str, function: str, delay_s: float = 0.2) -> str:
    """A ``python -c`` script that runs clover-convert's CLI with ``clover_convert.<module>.<function>`` slowed by
    ``delay_s`` a call: time to interrupt a conversion in the middle (the signal tests)."""
    return f"""
import sys, time
import clover_convert.{module} as m
inner = m.{function}
def slow(*args):
    time.sleep({delay_s})
    return inner(*args)
m.{function} = slow
from clover_convert.cli import main
sys.exit(main(sys.argv[1:]))
"""


# ------------------------------------------------------------------------------------------ tool runs
# Tensors that stay F32 in every file (docs/quantize.md): the four clover tensors, norms, ssm_a, dt, conv, router and
# the shared-expert gate.
ALWAYS_F32 = re.compile(r"(bd_conv_right|bd_logit_scale|bd_history_bias|bd_history_c|_norm\.weight|ssm_a$|ssm_dt\.|"
                        r"ssm_conv1d\.weight|ffn_gate_inp\.weight|ffn_gate_inp_shexp\.weight)")
def wait_for_temp(directory: Path, proc: subprocess.Popen[str], suffix: str) -> None:
    """Wait until a running tool has made its temporary output (a name ending in ``suffix``) in ``directory``."""
    deadline = time.monotonic() + 60
    while not any(p.name.endswith(suffix) for p in directory.iterdir()):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no temporary directory appeared"
        time.sleep(0.05)
    time.sleep(0.3)

def interrupt(proc: subprocess.Popen, sig: int, status: int, tool: str, out_dir: Path) -> None:
    """Signal a running tool: it stops within 10 s with ``status``, one line and no traceback, and leaves
    ``out_dir`` empty."""
    start = time.monotonic()
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=30)
    assert time.monotonic() - start < 10
    assert proc.returncode == status, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{tool}: ") and "Traceback" not in stderr, stderr
    assert list(out_dir.iterdir()) == []


def write_imatrix(path: Path, model_gguf: Path, seed: int = 0) -> Path:
    """An imatrix GGUF in llama.cpp's format for every quantizable weight of ``model_gguf``, with random
    positive importances (the loader and the quantizer's use of it are under test, not the collector)."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch="")
    w.add_type("imatrix")
    w.add_array("imatrix.datasets", ["synthetic"])
    w.add_uint32("imatrix.chunk_count", 1)
    w.add_uint32("imatrix.chunk_size", 64)
    for t in gguf.GGUFReader(model_gguf).tensors:
        shape = [int(d) for d in t.shape]
        if len(shape) < 2 or shape[1] == 1 or ALWAYS_F32.search(t.name) or t.name == "output.weight":
            continue
        n_expert = shape[2] if len(shape) == 3 else 1
        counts = np.full((n_expert, 1), 64.0, dtype=np.float32)
        sums = (rng.gamma(2.0, 1.0, size=(n_expert, shape[0])) * 64.0).astype(np.float32)
        w.add_tensor(f"{t.name}.in_sum2", sums)
        w.add_tensor(f"{t.name}.counts", counts)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
