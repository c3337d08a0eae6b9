"""`clover-cpp serve` (llama-server) stays reachable (docs/serve.md, "Connections"): connections that never finish a
request neither keep `/health` from answering nor fill the log, and the patched cpp-httplib closes them: a head
must arrive within `--timeout-head` seconds of its first byte, a body may not pause longer than `--timeout`, and a
connection that sends nothing is closed after cpp-httplib's keep-alive wait (5 s).

Written against HTTP alone (raw sockets and urllib).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import selectors
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from http.client import HTTPConnection

import pytest

from tests.support.native import skip_or_fail
from tests.support.serve import MODEL_ID, address, clover_serve, get, http

pytestmark = pytest.mark.native

# connections that send no head, or half of one: fewer than llama-server's HTTP threads (its base threads and 1024
# more it may start), each of which serves one connection at a time
HALF_OPEN = 800
HOLD_S = 3.0  # how long they are held while /health is asked


@pytest.fixture
def many_files() -> Iterator[None]:
    """This process may hold HALF_OPEN sockets and more (its soft limit raised for the test, then restored)."""
    need = HALF_OPEN + 512
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < need:
        skip_or_fail(f"the test holds {HALF_OPEN} connections and needs {need} open files, but the hard limit is "
                     f"{hard} (ulimit -Hn)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _partial_head(where: tuple[str, int]) -> bytes:
    """The start of a request's head: its request line and two of its headers."""
    host, port = where
    return f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n".encode()


def _no_body(where: tuple[str, int]) -> bytes:
    """A whole head, and one byte of the 100 its body should have."""
    return _partial_head(where) + b"Content-Length: 100\r\n\r\n{"


def _connect(where: tuple[str, int], send: bytes = b"") -> socket.socket | None:
    """A connection that sends ``send`` (part of a head) and then nothing; None when the server refused it."""
    try:
        sock = socket.create_connection(where, timeout=5)
        if send:
            sock.sendall(send)
        return sock
    except OSError:
        return None


def _health_s(url: str) -> float:
    start = time.monotonic()
    assert get(url + "/health")["status"] == "ok"
    return time.monotonic() - start


def _flood(where: tuple[str, int], n: int) -> list[socket.socket]:
    """``n`` connections, connecting without waiting (the kernel retries what the server's queue drops); every
    second one sends part of a head once it is connected (within 5 s). None sends more."""
    family = socket.getaddrinfo(*where, type=socket.SOCK_STREAM)[0][0]
    socks = []
    for _ in range(n):
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.connect_ex(where)
        socks.append(sock)
    with selectors.DefaultSelector() as sel:
        for sock in socks[1::2]:
            sel.register(sock, selectors.EVENT_WRITE)
        deadline = time.monotonic() + 5
        while sel.get_map() and time.monotonic() < deadline:
            for key, _ in sel.select(0.1):
                sock = key.fileobj
                sel.unregister(sock)
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                    try:
                        sock.send(_partial_head(where))
                    except OSError:
                        pass  # closed by the server meanwhile
    return socks


def _held_while_asking(url: str) -> tuple[float, int]:
    """/health asked every 0.05 s for HOLD_S, then a completion (which must get through): (the slowest /health, how
    many were asked)."""
    slowest, asked = 0.0, 0
    deadline = time.monotonic() + HOLD_S
    while time.monotonic() < deadline:
        slowest = max(slowest, _health_s(url))
        asked += 1
        time.sleep(0.05)
    status, _, body = http(url + "/v1/completions", {"model": MODEL_ID, "prompt": "hi", "max_tokens": 1}, timeout=30)
    assert status == 200, body[:300]
    return slowest, asked


def test_health_answers_while_hundreds_of_connections_send_no_head(tiny_gguf: Path, many_files: None) -> None:
    """The attack of a client without an API key: HALF_OPEN connections, half of them with part of a head, held
    for HOLD_S (within the head's deadline and the keep-alive wait, so the server closes none of them meanwhile).
    /health answers within 1 s all along, a completion still gets through, and the log grows by less than 1 MB."""
    with clover_serve(tiny_gguf, "-c", "512", "-t", "2", "--no-warmup") as (url, _, log):
        logged = log.stat().st_size
        held = _flood(address(url), HALF_OPEN)
        try:
            slowest, asked = _held_while_asking(url)
        finally:
            for sock in held:
                sock.close()
        grown = log.stat().st_size - logged
    assert slowest < 1.0, f"/health took {slowest:.2f} s while {HALF_OPEN} connections were held"
    assert asked >= 10
    assert grown < 2**20, f"the log grew by {grown} bytes:\n{log.read_text()[-2000:]}"


def _closed_after(sock: socket.socket, limit_s: float) -> float | None:
    """Seconds until the server closes ``sock`` (reads give EOF or a reset), None if it stays open for limit_s."""
    start = time.monotonic()
    sock.settimeout(limit_s)
    try:
        while sock.recv(4096):
            pass
    except (socket.timeout, TimeoutError):
        return None
    except OSError:
        pass
    return time.monotonic() - start


def test_timeout_closes_connections_that_never_finish_a_request(tiny_gguf: Path) -> None:
    """--timeout-head 1 --timeout 1: a silent connection (after the keep-alive wait), one that stops mid-head, one
    that sends its head a byte every 0.3 s and one whose body never comes are closed within 10 s; a client that
    keeps asking on one connection is not."""
    with clover_serve(tiny_gguf, "-c", "512", "-t", "2", "--no-warmup", "--timeout-head", "1", "--timeout", "1"
                      ) as (url, _, _):
        where = address(url)
        silent = _connect(where)
        partial = _connect(where, _partial_head(where))
        no_body = _connect(where, _no_body(where))
        trickle = _connect(where)
        assert silent and partial and no_body and trickle
        stop = threading.Event()

        def slowloris() -> None:
            for byte in _partial_head(where) * 10:
                if stop.wait(0.3):
                    return
                try:
                    trickle.send(bytes([byte]))
                except OSError:
                    return

        thread = threading.Thread(target=slowloris, daemon=True)
        thread.start()
        keep = HTTPConnection(*where, timeout=10)
        early = None
        try:
            keep.request("GET", "/health")
            assert keep.getresponse().read()
            first = keep.sock
            for _ in range(6):  # 0.3 s apart, within the deadline that each answer's end starts
                time.sleep(0.3)
                keep.request("GET", "/health")
                answer = keep.getresponse()
                assert answer.status == 200 and answer.read()
            assert keep.sock is first, "the server closed a connection that kept asking"
            # answered before its body came (the server reads no GET body), then the body: the next head has a deadline
            early = _connect(where, f"GET /nowhere HTTP/1.1\r\nHost: {where[0]}:{where[1]}\r\n"
                                    "Content-Length: 5\r\n\r\n".encode())
            assert early is not None
            assert early.recv(4096).startswith(b"HTTP/1.1 404")
            early.sendall(b"hello")
            for name, sock in (("silent", silent), ("partial head", partial), ("no body", no_body),
                               ("slowloris", trickle), ("answered early", early)):
                waited = _closed_after(sock, 10)
                assert waited is not None, f"{name}: still open 10 s after the deadline"
        finally:
            stop.set()
            thread.join()
            keep.close()
            for sock in (silent, partial, no_body, trickle, early):
                if sock is not None:
                    sock.close()
        assert get(url + "/health")["status"] == "ok"


FLOOD = 2000  # connections of the flood below: twice the open files the server may have
SERVER_FILES = 1024  # the server's open-file limit there (a common default); --max-connections -1 makes it 960


def _set_soft_file_limit(n: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < n:
        skip_or_fail(f"the test needs {n} open files, but the hard limit is {hard} (ulimit -Hn)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))


def _server_closed(sock: socket.socket) -> bool:
    """True when the server has closed ``sock`` (a read gives EOF or an error at once)."""
    try:
        return sock.recv(1, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_a_flood_past_the_open_files_closes_the_oldest_idle_connections(tiny_gguf: Path) -> None:
    """FLOOD connections that send no head or half of one, against a server limited to SERVER_FILES open files:
    past its cap (the default, the open files less 64) each new connection closes the oldest that carries no
    request, so /health answers within 1 s all along and a completion gets through (patches
    vendor-httplib-connection-cap, server-max-connections; before them /health waited while the flood was held)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = SERVER_FILES - 64
    try:
        _set_soft_file_limit(SERVER_FILES)  # the server inherits it
        with clover_serve(tiny_gguf, "-c", "512", "-t", "2", "--no-warmup") as (url, proc, log):
            _set_soft_file_limit(FLOOD + 512)
            held = _flood(address(url), FLOOD)
            try:
                slowest, asked = _held_while_asking(url)
                closed = sum(_server_closed(s) for s in held)
                server_files = len(os.listdir(f"/proc/{proc.pid}/fd"))  # clover-cpp serve execs llama-server
            finally:
                for sock in held:
                    sock.close()
            assert f"at most {cap} open connections" in log.read_text(errors="replace")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert slowest < 1.0, f"/health took {slowest:.2f} s while {FLOOD} connections were held"
    assert asked >= 10
    # how many it has closed by then depends on how far its accept loop got through the kernel's queue
    assert closed > 0, "the server closed none of the flood's connections"
    assert server_files < SERVER_FILES, f"the server holds {server_files} files, its limit is {SERVER_FILES}"


def _refusal_at_the_cap(where: tuple[str, int], busy: list[socket.socket | None]) -> bytes:
    """With two connections carrying requests and room for one more: a third that carries one, then a fourth, which
    is answered at once, before it sends anything. The third counts as carrying a request once the server has read
    its head: until then it is idle, and the fourth makes room by closing it. On a loaded machine that can take
    longer than the wait, so each try waits longer, and a try whose third connection was closed is one more try."""
    for wait_s in (0.3, 1.0, 3.0):
        third = _connect(where, _no_body(where))
        assert third is not None
        busy.append(third)
        time.sleep(wait_s)
        refused = _connect(where)
        assert refused is not None
        answer = b""
        with contextlib.suppress(TimeoutError):  # no answer: the server closed the third instead (checked below)
            while chunk := refused.recv(4096):
                answer += chunk
        refused.close()
        if answer:
            return answer
        assert _closed_after(third, 5) is not None, "neither a 503 nor the idle third connection closed"
    raise AssertionError("the third connection's head was never read before the fourth arrived")


def test_past_the_cap_an_idle_connection_goes_first_and_then_a_503(tiny_gguf: Path) -> None:
    """--max-connections 3: with two connections carrying a request (their heads read, their bodies pending) and one
    silent, a fourth connection gets its answer and the silent one is closed; with three carrying requests, a new
    connection is answered 503 with a JSON error body."""
    with clover_serve(tiny_gguf, "-c", "512", "-t", "2", "--no-warmup", "--max-connections", "3", "--timeout", "30"
                      ) as (url, _, _):
        where = address(url)
        busy = [_connect(where, _no_body(where)) for _ in range(2)]
        time.sleep(0.3)  # their heads are read
        silent = _connect(where)
        try:
            assert all(busy) and silent
            time.sleep(0.3)
            assert get(url + "/health")["status"] == "ok"  # the oldest idle connection made room: the silent one
            assert _closed_after(silent, 5) is not None, "the idle connection is still open"
            answer = _refusal_at_the_cap(where, busy)
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503 ") and b"Content-Type: application/json" in head, answer
            assert json.loads(body)["error"]["message"] == "too many open connections"
        finally:
            for sock in (*busy, silent):
                if sock is not None:
                    sock.close()
        time.sleep(0.3)
        assert get(url + "/health")["status"] == "ok"  # their requests ended with their connections


def test_a_streamed_answer_leaves_its_connection_open(tiny_gguf: Path) -> None:
    """A streamed answer ends with its last chunk and keeps the connection it offered keep-alive on, so the next
    request on it is answered (patch server-finished-stream-keeps-connection: llama-server closed it, and a client
    that pools connections, as the openai and anthropic SDKs do, got 'Server disconnected' on its next request)."""
    with clover_serve(tiny_gguf, "-c", "512", "-t", "2", "--no-warmup") as (url, _, _):
        conn = HTTPConnection(*address(url), timeout=30)
        try:
            body = json.dumps({"model": MODEL_ID, "prompt": "x", "max_tokens": 4, "stream": True})
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            streamed = conn.getresponse()
            assert streamed.status == 200 and streamed.getheader("Connection") != "close"
            assert b"data: [DONE]" in streamed.read()
            sock = conn.sock
            time.sleep(0.5)  # the server's close, if it came, has arrived
            conn.request("GET", "/health")
            answer = conn.getresponse()
            assert answer.status == 200 and answer.read() and conn.sock is sock
        finally:
            conn.close()
