"""`clover-convert --outtype Q4_K_M` (and the other clover-quantize types) in one pass: the file is byte for byte
the two-step route's (clover-convert to the source precision, then clover-quantize), with and without an
importance matrix, whatever the chunking and the threads; and bad input ends with one line and exit code 2.

Everything runs the patched llama.cpp and ggml (no mocks): the two-step reference is clover-quantize itself.
"""

from __future__ import annotations

import filecmp
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter

from tests.support.convert import interrupt, wait_for_temp, write_imatrix
from clover_dev import REPO_ROOT, VENV_PYTHON
from tests.support.convert import copy_checkpoint, rewrite_weights, slowed_convert_script

from clover_convert import onepass, streaming
from clover_convert.converter import ConvertOptions, convert
from clover_quantize.run import QUANTIZED_BY, QuantizeOptions, quantize
from clover_quantize.file_types import file_type
from clover_ref.factory import init_checkpoint
from tests.support.tmp import MkTemp

pytestmark = pytest.mark.native  # every test here runs the native build (skipped without it; a failure in CI)

DEMO = REPO_ROOT / "models" / "clover-demo"
# the types, and the IQ4 types with an imatrix and (as llama-quantize allows) without one
CASES = [("Q8_0", False), ("Q8_0", True), ("Q6_K", False), ("Q6_K", True), ("Q4_K_M", False), ("Q4_K_M", True),
         ("IQ4_XS", True), ("IQ4_NL", False)]


def _two_step_base(model_dir: Path, folder: Path, precision: str) -> tuple[Path, Path]:
    """The two-step route's first file (the source precision) and an imatrix for its tensors."""
    base = folder / f"base-{precision}.gguf"
    convert(ConvertOptions(model_dir=model_dir, outfile=base, outtype=precision, progress=False))
    return base, write_imatrix(folder / "imatrix.gguf", base)


@pytest.fixture(scope="module")
def tiny_base(tiny_checkpoint: Path, module_tmp: MkTemp) -> tuple[Path, Path, Path]:
    return (tiny_checkpoint, *_two_step_base(tiny_checkpoint, module_tmp("op-tiny"), "bf16"))


@pytest.fixture(scope="module")
def demo_base(module_tmp: MkTemp) -> tuple[Path, Path, Path]:
    return (DEMO, *_two_step_base(DEMO, module_tmp("op-demo"), "bf16"))


def _assert_identical(model_dir: Path, base: Path, imatrix: Path | None, name: str, folder: Path,
                      monkeypatch: pytest.MonkeyPatch, threads: int = 2) -> None:
    """One pass == two steps, every byte of the file: the tool key is set to clover-quantize's for the
    comparison (the CLI test below checks that it is the only difference)."""
    two = folder / f"two-step-{name}.gguf"
    one = folder / f"one-pass-{name}.gguf"
    quantize(QuantizeOptions(input=base, file_type=file_type(name), output=two, imatrix=imatrix, progress=False))
    monkeypatch.setattr(onepass, "QUANTIZED_BY", QUANTIZED_BY)
    convert(ConvertOptions(model_dir=model_dir, outfile=one, outtype=name, imatrix=imatrix, threads=threads,
                           progress=False))
    assert one.stat().st_size == two.stat().st_size
    assert filecmp.cmp(one, two, shallow=False), f"{name}: the one-pass file differs from the two-step one"


@pytest.mark.parametrize(("name", "with_imatrix"), CASES)
def test_tiny_identical(name: str, with_imatrix: bool, tiny_base: tuple[Path, Path, Path], tmp_path: Path,
                        monkeypatch: pytest.MonkeyPatch) -> None:
    model, base, imatrix = tiny_base
    _assert_identical(model, base, imatrix if with_imatrix else None, name, tmp_path, monkeypatch)


@pytest.mark.parametrize(("name", "with_imatrix"), CASES)
def test_demo_identical(name: str, with_imatrix: bool, demo_base: tuple[Path, Path, Path], tmp_path: Path,
                        monkeypatch: pytest.MonkeyPatch) -> None:
    model, base, imatrix = demo_base
    _assert_identical(model, base, imatrix if with_imatrix else None, name, tmp_path, monkeypatch)


def test_f32_source_small_chunks_many_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An f32 checkpoint (the two-step route converts it to f32), chunks of an odd 1000 values, so that chunks
    end mid-row-group and mid-expert, and 3 threads whose pieces never cross an expert (each has its own
    importance vector): still the two-step bytes."""
    model = tmp_path / "tiny32"
    init_checkpoint(model, "tiny", seed=1, dtype="float32")
    base, imatrix = _two_step_base(model, tmp_path, "f32")
    monkeypatch.setattr(streaming, "CHUNK_ELEMENTS", 1000)
    for name in ("Q4_K_M", "IQ4_XS"):
        _assert_identical(model, base, imatrix, name, tmp_path, monkeypatch, threads=3)


def _cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(VENV_PYTHON), "-m", "clover_convert", *map(str, args)], capture_output=True,
                          text=True, cwd=REPO_ROOT)


def _kv(path: Path) -> dict[str, object]:
    reader = GGUFReader(path)
    return {k: [bytes(f.parts[i]) for i in f.data] for k, f in reader.fields.items()}


def test_cli_records_the_tool(tiny_base: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """The command line: the output path on stdout, a summary with the time split on stderr, and apart from
    general.quantized_by the keys and tensors of the two-step file."""
    model, base, imatrix = tiny_base
    two = tmp_path / "two.gguf"
    quantize(QuantizeOptions(input=base, file_type=file_type("Q4_K_M"), output=two, imatrix=imatrix, progress=False))
    one = tmp_path / "one.gguf"
    done = _cli(model, one, "--outtype", "q4_k_m", "--imatrix", imatrix, "--threads", "2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(one)
    assert "Q4_K_M:" in done.stderr and "quantize" in done.stderr
    a, b = _kv(one), _kv(two)
    assert a.pop("general.quantized_by") == [b"clover-convert"]
    assert b.pop("general.quantized_by") == [b"clover-quantize"]
    assert a == b
    ta, tb = GGUFReader(one).tensors, GGUFReader(two).tensors
    assert [t.name for t in ta] == [t.name for t in tb]
    for x, y in zip(ta, tb):
        assert x.tensor_type == y.tensor_type and np.array_equal(x.data, y.data), x.name
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


def _assert_clean_failure(done: subprocess.CompletedProcess[str], needles: list[str], folder: Path,
                          keep: set[str]) -> None:
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("clover-convert: error: "), done.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert {p.name for p in folder.iterdir()} == keep, "partial output left behind"


def _partial_imatrix(src: Path, dst: Path, drop: str) -> Path:
    w = GGUFWriter(str(dst), arch="")
    w.add_type("imatrix")
    for t in GGUFReader(src).tensors:
        if not t.name.startswith(drop):
            w.add_tensor(t.name, np.array(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_partial_imatrix_as_llama_quantize(tiny_base: tuple[Path, Path, Path], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """An imatrix with no entry for one tensor: llama-quantize quantizes that tensor to IQ4_XS without one
    (ggml does not need it there), and the one-pass route writes the same bytes."""
    model, base, imatrix = tiny_base
    partial = _partial_imatrix(imatrix, tmp_path / "partial.gguf", "blk.1.ffn_up_exps.weight")
    _assert_identical(model, base, partial, "IQ4_XS", tmp_path, monkeypatch)


def test_bad_input(tiny_base: tuple[Path, Path, Path], demo_base: tuple[Path, Path, Path], tmp_path: Path) -> None:
    model, _, imatrix = tiny_base
    partial = _partial_imatrix(imatrix, tmp_path / "partial.gguf", "blk.1.ffn_up_exps.weight")
    keep = {"partial.gguf"}
    out = tmp_path / "out.gguf"
    _assert_clean_failure(_cli(model, out, "--outtype", "Q4_X"), ["--outtype", "unknown type 'Q4_X'", "Q4_K_M"],
                          tmp_path, keep)
    _assert_clean_failure(_cli(DEMO, out, "--outtype", "Q4_K_M", "--imatrix", imatrix),
                          [str(imatrix), "another model"], tmp_path, keep)
    _assert_clean_failure(_cli(model, out, "--outtype", "Q4_K_M", "--imatrix", model / "config.json"),
                          [str(model / "config.json"), "not a GGUF imatrix"], tmp_path, keep)
    _assert_clean_failure(_cli(model, out, "--outtype", "bf16", "--imatrix", imatrix), ["--imatrix", "bf16"],
                          tmp_path, keep)
    _assert_clean_failure(_cli(model, out, "--outtype", "Q4_K_M", "--split-max-tensors", "5"),
                          ["--outtype Q4_K_M writes one file"], tmp_path, keep)
    size = imatrix.stat().st_size
    _assert_clean_failure(_cli(model, imatrix, "--outtype", "Q4_K_M", "--imatrix", imatrix),
                          ["refusing to overwrite"], tmp_path, keep)
    assert imatrix.stat().st_size == size
    # K-quants do not need an entry for every tensor (as in clover-quantize): the partial imatrix is accepted
    done = _cli(model, out, "--outtype", "Q4_K_M", "--imatrix", partial)
    assert done.returncode == 0, done.stderr


def test_nonfinite_weights(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """NaN/inf weights as in a conversion: refused naming the tensor, converted with --allow-nonfinite."""
    model = copy_checkpoint(tiny_checkpoint, tmp_path / "model")
    name = "model.layers.1.post_attention_layernorm.weight"

    def poison(tensors: dict) -> None:
        t = tensors[name].clone()
        t[:3] = float("nan")
        tensors[name] = t
    rewrite_weights(model, poison)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    _assert_clean_failure(_cli(model, out_dir / "out.gguf", "--outtype", "Q4_K_M"),
                          [name, "3 non-finite values", "--allow-nonfinite"], out_dir, set())
    done = _cli(model, out_dir / "out.gguf", "--outtype", "Q4_K_M", "--allow-nonfinite")
    assert done.returncode == 0 and "3 non-finite values" in done.stderr, done.stderr
    assert (out_dir / "out.gguf").is_file()


SLOW_ONEPASS = slowed_convert_script("onepass", "encode_chunk")


def test_signal_leaves_nothing(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """SIGTERM while tensors are quantized: one line, status 143, and nothing left (not even the skeleton)."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    proc = subprocess.Popen([str(VENV_PYTHON), "-c", SLOW_ONEPASS, str(tiny_checkpoint), str(out_dir / "out.gguf"),
                             "--outtype", "Q4_K_M", "--threads", "2"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_for_temp(out_dir, proc, ".partial")
    interrupt(proc, signal.SIGTERM, 143, "clover-convert", out_dir)


@pytest.mark.slow
def test_mid_identical(mid_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real per-layer dims (hidden 2048: K-quants without fallback, the embedding in many chunks).
    Q4_K_M with an imatrix only: each type costs minutes here (IQ4_XS and Q6_K were checked the same way)."""
    base, imatrix = _two_step_base(mid_checkpoint, tmp_path, "bf16")
    _assert_identical(mid_checkpoint, base, imatrix, "Q4_K_M", tmp_path, monkeypatch)
