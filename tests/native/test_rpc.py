"""Offload through llama.cpp's RPC backend (docs/distributed.md): `clover-cpp --rpc HOST:PORT,...`.

Two rpc-server processes on localhost take the demo model's layers (-ngl 99 splits them between the two
devices by free memory, as llama.cpp does); greedy ar, diffusion and spec output must equal the local run:
block passes (scratch sequence, non-causal attention) and spec's rollbacks (seq_rm of the history's KV cells and
recurrent state) then run on remote buffers. The RPC run happens in a subprocess: RPC devices are registered for
the whole process, and a later load in the test process must not see them.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from clover_dev import REPO_ROOT
from clover_dev.process import free_port, stop_process
from tests.support.native import native_tool

pytestmark = pytest.mark.native  # every test here runs the native build (skipped without it; a failure in CI)

DEMO = REPO_ROOT / "models" / "clover-demo"
PROMPT = "def binary_search(items, target):\n"
TOKENS = 40
MODES = {"ar": {}, "diffusion": {"block_size": 8}, "spec": {"block_size": 8}}

# argv: GGUF RPC_SERVERS PROMPT TOKENS MODES_JSON -> one JSON line: the device plan and each mode's tokens and stats
RPC_SCRIPT = """
import json, sys
from clover_native import libclover
from clover_cpp import Model
from clover_cpp.model import engine_params
from clover_cpp.offload import Offload
gguf, servers, prompt, n, modes = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), json.loads(sys.argv[5])
offload = Offload(rpc=servers)
params, keep = engine_params(n_ctx=1024, n_threads=1, n_gpu_layers=99, offload=offload)
plan = libclover.plan_memory(gguf, params)
out = {"plan": [{"name": d["name"], "model": d["model"]} for d in plan], "runs": {}}
with Model(gguf, n_ctx=1024, n_threads=1, n_gpu_layers=99, offload=offload) as model:
    ids = model.tokenize(prompt)
    for mode, opts in modes.items():
        model.reset()
        r = model.run(ids, mode=mode, max_tokens=n, **opts)
        out["runs"][mode] = {"tokens": r.tokens, "block_passes": r.stats.block_passes,
                             "causal_passes": r.stats.causal_passes}
print(json.dumps(out))
"""


def wait_listening(port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            pytest.fail(f"rpc-server exited with {proc.returncode}:\n{log.read_text()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            assert time.monotonic() < deadline, f"rpc-server not listening in 60 s:\n{log.read_text()[-2000:]}"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def rpc_servers(demo_gguf: Path) -> Iterator[str]:
    """Two rpc-servers bound to 127.0.0.1 (rpc-server has no authentication); "host:port,host:port"."""
    exe = native_tool("rpc-server")
    procs, endpoints = [], []
    try:
        for i in range(2):
            port = free_port()
            log = demo_gguf.parent / f"rpc-server-{i}.log"
            with open(log, "w") as f:
                proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
                                        stdout=f, stderr=subprocess.STDOUT)
            procs.append(proc)
            wait_listening(port, proc, log)
            endpoints.append(f"127.0.0.1:{port}")
        yield ",".join(endpoints)
    finally:
        for proc in procs:
            stop_process(proc, timeout=10)


def test_rpc_split_equals_local(demo_gguf: Path, rpc_servers: str) -> None:
    from clover_cpp import Model

    done = subprocess.run([sys.executable, "-c", RPC_SCRIPT, str(demo_gguf), rpc_servers, PROMPT, str(TOKENS),
                           json.dumps(MODES)], capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    remote = json.loads(done.stdout.splitlines()[-1])

    # the weights went to both servers (the input embedding stays on the host, as in llama.cpp)
    on_rpc = {d["name"]: d["model"] for d in remote["plan"] if d["name"].startswith("RPC")}
    assert len(on_rpc) == 2 and all(v > 0 for v in on_rpc.values()), remote["plan"]

    with Model(str(demo_gguf), n_ctx=1024, n_threads=1) as model:
        ids = model.tokenize(PROMPT)
        for mode, opts in MODES.items():
            model.reset()
            local = model.run(ids, mode=mode, max_tokens=TOKENS, **opts)
            got = remote["runs"][mode]
            assert got["tokens"] == local.tokens, (mode, got["tokens"], local.tokens)
            assert (got["block_passes"], got["causal_passes"]) == (local.stats.block_passes,
                                                                     local.stats.causal_passes), mode
            assert len(local.tokens) == TOKENS
    # the modes did what the split has to carry: block passes (diffusion, spec) and rollbacks (spec verifies a
    # draft and keeps only its accepted prefix, so it needs fewer causal passes than tokens but more than none)
    assert remote["runs"]["diffusion"]["block_passes"] > 0
    spec = remote["runs"]["spec"]
    assert spec["block_passes"] > 0 and 0 < spec["causal_passes"] < TOKENS


@pytest.mark.parametrize("servers, message", [
    ("127.0.0.1", "'127.0.0.1' is not host:port"),
    ("127.0.0.1:1", "cannot connect to an rpc-server at 127.0.0.1:1"),
])
def test_rpc_bad_endpoint_is_one_line(demo_gguf: Path, servers: str, message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "clover_cpp.cli", "generate", "-m", str(demo_gguf), "-p", "x",
                           "-n", "1", "-ngl", "99", "--rpc", servers], capture_output=True, text=True, timeout=120,
                          cwd=REPO_ROOT)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr
