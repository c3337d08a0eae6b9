"""Processes of the toolkit: the clover-cpp command line, a port for a server to listen on, and llama-server."""

from __future__ import annotations

import random
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def cli_command(*args: str) -> list[str]:
    """The argv of ``clover-cpp ARGS...``: the installed script next to this interpreter, else ``-m clover_cpp.cli``."""
    exe = Path(sys.executable).parent / "clover-cpp"
    return ([str(exe)] if exe.exists() else [sys.executable, "-m", "clover_cpp.cli"]) + list(args)


def _ephemeral_low(default: int = 32768) -> int:
    """The lowest port the kernel gives an outgoing connection (Linux's ip_local_port_range), else ``default``."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, below the ephemeral range: a port the kernel hands out
    (bind to port 0) can be taken as the source port of any client connection before the server binds it, which
    failed a test run with "couldn't bind HTTP server socket"."""
    high = min(_ephemeral_low(), 65536)
    low = max(1024, min(10000, high - 2048))
    for port in random.Random().sample(range(low, high), k=min(64, high - low)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the range is taken: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_process(proc: subprocess.Popen, timeout: float = 20) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def llama_server(exe: Path, gguf: Path, *args: str, log_path: Path, ready_s: float = 120) -> Iterator[str]:
    """llama-server ``exe`` on ``gguf`` (bound to localhost, on a free port, with ``args``), once its /health
    answers 200; its base URL (serving)."""
    port = free_port()
    argv = [str(exe), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), *args]
    with serving(argv, port, log_path=log_path, ready_s=ready_s) as (url, _):
        yield url


@contextmanager
def serving(argv: list[str], port: int, *, log_path: Path, ready_s: float = 120, env: dict[str, str] | None = None,
            alive_at_end: bool = True) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A server process (``argv``, listening on 127.0.0.1:``port``, its output in ``log_path``) once its /health
    answers 200: (its base URL, the process); SIGTERM at the end. RuntimeError, with the log's tail, when it exits
    or is not ready within ready_s, or (``alive_at_end``) has died by the end of the block."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{Path(argv[0]).name} exited with {proc.returncode}:\n"
                                   f"{log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except OSError:  # not listening yet, or 503 while the model loads
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{Path(argv[0]).name} not ready in {ready_s} s:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.2)
        yield url, proc
        if alive_at_end and proc.poll() is not None:
            raise RuntimeError(f"{Path(argv[0]).name} died:\n{log_path.read_text()[-3000:]}")
    finally:
        stop_process(proc)


def server_metrics(url: str) -> dict[str, float]:
    """llama-server's /metrics (``--metrics``): each ``llamacpp:`` counter and gauge by its name without the prefix."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return {name: float(value) for name, value in re.findall(r"^llamacpp:(\w+) (\S+)$", text, re.M)}
