"""`clover-cpp imatrix` (importance matrix, docs/native.md): libclover's collector and masked calibration.

On the tiny preset (f32 GGUF, 3 GDN + 1 attention layer, 8 experts top-2, B = 8): the file reads back with
gguf-py in llama.cpp's imatrix layout, the stock llama-quantize uses it, the sums equal an independent numpy
computation of the inputs of blk.0's projections (RMSNorm(token embedding) * attn_norm, over every causal
row and every masked-window row), AR-only calibration counts half the rows, the collector never changes a
logit, and bad input ends with one line and exit status 2. Without the native build the tests skip.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from clover_dev.convert import clover_convert
from tests.support.native import dump_results, record
from tests.support.tmp import MkTemp

CHUNK = 100  # not a multiple of B = 8: every chunk ends with a 4-token window
SEED = 3
GDN_WEIGHTS = ("attn_qkv", "attn_gate", "ssm_alpha", "ssm_beta", "ssm_out")
ATTN_WEIGHTS = ("attn_q", "attn_k", "attn_v", "attn_output")
FFN_WEIGHTS = ("ffn_gate_inp", "ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
EXPERT_WEIGHTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
CAUSAL_ONLY = ("ssm_alpha", "ssm_beta")  # the GDN gates are unused in block mode (spec section 3)


def _calibration_text(n_lines: int = 110) -> str:
    rng = np.random.default_rng(7)
    words = ("def class return import for while if else self value list dict print range len True None "
             "yield lambda try except with as pass").split()
    return "\n".join(" ".join(rng.choice(words, size=9)) for _ in range(n_lines)) + "\n"


def _run_cli(*argv: str) -> tuple[int, str]:
    import contextlib
    import io

    from clover_cpp.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["imatrix", *argv])
    return rc, err.getvalue()


def _read(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: np.array(t.data, dtype=np.float32).reshape([int(x) for x in reversed(t.shape.tolist())])
               for t in reader.tensors}
    return fields, tensors


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint: Path, module_tmp: MkTemp) -> SimpleNamespace:
    from clover_native import bindings
    d = module_tmp("imatrix")
    gguf = clover_convert(tiny_checkpoint, d / "tiny-f32.gguf", "f32")
    calib = d / "calib.txt"
    calib.write_text(_calibration_text())
    model = bindings.LlamaModel(gguf)
    tokens = model.tokenize(calib.read_text(), add_special=False, parse_special=False)
    mask = model.mask_token()
    model.close()

    runs: dict[str, tuple[Path, float]] = {}
    for name, extra in (("masked", []), ("ar", ["--no-masked"])):
        out = d / f"{name}.gguf"
        t0 = time.perf_counter()
        rc, err = _run_cli("-m", str(gguf), "-f", str(calib), "-o", str(out), "--chunk-size", str(CHUNK),
                           "--seed", str(SEED), "-t", "1", "--no-progress", *extra)
        assert rc == 0, err
        assert "wrote" in err and not err.count("\n") > 1, err
        runs[name] = (out, time.perf_counter() - t0)
    n_chunks = len(tokens) // CHUNK
    assert n_chunks >= 5 and len(tokens) % CHUNK, "the calibration text must fill several chunks and leave a tail"
    record("imatrix/tiny", {"tokens": len(tokens), "chunks": n_chunks, "seconds_masked": runs["masked"][1],
                            "seconds_ar": runs["ar"][1]})
    dump_results()
    return SimpleNamespace(dir=d, gguf=gguf, calib=calib, tokens=tokens, mask=mask, n_chunks=n_chunks,
                           n_used=n_chunks * CHUNK, masked=runs["masked"][0], ar=runs["ar"][0])


def _model_tensors(gguf: Path) -> dict[str, np.ndarray]:
    return _read(gguf)[1]


def _expected_entries(model: dict[str, np.ndarray]) -> set[str]:
    names = set()
    for il in range(4):
        kinds = ATTN_WEIGHTS if f"blk.{il}.attn_q.weight" in model else GDN_WEIGHTS
        names.update(f"blk.{il}.{k}.weight" for k in (*kinds, *FFN_WEIGHTS, *EXPERT_WEIGHTS))
    return names


@pytest.mark.native
def test_file_layout_and_counts(tiny: SimpleNamespace) -> None:
    fields, im = _read(tiny.masked)
    model = _model_tensors(tiny.gguf)
    assert fields["general.type"] == "imatrix"
    assert fields["imatrix.datasets"] == [str(tiny.calib)]
    assert fields["imatrix.chunk_count"] == tiny.n_chunks
    assert fields["imatrix.chunk_size"] == CHUNK

    expected = _expected_entries(model)
    assert len(expected) == 51
    assert set(im) == {f"{n}.in_sum2" for n in expected} | {f"{n}.counts" for n in expected}
    assert not any(n.startswith("output.") for n in im)
    n = tiny.n_used
    for name in sorted(expected):
        w = model[name]  # numpy order: [n_expert,] n_out, n_in
        n_mat = w.shape[0] if w.ndim == 3 else 1
        # in_sum2 [n_in, n_mat] and counts [1, n_mat] in ggml order (gguf drops trailing 1s of the shape)
        assert im[f"{name}.in_sum2"].size == n_mat * w.shape[-1], name
        assert im[f"{name}.counts"].size == n_mat, name
        sums = im[f"{name}.in_sum2"].reshape(n_mat, w.shape[-1])
        counts = im[f"{name}.counts"].reshape(n_mat, 1)
        assert np.all(np.isfinite(sums)) and np.all(sums >= 0), name
        if name.split(".")[2] in EXPERT_WEIGHTS:
            assert counts.sum() == n * 2 * 2, name  # causal + window rows, top-2 experts
            assert np.all(counts > 0), name
        elif name.split(".")[2] in CAUSAL_ONLY:
            assert counts[0, 0] == n, name
        else:
            assert counts[0, 0] == 2 * n, name
    assert not (tiny.dir / "masked.gguf.tmp").exists()


@pytest.mark.native
def test_llama_quantize_uses_it(tiny: SimpleNamespace) -> None:
    from clover_native import loader

    tool = loader.tool_path("llama-quantize")
    assert tool.exists(), f"{tool} missing (make native)"
    outs = {}
    for tag, extra in (("imx", ["--imatrix", str(tiny.masked)]), ("plain", [])):
        outs[tag] = tiny.dir / f"q4km-{tag}.gguf"
        done = subprocess.run([str(tool), *extra, str(tiny.gguf), str(outs[tag]), "Q4_K_M"],
                              capture_output=True, text=True)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        if tag == "imx":
            log = done.stdout + done.stderr
            assert "loaded 51 importance matrix entries" in log, log[-3000:]
            missing = {ln.split("did not find weights for ")[1].strip() for ln in log.splitlines()
                       if "did not find weights for" in ln}
            assert missing <= {"output.weight", "token_embd.weight"}, missing
    from gguf import GGUFReader

    a, b = ({t.name: (t.tensor_type, np.asarray(t.data).tobytes()) for t in GGUFReader(str(outs[tag])).tensors}
            for tag in ("imx", "plain"))
    assert {k: v[0] for k, v in a.items()} == {k: v[0] for k, v in b.items()}  # same types either way
    changed = [k for k in a if a[k][1] != b[k][1]]
    assert changed and all(k.startswith("blk.") for k in changed), changed
    record("imatrix/tiny_q4_k_m_tensors_changed_by_imatrix", len(changed))


def _blk0_input(model: dict[str, np.ndarray], ids: np.ndarray) -> np.ndarray:
    """RMSNorm(token embedding) * blk.0.attn_norm in float64: the input of blk.0's projections."""
    emb = model["token_embd.weight"].astype(np.float64)[ids]
    w = model["blk.0.attn_norm.weight"].astype(np.float64)
    return emb / np.sqrt((emb * emb).mean(-1, keepdims=True) + 1e-6) * w


def _window_rows(tiny: SimpleNamespace) -> np.ndarray:
    """Every masked-window input, replayed from the documented plan (same seed, same order)."""
    from clover_cpp.imatrix import masked_window

    rng = np.random.default_rng(SEED)
    rows: list[int] = []
    for c in range(tiny.n_chunks):
        chunk = tiny.tokens[c * CHUNK:(c + 1) * CHUNK]
        for s in range(0, CHUNK, 8):
            window, _ = masked_window(chunk[s:s + 8], tiny.mask, rng)
            rows += window
    return np.array(rows)


@pytest.mark.native
def test_exact_sums_blk0(tiny: SimpleNamespace) -> None:
    model = _model_tensors(tiny.gguf)
    causal = np.array(tiny.tokens[:tiny.n_used])
    windows = _window_rows(tiny)
    assert len(windows) == tiny.n_used and int((windows == tiny.mask).sum()) > tiny.n_used // 4
    x_causal = _blk0_input(model, causal)
    x_window = _blk0_input(model, windows)
    sq_causal = (x_causal ** 2).sum(0)
    sq_all = sq_causal + (x_window ** 2).sum(0)

    _, masked = _read(tiny.masked)
    _, ar = _read(tiny.ar)
    worst = 0.0
    for name, im, want in (("blk.0.attn_qkv.weight", masked, sq_all), ("blk.0.attn_gate.weight", masked, sq_all),
                           ("blk.0.ssm_alpha.weight", masked, sq_causal), ("blk.0.ssm_beta.weight", masked, sq_causal),
                           ("blk.0.attn_qkv.weight", ar, sq_causal), ("blk.0.ssm_beta.weight", ar, sq_causal)):
        got = im[f"{name}.in_sum2"].reshape(-1).astype(np.float64)
        rel = float(np.max(np.abs(got - want) / want))
        worst = max(worst, rel)
        assert rel < 1e-5, f"{name}: max relative difference {rel:.3g}"
    record("imatrix/tiny_blk0_rel_diff", worst)
    dump_results()


@pytest.mark.native
def test_ar_only_counts_half(tiny: SimpleNamespace) -> None:
    _, masked = _read(tiny.masked)
    _, ar = _read(tiny.ar)
    assert set(masked) == set(ar)
    n = tiny.n_used
    for key in sorted(k for k in ar if k.endswith(".counts")):
        kind = key.split(".")[2]
        if kind in EXPERT_WEIGHTS:
            assert ar[key].sum() == n * 2 and masked[key].sum() == 2 * ar[key].sum(), key
        elif kind in CAUSAL_ONLY:
            assert ar[key].item() == masked[key].item() == n, key
        else:
            assert ar[key].item() == n and masked[key].item() == 2 * n, key


@pytest.mark.native
def test_seed_is_deterministic(tiny: SimpleNamespace) -> None:
    outs = []
    for tag, seed in (("a", SEED), ("b", SEED), ("c", SEED + 1)):
        out = tiny.dir / f"seed-{tag}.gguf"
        rc, err = _run_cli("-m", str(tiny.gguf), "-f", str(tiny.calib), "-o", str(out), "--chunk-size", str(CHUNK),
                           "--chunks", "2", "--seed", str(seed), "-t", "1", "--no-progress")
        assert rc == 0, err
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
    assert outs[0] != outs[2]
    fields, _ = _read(tiny.dir / "seed-a.gguf")
    assert fields["imatrix.chunk_count"] == 2


@pytest.mark.native
def test_collector_never_changes_logits(tiny: SimpleNamespace) -> None:
    from clover_native import bindings
    from clover_cpp.imatrix import Collector, masked_window

    model = bindings.LlamaModel(tiny.gguf)
    collector = Collector()
    window, rows = masked_window(tiny.tokens[40:48], tiny.mask, np.random.default_rng(0))
    results = []
    for cb in (None, collector.eval_callback):
        ctx = bindings.Context(model, n_ctx=256, n_batch=64, n_ubatch=64, n_threads=1, eval_callback=cb)
        causal = ctx.causal(tiny.tokens[:40])
        block = ctx.block(window, list(range(8)))
        results.append((causal, block))
        ctx.close()
    assert collector.n_calls > 0 and collector.n_entries == 51 and collector.error() is None
    assert np.array_equal(results[0][0], results[1][0])
    assert np.array_equal(results[0][1], results[1][1])
    collector.close()
    model.close()


def test_masked_window_plan() -> None:
    from clover_cpp.imatrix import masked_window

    rng = np.random.default_rng(0)
    seg = list(range(100, 108))
    seen = set()
    for _ in range(400):
        window, rows = masked_window(seg, 7, rng)
        assert window[0] == 100  # the pending token is always known
        assert rows == sorted(set(rows)) and 1 <= len(rows) <= 8 and all(0 <= r < 8 for r in rows)
        masked_inputs = [j for j in range(1, 8) if window[j] == 7]
        assert masked_inputs == [r + 1 for r in rows if r + 1 < 8]
        assert all(window[j] == seg[j] for j in range(8) if j not in masked_inputs)
        seen.add(len(rows))
    assert seen == set(range(1, 9))  # the masked fraction covers (0, 1]
    window, rows = masked_window([5], 7, rng)
    assert window == [5] and rows == [0]


@pytest.mark.parametrize("case", ["missing-model", "not-gguf", "not-clover", "missing-calib", "empty-calib",
                                  "short-calib", "chunk-size", "block-size", "chunks", "out-dir"])
@pytest.mark.native
def test_bad_input_one_line(tiny: SimpleNamespace, tmp_path: Path, case: str) -> None:
    calib, gguf = str(tiny.calib), str(tiny.gguf)
    out = tmp_path / "o.gguf"
    args = {"-m": gguf, "-f": calib, "-o": str(out)}
    extra: list[str] = []
    expect = ""
    if case == "missing-model":
        args["-m"], expect = str(tmp_path / "nope.gguf"), f"-m/--model {tmp_path / 'nope.gguf'}: no such file"
    elif case == "not-gguf":
        args["-m"], expect = calib, "is not a clover GGUF"
    elif case == "not-clover":
        args["-m"], expect = str(tiny.masked), "is not a clover GGUF"  # an imatrix GGUF is not a model
    elif case == "missing-calib":
        args["-f"], expect = str(tmp_path / "nope.txt"), f"-f/--file {tmp_path / 'nope.txt'}: no such file"
    elif case == "empty-calib":
        (tmp_path / "empty.txt").write_text(" \n\n")
        args["-f"], expect = str(tmp_path / "empty.txt"), "calibration file is empty"
    elif case == "short-calib":
        (tmp_path / "short.txt").write_text("def f(x): return x\n")
        args["-f"], expect = str(tmp_path / "short.txt"), "fewer than one chunk of 512"
    elif case == "chunk-size":
        extra, expect = ["--chunk-size", "0"], "--chunk-size must be at least 1"
    elif case == "block-size":
        extra, expect = ["--block-size", "-2"], "--block-size must be at least 1"
    elif case == "chunks":
        extra, expect = ["--chunks", "0"], "--chunks must be at least 1"
    elif case == "out-dir":
        args["-o"], expect = str(tmp_path / "no" / "such" / "dir.gguf"), "cannot write there"
    rc, err = _run_cli(*[x for kv in args.items() for x in kv], *extra, "--no-progress")
    assert rc == 2, err
    assert err.startswith("clover-cpp: error: ") and err.count("\n") == 1, err
    assert expect in err, err
    assert not out.exists() and not Path(str(out) + ".tmp").exists()


@pytest.mark.parametrize("extra, n_tokens", [(["--chunk-size", "3", "--chunks", "2"], 6),
                                             (["--block-size", "1", "--chunk-size", "20", "--chunks", "2"], 40),
                                             (["--chunk-size", "1", "--chunks", "3", "--no-masked"], 3)])
@pytest.mark.native
def test_small_sizes(tiny: SimpleNamespace, tmp_path: Path, extra: list[str], n_tokens: int) -> None:
    out = tmp_path / "small.gguf"
    rc, err = _run_cli("-m", str(tiny.gguf), "-f", str(tiny.calib), "-o", str(out), "-t", "1", "--no-progress", *extra)
    assert rc == 0, err
    _, im = _read(out)
    rows = n_tokens if "--no-masked" in extra else 2 * n_tokens
    assert im["blk.0.attn_qkv.weight.counts"].item() == rows
    assert im["blk.3.attn_q.weight.counts"].item() == rows
    assert im["blk.0.ssm_beta.weight.counts"].item() == n_tokens
