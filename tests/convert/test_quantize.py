"""clover-quantize (docs/quantize.md): plans equal what is written, the Clover type rules, the quantized files run in
all three modes, quality against f16 (KL divergence and top-1 of causal and block logits), and the errors.

Everything runs the patched llama.cpp (llama_model_quantize through llama-cpp-python): no mocks.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFWriter

from clover_dev import REPO_ROOT, VENV_PYTHON
from clover_dev.convert import clover_convert
from clover_dev.convert import quantize as llama_quantize
from clover_dev.metrics import kl_top1
from clover_dev.native import causal_and_block_logits
from tests.support.convert import ALWAYS_F32, write_imatrix
from tests.support.native import dump_results, record

from clover_quantize.run import QuantizeOptions, default_output, plan_quantization, quantize
from clover_quantize.gguf_input import read_input
from clover_quantize.file_types import FILE_TYPES, file_type
from tests.support.tmp import MkTemp

pytestmark = pytest.mark.native  # every test here runs the native build (skipped without it; a failure in CI)

QUANT_TYPES = ["Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_0", "Q4_K_M", "Q4_K_S", "Q4_0", "Q3_K_M", "IQ4_NL",
               "IQ4_XS", "F16", "BF16"]

AT_LEAST_Q8 = re.compile(r"ssm_(alpha|beta)\.weight")
AT_LEAST_Q8_TYPES = {T.Q8_0, T.F16, T.BF16, T.F32}


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(VENV_PYTHON), "-m", "clover_quantize.cli", *args], capture_output=True, text=True,
                          cwd=REPO_ROOT)


def _types(path: Path) -> dict[str, T]:
    return {t.name: T(t.tensor_type) for t in GGUFReader(path).tensors}




@pytest.fixture(scope="module")
def tiny_f16(tiny_checkpoint: Path, module_tmp: MkTemp) -> Path:
    return clover_convert(tiny_checkpoint, module_tmp("q-tiny") / "tiny-f16.gguf", "f16")


@pytest.fixture(scope="module")
def tiny_imatrix(tiny_f16: Path) -> Path:
    return write_imatrix(tiny_f16.with_name("tiny-imatrix.gguf"), tiny_f16)


@pytest.fixture(scope="module")
def tiny_quantized(tiny_f16: Path, tiny_imatrix: Path) -> dict[str, tuple[Path, Any]]:
    """Every type of the table, quantized from the tiny f16 file: name -> (path, plan). IQ4_XS with an
    imatrix, IQ4_NL without one (allowed, as in llama-quantize)."""
    out: dict[str, tuple[Path, Any]] = {}
    for name in QUANT_TYPES:
        ft = file_type(name)
        opts = QuantizeOptions(input=tiny_f16, file_type=ft, output=tiny_f16.with_name(f"tiny-{name}.gguf"),
                               imatrix=tiny_imatrix if name == "IQ4_XS" else None, progress=False)
        res = quantize(opts)
        assert res.paths == [opts.output]
        out[name] = (opts.output, res.plan)
    return out


# ------------------------------------------------------------------------------------------ unit


def test_type_table_covers_the_issue() -> None:
    names = {t.name for t in FILE_TYPES}
    assert {"Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_K_S", "Q4_0", "IQ4_NL", "IQ4_XS"} <= names
    assert {t.name for t in FILE_TYPES if t.wants_imatrix} == {"IQ4_NL", "IQ4_XS"}
    assert file_type("q4_k_m").name == "Q4_K_M"


def test_default_output_name() -> None:
    assert default_output(Path("/m/model-f16.gguf"), file_type("Q4_K_M")) == Path("/m/model-Q4_K_M.gguf")
    assert default_output(Path("m/x.gguf"), file_type("Q8_0")) == Path("m/x-Q8_0.gguf")
    assert default_output(Path("m/x-bf16-00001-of-00002.gguf"), file_type("Q6_K")) == Path("m/x-Q6_K.gguf")


# ------------------------------------------------------------------------------------------ types and rules


@pytest.mark.parametrize("name", QUANT_TYPES)
def test_written_types_match_the_plan(name: str, tiny_quantized: dict[str, tuple[Path, Any]]) -> None:
    path, plan = tiny_quantized[name]
    written = _types(path)
    planned = {t.name: t.dst_type for t in plan.tensors}
    assert written == planned
    assert path.stat().st_size >= plan.dst_bytes
    for tensor, qtype in written.items():
        if ALWAYS_F32.search(tensor):
            assert qtype == T.F32, f"{name}: {tensor} is {qtype.name}, must stay F32"
        if AT_LEAST_Q8.search(tensor):
            assert qtype in AT_LEAST_Q8_TYPES, f"{name}: {tensor} is {qtype.name}, must be Q8_0 or better"
    reader = GGUFReader(path)
    ft = reader.get_field("general.file_type")
    assert ft is not None and int(ft.parts[ft.data[0]][0]) == file_type(name).ftype


def test_mid_plan_uses_k_quants_and_the_rules(mid_f16: Path) -> None:
    """On the real per-layer dims (hidden 2048) the K-quants apply without fallback; the rules hold."""
    model = read_input(mid_f16)
    plan = plan_quantization(QuantizeOptions(input=mid_f16, file_type=file_type("Q4_K_M")), model)
    types = {t.name: t.dst_type for t in plan.tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == T.Q4_K
    assert types["blk.0.ssm_alpha.weight"] == T.Q8_0 and types["blk.0.ssm_beta.weight"] == T.Q8_0
    assert types["blk.0.bd_conv_right.weight"] == T.F32
    assert T.Q6_K in set(types.values())  # the mix raises half of ffn_down / attn_v
    assert plan.dst_bytes < 0.4 * plan.src_bytes


def test_tensor_type_overrides(tiny_f16: Path, tmp_path: Path) -> None:
    out = tmp_path / "o.gguf"
    done = _cli(str(tiny_f16), str(out), "Q4_0", "--tensor-type", r"ffn_up_exps=q8_0",
                "--output-tensor-type", "f16", "--token-embedding-type", "q8_0")
    assert done.returncode == 0, done.stderr
    types = _types(out)
    assert types["blk.0.ffn_up_exps.weight"] == T.Q8_0
    assert types["blk.0.ffn_gate_exps.weight"] == T.Q4_0
    assert types["output.weight"] == T.F16
    assert types["token_embd.weight"] == T.Q8_0
    # the rule wins over a manual override that would take ssm_alpha below Q8_0
    done = _cli(str(tiny_f16), str(tmp_path / "o2.gguf"), "Q8_0", "--tensor-type", "ssm_alpha=q4_0")
    assert done.returncode == 0, done.stderr
    assert _types(tmp_path / "o2.gguf")["blk.0.ssm_alpha.weight"] == T.Q8_0


def test_dry_run_prints_the_plan_and_writes_nothing(tiny_f16: Path, tmp_path: Path) -> None:
    out = tmp_path / "never.gguf"
    done = _cli(str(tiny_f16), str(out), "Q4_K_M", "--dry-run")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    n = len(GGUFReader(tiny_f16).tensors)
    assert sum(1 for ln in lines if re.match(r"^(blk|token_embd|output)", ln)) == n
    m = re.search(r"^(\d+) tensors: ([\d,]+) -> ([\d,]+) bytes", done.stdout, re.M)
    assert m and int(m.group(1)) == n
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_keep_split(tiny_checkpoint: Path, tmp_path: Path) -> None:
    done = subprocess.run([str(VENV_PYTHON), "-m", "clover_convert", str(tiny_checkpoint), str(tmp_path / "s.gguf"),
                           "--outtype", "f16", "--split-max-tensors", "60"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    first = tmp_path / "s-00001-of-00002.gguf"
    assert first.exists()
    done = _cli(str(first), str(tmp_path / "q.gguf"), "Q8_0", "--keep-split")
    assert done.returncode == 0, done.stderr
    shards = sorted(tmp_path.glob("q-*-of-*.gguf"))
    assert [p.name for p in shards] == ["q-00001-of-00002.gguf", "q-00002-of-00002.gguf"]
    merged = tmp_path / "m.gguf"
    assert _cli(str(first), str(merged), "Q8_0").returncode == 0
    split_types = {**_types(shards[0]), **_types(shards[1])}
    assert split_types == _types(merged)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


# ------------------------------------------------------------------------------------------ use


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K_M", "Q4_0", "IQ4_XS"])
def test_quantized_files_generate_in_all_modes(name: str, tiny_quantized: dict[str, tuple[Path, Any]]) -> None:
    from clover_cpp import Model

    path, _ = tiny_quantized[name]
    with Model(path, n_ctx=256) as model:
        prompt = model.tokenize("def add(a, b):\n    return")
        for mode in ("ar", "diffusion", "spec"):
            model.reset()
            res = model.run(prompt, mode=mode, max_tokens=16, stop_ids=[])
            assert len(res.tokens) == 16 and res.stats.generated_tokens == 16
            assert all(0 <= t < 3072 and t != model.info.mask_token_id for t in res.tokens)
            assert res.stats.passes >= (16 if mode == "ar" else 2)
        # (spec == ar token for token is not asserted here: a batched verification pass and a 1-token
        # pass round differently on quantized dot products, and random weights have near-ties)


# ------------------------------------------------------------------------------------------ quality


@pytest.fixture(scope="module")
def mid_f16(mid_checkpoint: Path, module_tmp: MkTemp) -> Path:
    return clover_convert(mid_checkpoint, module_tmp("q-mid") / "mid-f16.gguf", "f16")


WINDOW = 16


def _quality(f16: Path, tag: str, types: list[str], imatrix: Path | None) -> dict[str, dict[str, float]]:
    from clover_native import bindings

    model = bindings.LlamaModel(f16)
    text = (REPO_ROOT / "clover_ref" / "decode.py").read_text()[:4000]
    tokens = model.tokenize(text)[:128]
    model.close()
    rng = np.random.default_rng(0)
    windows = []
    for p in (16, 48, 80, 112):
        k = int(rng.integers(4, WINDOW + 1))
        windows.append((p, sorted(rng.choice(WINDOW, size=k, replace=False).tolist())))
    ref_c, ref_b = causal_and_block_logits(f16, [(tokens, windows)], WINDOW)
    results: dict[str, dict[str, float]] = {}
    for name in types:
        ft = file_type(name)
        out = f16.with_name(f"{tag}-{name}.gguf")
        quantize(QuantizeOptions(input=f16, file_type=ft, output=out, progress=False,
                                 imatrix=imatrix if ft.wants_imatrix else None))
        c, b = causal_and_block_logits(out, [(tokens, windows)], WINDOW)
        kc, tc = kl_top1(ref_c, c)
        kb, tb = kl_top1(ref_b, b)
        results[name] = {"kl_causal": kc, "top1_causal": tc, "kl_block": kb, "top1_block": tb,
                         "rows_causal": len(ref_c), "rows_block": len(ref_b)}
        out.unlink()
        record(f"quantize_quality_{tag}", results)
        dump_results()
    return results


QUALITY_TYPES = ["Q8_0", "Q6_K", "Q4_K_M", "Q4_0", "IQ4_XS"]  # all types: bench/bench_quantize.py


def test_quality_mid(mid_f16: Path) -> None:
    """KL(f16 || quantized) and top-1 agreement of causal and block logits on the real per-layer dims
    (hidden 2048, where the K-quants apply without fallback).

    What must hold is the order of the formats on both passes: more bits, less KL (Q8_0 < Q6_K < Q4_K_M <
    Q4_0). The bounds leave a factor of about 3 over the values measured on this fixture (recorded in
    build/native-parity.json; causal KL: Q8_0 5.6e-4, Q6_K 2.8e-3, Q4_K_M 2.7e-2, IQ4_XS 2.7e-2, Q4_0
    4.0e-2). Random weights give nearly flat logits (max |logit| about 4.6 over 3072 tokens), so causal
    top-1 is limited by near-ties (Q8_0 0.92, the 4-bit types about 0.6) and its bounds are loose. The block
    rows are flatter still under spec v2 (their history slot does not depend on q): the 4-bit types' block
    top-1 is near-tie-limited (Q4_K_M 0.32 on 19 rows), so only Q8_0's is bounded. The trained model below is
    where top-1 means something.
    """
    imatrix = write_imatrix(mid_f16.with_name("mid-imatrix.gguf"), mid_f16)
    r = _quality(mid_f16, "mid", QUALITY_TYPES, imatrix)
    for kind in ("causal", "block"):
        kl = {n: r[n][f"kl_{kind}"] for n in r}
        assert kl["Q8_0"] < kl["Q6_K"] < kl["Q4_K_M"] < kl["Q4_0"], (kind, kl)
        assert kl["IQ4_XS"] < kl["Q4_0"], (kind, kl)
        assert kl["Q8_0"] < 2e-3 and kl["Q6_K"] < 1e-2, (kind, kl)
        assert max(kl["Q4_K_M"], kl["IQ4_XS"], kl["Q4_0"]) < 0.12, (kind, kl)
        assert r["Q8_0"][f"top1_{kind}"] >= 0.8, (kind, r["Q8_0"])
        if kind == "causal":
            for n in ("Q4_K_M", "Q4_0", "IQ4_XS"):
                assert r[n]["top1_causal"] >= 0.45, (kind, n, r[n])


def test_quality_trained_demo(tmp_path: Path) -> None:
    """The same on the shipped trained model (models/clover-demo), whose peaked distributions make top-1
    meaningful. Its hidden size of 128 is below the K-quants' 256-wide blocks, so llama.cpp falls back to
    Q5_0/Q5_1/Q8_0 (and IQ4_NL for IQ4_XS) for most tensors. Measured on the chat-trained model: causal / block
    KL Q8_0 2.1e-3 / 1.6e-3, Q4_K_M 2.0e-2 / 2.7e-2, Q4_0 0.10 / 0.12, IQ4_NL 4.8e-2 / 6.0e-2; top-1 (causal /
    block) 0.95 / 0.95, 0.88 / 0.91, 0.67 / 0.72, 0.85 / 0.65. Bounds are above the KL and a few points below the
    top-1; the block top-1 counts 57 positions, so one position is 1.75 points."""
    f16 = clover_convert(REPO_ROOT / "models" / "clover-demo", tmp_path / "demo-f16.gguf", "f16")
    imatrix = write_imatrix(tmp_path / "demo-imatrix.gguf", f16)
    r = _quality(f16, "demo", ["Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_K_S", "Q4_0", "IQ4_NL", "IQ4_XS"], imatrix)
    for kind in ("causal", "block"):
        kl = {n: r[n][f"kl_{kind}"] for n in r}
        for n in r:  # every type of the issue: a bound at Q4_0's level
            assert kl[n] < 1.5e-1 and r[n][f"top1_{kind}"] >= 0.6, (kind, n, r[n])
        assert kl["Q8_0"] < kl["Q4_K_M"] < kl["Q4_0"], (kind, kl)
        assert kl["Q8_0"] < 3e-3 and kl["Q4_K_M"] < 3e-2 and kl["Q4_0"] < 1.5e-1, (kind, kl)
        assert r["Q8_0"][f"top1_{kind}"] >= 0.9, (kind, r["Q8_0"])
        assert r["Q4_K_M"][f"top1_{kind}"] >= 0.85, (kind, r["Q4_K_M"])
        assert r["Q4_0"][f"top1_{kind}"] >= 0.62, (kind, r["Q4_0"])


# ------------------------------------------------------------------------------------------ errors


def _assert_clean_failure(done: subprocess.CompletedProcess[str], needle: str, folder: Path) -> None:
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("clover-quantize: error: "), done.stderr
    assert needle in lines[0], lines[0]
    assert "Traceback" not in done.stderr
    assert not [p for p in folder.iterdir() if p.name.startswith(".") or p.name.startswith("out")]


def test_errors(tiny_f16: Path, tiny_quantized: dict[str, tuple[Path, Any]], tmp_path: Path) -> None:
    out = str(tmp_path / "out.gguf")
    _assert_clean_failure(_cli(str(tiny_f16), out, "Q4_X"), "unknown quantization type 'Q4_X'", tmp_path)
    _assert_clean_failure(_cli(str(tiny_f16)), "the TYPE is missing", tmp_path)
    q8 = tiny_quantized["Q8_0"][0]
    _assert_clean_failure(_cli(str(q8), out, "Q4_K_M"), "is already Q8_0", tmp_path)
    _assert_clean_failure(_cli(str(tmp_path / "missing.gguf"), out, "Q8_0"), "no such file", tmp_path)
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"hello world, not a gguf" * 10)
    _assert_clean_failure(_cli(str(not_gguf), out, "Q8_0"), "not a GGUF", tmp_path)
    llama = tmp_path / "llama.gguf"
    w = GGUFWriter(str(llama), arch="llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _assert_clean_failure(_cli(str(llama), out, "Q8_0"), "general.architecture is 'llama'", tmp_path)
    _assert_clean_failure(_cli(str(tiny_f16), out, "Q4_0", "--tensor-type", "([=q8_0"), "regular expression",
                          tmp_path)
    _assert_clean_failure(_cli(str(tiny_f16), out, "Q4_0", "--tensor-type", "ffn=q9_9"), "unknown tensor type",
                          tmp_path)
    bad_imatrix = tmp_path / "bad-imatrix.gguf"
    bad_imatrix.write_bytes(b"\0" * 64)
    _assert_clean_failure(_cli(str(tiny_f16), out, "IQ4_XS", "--imatrix", str(bad_imatrix)), "bad-imatrix.gguf",
                          tmp_path)
    # requantizing is allowed on request
    done = _cli(str(q8), out, "Q4_0", "--allow-requantize")
    assert done.returncode == 0, done.stderr
    assert _types(Path(out))["blk.0.ffn_up_exps.weight"] == T.Q4_0


@pytest.mark.parametrize("name", ["IQ4_XS", "IQ4_NL"])
def test_iq4_without_imatrix_as_llama_quantize(name: str, tiny_f16: Path, tmp_path: Path) -> None:
    """llama-quantize writes IQ4_XS and IQ4_NL without an importance matrix; so does clover-quantize, with a
    note that one would improve them, and the patched tree's llama-quantize writes the same tensors."""
    out = tmp_path / f"tiny-{name}.gguf"
    done = _cli(str(tiny_f16), str(out), name)
    assert done.returncode == 0, done.stderr
    assert "without --imatrix is allowed" in done.stderr and "clover-cpp imatrix" in done.stderr
    stock = llama_quantize(tiny_f16, tmp_path / f"stock-{name}.gguf", name)  # the llama-quantize tool
    ours, theirs = GGUFReader(out), GGUFReader(stock)
    assert [(t.name, t.tensor_type) for t in ours.tensors] == [(t.name, t.tensor_type) for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert bytes(a.data) == bytes(b.data), a.name


def test_skeleton_plans_like_the_real_file(tiny_checkpoint: Path, tiny_f16: Path, tmp_path: Path) -> None:
    """`clover-convert --dry-run --skeleton` (how bench/plan_35b.py plans the 35B) gives llama.cpp the same
    model as the real file: the plans are equal, and the skeleton's data region is a hole."""
    skeleton = tmp_path / "skeleton.gguf"
    done = subprocess.run([str(VENV_PYTHON), "-m", "clover_convert", str(tiny_checkpoint), str(skeleton),
                           "--outtype", "f16", "--dry-run", "--skeleton"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert skeleton.stat().st_size == tiny_f16.stat().st_size
    assert skeleton.stat().st_blocks * 512 < tiny_f16.stat().st_size // 2  # sparse
    for name in ("Q4_K_M", "Q8_0"):
        opts = QuantizeOptions(input=skeleton, file_type=file_type(name), dry_run=True)
        a = plan_quantization(opts, read_input(skeleton))
        b = plan_quantization(QuantizeOptions(input=tiny_f16, file_type=file_type(name), dry_run=True),
                              read_input(tiny_f16))
        assert a.tensors == b.tensors
    bad = subprocess.run([str(VENV_PYTHON), "-m", "clover_convert", str(tiny_checkpoint), str(tmp_path / "x.gguf"),
                          "--skeleton"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--skeleton goes with --dry-run" in bad.stderr
    assert not (tmp_path / "x.gguf").exists()
