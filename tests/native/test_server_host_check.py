"""llama-server bound to loopback answers only requests whose Host header names it (docs/serve.md, "Loopback binds:
the Host check"; the DNS-rebinding guard `clover-cpp serve` has, patch 0024-server-loopback-host-check): a web page
whose name an attacker points at 127.0.0.1 still sends its own name.
"""

from __future__ import annotations

import http.client
import json
import socket
from pathlib import Path
from urllib.parse import urlparse

import pytest

from tests.support.native import llama_server

pytestmark = pytest.mark.native

SERVER_ARGS = ("-c", "256", "-np", "1", "-t", "2", "--no-warmup")


def get(url: str, path: str, host: str | None) -> tuple[int, dict]:
    """GET path with the given Host header (None: none at all, as an HTTP/1.0 client may send)."""
    where = urlparse(url)
    if host is None:
        with socket.create_connection((where.hostname, where.port), timeout=30) as s:
            s.sendall(f"GET {path} HTTP/1.0\r\n\r\n".encode())
            raw = b""
            while chunk := s.recv(65536):
                raw += chunk
        head, _, body = raw.partition(b"\r\n\r\n")
        return int(head.split()[1]), json.loads(body or b"{}")
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=30)
    try:
        conn.request("GET", path, headers={"Host": host})
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        conn.close()


def test_a_loopback_server_answers_only_its_own_names(demo_gguf: Path) -> None:
    with llama_server(demo_gguf, *SERVER_ARGS) as url:
        port = urlparse(url).port
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}", f"[::1]:{port}", None):
            status, _ = get(url, "/health", host)
            assert status == 200, host
        forbidden = (f"attacker.example:{port}", f"127.0.0.1.attacker.example:{port}", "127.0.0.1",
                     f"localhost:{port + 1}")
        for host in forbidden:
            for path in ("/health", "/v1/models"):
                status, body = get(url, path, host)
                assert status == 403, (host, path, body)
                assert body["error"]["type"] == "invalid_request_error" and host in body["error"]["message"], body


def test_a_server_bound_beyond_loopback_answers_any_host(demo_gguf: Path) -> None:
    """Bound to another address, the names it is reached by are not known: no check (an API key guards it)."""
    with llama_server(demo_gguf, *SERVER_ARGS, "--host", "0.0.0.0") as url:
        status, _ = get(url, "/health", "attacker.example:8080")
        assert status == 200
