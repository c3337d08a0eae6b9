"""Outputs are never destructive (hardening issue): clover-convert and clover-quantize refuse an output that
is not a regular file (a device, a fifo, a directory, through a symlink too) or that is one of their inputs,
with one line and exit 2, touching nothing; SIGTERM/SIGHUP/SIGINT end with one line and leave no hidden
temporary directory; one that a killed run left is swept by the next run of the same output."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clover_common import safe_output
from tests.support.convert import interrupt, wait_for_temp
from clover_dev import VENV_PYTHON
from clover_dev.convert import clover_convert
from tests.support.convert import copy_checkpoint, run_convert, slowed_convert_script
from tests.support.tmp import MkTemp


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _hidden(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


@pytest.fixture
def model(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    return copy_checkpoint(tiny_checkpoint, tmp_path / "model")


@pytest.fixture(scope="module")
def f32_gguf(tiny_checkpoint: Path, module_tmp: MkTemp) -> Path:
    return clover_convert(tiny_checkpoint, module_tmp("q") / "tiny-f32.gguf", "f32")


def _one_error_line(stderr: str, prog: str, *fragments: str) -> str:
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


# ---------------------------------------------------------------------------------------------- the check
def test_check_output_refuses_devices_and_inputs(tmp_path: Path) -> None:
    with pytest.raises(safe_output.UnsafeOutput, match="/dev/null: the output is a device"):
        safe_output.check_output(Path("/dev/null"))
    link = tmp_path / "null.gguf"
    link.symlink_to("/dev/null")
    with pytest.raises(safe_output.UnsafeOutput, match="a device .through the link to /dev/null"):
        safe_output.check_output(link)
    with pytest.raises(safe_output.UnsafeOutput, match="is a directory"):
        safe_output.check_output(tmp_path)
    src = tmp_path / "in.bin"
    src.write_bytes(b"x")
    hard = tmp_path / "hard.bin"
    os.link(src, hard)
    for out in (src, hard):
        with pytest.raises(safe_output.UnsafeOutput, match="is the input"):
            safe_output.check_output(out, [src])
    regular = tmp_path / "real.gguf"
    regular.write_bytes(b"old")
    to_regular = tmp_path / "link.gguf"
    to_regular.symlink_to(regular)
    assert safe_output.check_output(to_regular, [src]) == regular  # written through: the link stays
    assert safe_output.check_output(tmp_path / "new.gguf", [src]) == tmp_path / "new.gguf"


# ---------------------------------------------------------------------------------------------- convert
def _convert_refused(capsys: pytest.CaptureFixture[str], model: Path, out: Path, *fragments: str) -> None:
    before = sorted(str(p) for p in model.rglob("*")), sorted(str(p) for p in out.parent.iterdir())
    weights = _digest(model / "model.safetensors")
    code, stdout, stderr = run_convert(capsys, model, out, "--outtype", "f32")
    assert code == 2 and stdout == "", stderr
    _one_error_line(stderr, "clover-convert", str(out), *fragments)
    assert (sorted(str(p) for p in model.rglob("*")), sorted(str(p) for p in out.parent.iterdir())) == before
    assert _digest(model / "model.safetensors") == weights


def test_convert_refuses_a_device_through_a_symlink(model: Path, tmp_path: Path, capsys) -> None:
    link = tmp_path / "out.gguf"
    link.symlink_to("/dev/null")
    _convert_refused(capsys, model, link, "a device", "/dev/null")
    assert link.is_symlink() and Path("/dev/null").is_char_device()


def test_convert_refuses_dev_null(model: Path, tmp_path: Path, capsys) -> None:
    """`clover-convert ck /dev/null` replaced /dev/null with a regular file when run as root."""
    code, _, stderr = run_convert(capsys, model, "/dev/null", "--outtype", "f32")
    assert code == 2
    _one_error_line(stderr, "clover-convert", "/dev/null", "a device")
    assert Path("/dev/null").is_char_device()


def test_convert_refuses_a_fifo(model: Path, tmp_path: Path, capsys) -> None:
    fifo = tmp_path / "out.gguf"
    os.mkfifo(fifo)
    _convert_refused(capsys, model, fifo, "a fifo")


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json"])
def test_convert_refuses_to_overwrite_its_input(model: Path, capsys, name: str) -> None:
    _convert_refused(capsys, model, model / name, "is the input")


def test_convert_refuses_a_symlink_to_its_input(model: Path, tmp_path: Path, capsys) -> None:
    link = tmp_path / "out.gguf"
    link.symlink_to(model / "model.safetensors")
    _convert_refused(capsys, model, link, "is the input")


def test_convert_writes_through_a_symlink_to_a_regular_file(model: Path, tmp_path: Path, capsys) -> None:
    real = tmp_path / "real.gguf"
    real.write_bytes(b"old")
    link = tmp_path / "link.gguf"
    link.symlink_to(real)
    code, _, stderr = run_convert(capsys, model, link, "--outtype", "f32")
    assert code == 0, stderr
    assert link.is_symlink() and real.read_bytes()[:4] == b"GGUF"
    assert _hidden(tmp_path) == []


def test_convert_sweeps_stale_temporaries(model: Path, tmp_path: Path, capsys) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    try:
        stale = out_dir / f".out.pid{int(dead.stdout)}.abcdefgh.partial"
        live = out_dir / f".out.pid{sleeper.pid}.abcdefgh.partial"
        old = out_dir / ".out.k2j4h5g6.partial"  # an older version's name, untouched for two hours
        other = out_dir / f".other.pid{int(dead.stdout)}.abcdefgh.partial"  # another output's
        for d in (stale, live, old, other):
            d.mkdir()
            (d / "out.gguf").write_bytes(b"partial")
        os.utime(old, (time.time() - 7200,) * 2)
        code, _, stderr = run_convert(capsys, model, out_dir / "out.gguf", "--outtype", "f32")
        assert code == 0, stderr
        assert _hidden(out_dir) == sorted([live.name, other.name])
    finally:
        sleeper.kill()
        sleeper.wait()


SLOW_CONVERT = slowed_convert_script("streaming", "encode")




@pytest.mark.parametrize("sig,status", [(signal.SIGTERM, 143), (signal.SIGHUP, 129), (signal.SIGINT, 130)])
def test_convert_signal_leaves_nothing(model: Path, tmp_path: Path, sig: signal.Signals, status: int) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    proc = subprocess.Popen([str(VENV_PYTHON), "-c", SLOW_CONVERT, str(model), str(out_dir / "out.gguf"),
                             "--outtype", "f32", "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    wait_for_temp(out_dir, proc, ".partial")
    interrupt(proc, sig, status, "clover-convert", out_dir)


# ---------------------------------------------------------------------------------------------- quantize
def _quantize(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(VENV_PYTHON), "-m", "clover_quantize.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=300)


@pytest.mark.native
def test_quantize_refuses_unsafe_outputs(f32_gguf: Path, tmp_path: Path) -> None:
    weights = _digest(f32_gguf)
    link = tmp_path / "null.gguf"
    link.symlink_to("/dev/null")
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    to_input = tmp_path / "input-link.gguf"
    to_input.symlink_to(f32_gguf)
    for out, fragment in ((Path("/dev/null"), "a device"), (link, "a device"), (fifo, "a fifo"),
                          (f32_gguf, "is the input"), (to_input, "is the input"), (tmp_path, "a directory")):
        before = sorted(p.name for p in tmp_path.iterdir()), sorted(p.name for p in f32_gguf.parent.iterdir())
        done = _quantize(f32_gguf, out, "Q8_0")
        assert done.returncode == 2, (out, done.stderr)
        _one_error_line(done.stderr, "clover-quantize", str(out), fragment)
        assert (sorted(p.name for p in tmp_path.iterdir()), sorted(p.name for p in f32_gguf.parent.iterdir())) \
            == before
    assert _digest(f32_gguf) == weights and Path("/dev/null").is_char_device() and link.is_symlink()


@pytest.mark.native
def test_quantize_sweeps_stale_temporaries_and_writes_through_a_link(f32_gguf: Path, tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".out.gguf.pid{int(dead.stdout)}.abcdefgh.tmp"
    stale.mkdir()
    (stale / "out.gguf").write_bytes(b"partial")
    real = tmp_path / "real.gguf"
    real.write_bytes(b"old")
    (tmp_path / "out.gguf").symlink_to(real)
    done = _quantize(f32_gguf, tmp_path / "out.gguf", "Q8_0")
    assert done.returncode == 0, done.stderr
    assert _hidden(tmp_path) == [] and (tmp_path / "out.gguf").is_symlink() and real.read_bytes()[:4] == b"GGUF"


SLOW_QUANTIZE = """
import sys, time
import clover_quantize.run as r
call = r._call_quantize
def slow(src, dst, params, on_line):
    if not params.params.dry_run:  # the plan (a dry run) comes first
        time.sleep(60)
    return call(src, dst, params, on_line)
r._call_quantize = slow
from clover_quantize.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig,status", [(signal.SIGTERM, 143), (signal.SIGHUP, 129), (signal.SIGINT, 130)])
@pytest.mark.native
def test_quantize_signal_leaves_nothing(f32_gguf: Path, tmp_path: Path, sig: signal.Signals, status: int) -> None:
    """The native call runs on a helper thread: the signal is handled at once, not when llama.cpp returns."""
    proc = subprocess.Popen([str(VENV_PYTHON), "-c", SLOW_QUANTIZE, str(f32_gguf), str(tmp_path / "out.gguf"),
                             "Q8_0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_temp(tmp_path, proc, ".tmp")
    interrupt(proc, sig, status, "clover-quantize", tmp_path)
