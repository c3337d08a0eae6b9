"""clover_cpp sets OpenMP's wait policy before ggml loads libgomp, and leaves a user's own setting alone.

Loading a model leaves an OpenMP pool on the loading thread; a pass on any other thread (a server's request, a
slot) then makes libgomp manage more threads than cores, and with its default policy it sleeps at every barrier
(docs/serve.md, "Slots"). libgomp reads the policy once, when it is loaded, so the check asks libgomp itself
(OMP_DISPLAY_ENV) what it read, in a fresh interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.native import REPO_ROOT

pytestmark = pytest.mark.native  # tests/conftest.py: require_native()

LOAD = "from clover_cpp import loader; loader.llama()"


def libgomp_policy(**env: str) -> str:
    """The wait policy libgomp reports after clover_cpp loads llama.cpp in a fresh interpreter."""
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    done = subprocess.run([sys.executable, "-c", LOAD], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                          env={**base, "OMP_DISPLAY_ENV": "TRUE", **env})
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if "OMP_WAIT_POLICY" in line]
    assert lines, f"libgomp printed no environment: is ggml built without OpenMP?\n{done.stderr[-2000:]}"
    return lines[0].split("=", 1)[1].strip().strip("'")


def test_active_policy_by_default() -> None:
    assert libgomp_policy() == "ACTIVE"


def test_user_policy_kept() -> None:
    assert libgomp_policy(OMP_WAIT_POLICY="passive") == "PASSIVE"
    assert libgomp_policy(GOMP_SPINCOUNT="1000") != "ACTIVE"  # a spin count alone is the user's choice too
