"""Helpers for the tests of `clover-cpp serve` (tests/surfaces/test_serve_live.py, test_serve_endpoints.py): a live
server on a GGUF, and plain HTTP calls to it."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from clover_dev.process import cli_command
from tests.support.chat import child_env
from tests.support.native import stop_process

MODEL_ID = "tiny"  # the tiny checkpoint's GGUF, served under its file name (tests/surfaces/conftest.py)
THINK_OFF = {"chat_template_kwargs": {"enable_thinking": False}}


@contextmanager
def serve(gguf: Path, folder: Path, *args: str, alive_at_end: bool = True
          ) -> Iterator[tuple[str, subprocess.Popen[bytes], Path]]:
    """A live `clover-cpp serve` on any free port: (url, process, log path); SIGTERM at the end."""
    log_path = folder / f"server-{time.monotonic_ns()}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cli_command("serve", "-m", str(gguf), "--port", "0", "--log-level", "warning", *args),
                                stdout=log, stderr=subprocess.STDOUT, env=child_env())
    try:
        url = None
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            found = re.search(r"listening on (http://\S+)", log_path.read_text())
            if found:
                url = found.group(1)
            elif proc.poll() is not None:
                pytest.fail(f"the server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            else:
                time.sleep(0.05)
        assert url, "the server did not start in 120 s"
        while True:  # listening is printed just before uvicorn starts serving
            try:
                get(url + "/health")
                break
            except OSError:
                time.sleep(0.05)
        yield url, proc, log_path
        assert proc.poll() is None or not alive_at_end, f"the server died:\n{log_path.read_text()[-3000:]}"
    finally:
        stop_process(proc)


def get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def http(url: str, body: bytes | dict[str, Any] | None = None, headers: dict[str, str] | None = None,
         method: str | None = None, timeout: float = 30) -> tuple[int, dict[str, str], bytes]:
    """(status, headers by lower-case name, body) of any answer, an error's included. A dict ``body`` is sent as
    JSON; ``method`` is POST with a body and GET without unless given; Content-Type is JSON unless ``headers`` say
    otherwise."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, err.read()


def post_raw(url: str, body: bytes, content_type: str = "application/json",
             method: str = "POST", headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    status, _, answer = http(url, body if method == "POST" else None, {"Content-Type": content_type, **(headers or {})},
                             method, timeout=60)
    return status, json.loads(answer)


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    return post_raw(url, json.dumps(body).encode())


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
