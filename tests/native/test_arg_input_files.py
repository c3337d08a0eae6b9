"""The files llama.cpp's options read whole (common/arg.cpp: --api-key-file, --chat-template-file, --grammar-file,
--json-schema-file, -f, -bf, -sysf, --ui-config-file) must be regular files under a size cap (patch
0025-arg-input-files-regular-and-capped; docs/architecture.md, "Input files"): a fifo would block llama-server's start
for ever and /dev/zero would fill the memory. Each is refused at once with a line naming the file and what it is,
and the server does not start.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.support.native import llama_server, native_tool
from tests.support.serve import http

pytestmark = pytest.mark.native


def start(demo_gguf: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(native_tool("llama-server")), "-m", str(demo_gguf), "--port", "0", "-c", "256",
                           "--no-warmup", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("flag", ["--api-key-file", "--chat-template-file", "--grammar-file"])
def test_a_fifo_or_a_device_is_refused_before_it_is_opened(demo_gguf: Path, tmp_path: Path, flag: str) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for path, what in ((fifo, "a fifo (named pipe)"), (Path("/dev/zero"), "a character device"),
                       (tmp_path, "a directory")):
        done = start(demo_gguf, flag, str(path))  # a fifo would block here, /dev/zero never end
        assert done.returncode != 0, done.stderr[-2000:]
        assert f"'{path}' is {what}, not a regular file" in done.stderr, done.stderr[-2000:]


def test_a_file_over_its_cap_is_refused(demo_gguf: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    with open(keys, "wb") as f:
        f.truncate((1 << 20) + 1)  # the API key files' cap is 1 MiB (sparse: no disk used)
    done = start(demo_gguf, "--api-key-file", str(keys))
    assert done.returncode != 0
    want = f"'{keys}' is {(1 << 20) + 1} bytes, more than the 1 MiB this option reads"
    assert want in done.stderr, done.stderr[-2000:]


def test_a_regular_key_file_still_gives_its_keys(demo_gguf: Path, tmp_path: Path) -> None:
    """Comment lines are skipped, the keys guard the API."""
    keys = tmp_path / "keys.txt"
    keys.write_text("# a comment\nsecret-1\n")
    with llama_server(demo_gguf, "-c", "256", "--no-warmup", "--api-key-file", str(keys)) as url:
        assert http(url + "/v1/models", headers={"Authorization": "Bearer secret-1"})[0] == 200
        assert http(url + "/v1/models", headers={"Authorization": "Bearer # a comment"})[0] == 401
        assert http(url + "/v1/models")[0] == 401
