"""Shared fixtures: random checkpoints made once per test session by the checkpoint factory."""

from __future__ import annotations

import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from clover_ref.factory import init_checkpoint
from tests.support.handmade import write_handmade
from tests.support.native import require_native
from tests.support.tmp import MkTemp

# Tests send SIGINT to child processes (Ctrl-C in the chat, interrupted conversions). A shell without job
# control starts a background job (`make test &`, nohup) with SIGINT ignored, every child would inherit that,
# and CPython then never turns SIGINT into KeyboardInterrupt. Restore the default here (children get SIG_DFL).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MkTemp]:
    """``module_tmp(name)``: a numbered scratch directory under the session's base, removed when this module's tests
    are done (tests/support/tmp.py)."""
    made: list[Path] = []

    def mktemp(name: str) -> Path:
        made.append(tmp_path_factory.mktemp(name))
        return made[-1]

    yield mktemp
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tiny` preset (3 GDN + 1 attention layer, 8 experts top-2, vocab 3072, B = 8), bf16, seed 0."""
    out = tmp_path_factory.mktemp("tiny")
    init_checkpoint(out, "tiny", seed=0)
    return out


@pytest.fixture(scope="session")
def mid_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `mid` preset: real Qwen3.5-35B-A3B per-layer dims, 4 layers, 16 experts top-8, bf16, seed 0."""
    out = tmp_path_factory.mktemp("mid")
    init_checkpoint(out, "mid", seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoint: Path):
    from clover_ref.checkpoint import load_model

    return load_model(tiny_checkpoint)


@pytest.fixture(scope="session")
def mid_model(mid_checkpoint: Path):
    from clover_ref.checkpoint import load_model

    return load_model(mid_checkpoint)


# ------------------------------------------------------------------------------------ run-wide reporting
_NOTES: list[str] = []


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tests marked ``native`` need the native build: without it they skip, or fail under CLOVER_REQUIRE_NATIVE=1,
    before any fixture builds a GGUF for them."""
    if item.get_closest_marker("native") is not None:
        require_native()


def pytest_sessionstart(session: pytest.Session) -> None:
    """The CPU and the native build first (even under -q), so every failure report carries them."""
    from clover_native import cpu, loader

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or hasattr(session.config, "workerinput"):  # xdist workers have no terminal
        return
    info = cpu.read_build_info(loader.lib_dir().parent)
    build = "not built (make native)"
    if info:
        build = (f"{info.get('gpu', '?')} build {info.get('key', '?')}, compiled for CPU features: "
                 f"{info.get('cpu_features') or 'unknown (an older build script)'}")
    reporter.write_line(f"CPU: {cpu.read_cpuinfo().summary()}")
    reporter.write_line(f"native: {build}")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Collect the one-line notes tests attach with ``record_property("note", ...)`` (also from workers)."""
    if report.when == "call":
        _NOTES.extend(str(v) for k, v in report.user_properties if k == "note")


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    for note in dict.fromkeys(_NOTES):
        terminalreporter.write_line(f"note: {note}")


@pytest.fixture(scope="session")
def handmade(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """A checkpoint written by transformers' Qwen3_5MoeForCausalLM plus the block-diffusion tensors
    (tests/support/handmade.py), and that transformers model."""
    out = tmp_path_factory.mktemp("handmade") / "Clover-Handmade"
    return out, write_handmade(out)

