"""The GPU check's draft-clover step (scripts/device_check.sh, step 5) as its CPU dry run on this machine's build:
llama-server with each --spec-type and the engine side by side (bench/bench_spec_server.py --quick), reporting a
block pass in ar steps. The GPU machine runs the same step on its CUDA build. A step asked for that fails or finds
no time fails the check."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from clover_dev import REPO_ROOT

pytestmark = pytest.mark.native


def test_the_draft_clover_step_runs_on_the_cpu_build(tmp_path: Path) -> None:
    from clover_native import loader

    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, DEVICE_CHECK_CPU="1", DEVICE_CHECK_NATIVE=str(loader.lib_dir().parent),
               DEVICE_CHECK_STEPS="draft-clover", DEVICE_CHECK_WORK=str(tmp_path / "work"), OUT=str(out))
    done = subprocess.run(["bash", "scripts/device_check.sh"], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    log = (out / "run.log").read_text() if (out / "run.log").exists() else done.stdout
    assert done.returncode == 0, log[-3000:]
    assert "draft-clover rc=0" in log, log[-3000:]
    res = json.loads((out / "bench_spec_server_device.json").read_text())
    model = res["models"]["demo f16"]
    block = model["block_pass"]
    assert block["block_size"] == 32 and block["in_ar_steps"] > 0, block
    for prompts in ("held-out", "no-history"):
        rows = model[prompts]
        assert rows["server draft-clover"]["drafted"] > 0, rows
        assert all(r["decode_tok_s"] > 0 for r in rows.values()), rows


def test_a_step_that_finds_no_time_fails_the_check(tmp_path: Path) -> None:
    """A step asked for that did not run is not a pass: the last line names it and the exit status is 1 (the GPU
    machine's run reports only the status and what came back)."""
    from clover_native import loader

    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, DEVICE_CHECK_CPU="1", DEVICE_CHECK_NATIVE=str(loader.lib_dir().parent),
               DEVICE_CHECK_STEPS="draft-clover", TOTAL_LIMIT="20", OUT=str(out))
    done = subprocess.run(["bash", "scripts/device_check.sh"], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    log = (out / "run.log").read_text()
    assert done.returncode == 1, log
    assert "skip draft-clover (time)" in log and "not done: draft-clover (no time)" in log, log
    assert not (out / "bench_spec_server_device.json").exists()
