"""Processes of the toolkit: the clover-cpp command line, and a port for a server to listen on."""

from __future__ import annotations

import socket
import sys
from pathlib import Path


def cli_command(*args: str) -> list[str]:
    """The argv of ``clover-cpp ARGS...``: the installed script next to this interpreter, else ``-m clover_cpp.cli``."""
    exe = Path(sys.executable).parent / "clover-cpp"
    return ([str(exe)] if exe.exists() else [sys.executable, "-m", "clover_cpp.cli"]) + list(args)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
