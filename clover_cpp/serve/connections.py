"""The server's connections (docs/serve.md, "Limits"): a cap on open connections, a deadline for each request to
arrive, and per-connection errors logged once per interval, so that clients that connect and never finish a
request can neither keep others out nor fill the log.

- **The deadline** (``--timeout`` seconds): a connection must send a request's head (request line and headers)
  within it of connecting, or of its previous answer's end, and may not fall silent for longer while it sends the
  body; otherwise it is closed. Once the request has arrived, answering it takes as long as it takes.
- **The cap** (``Gate``): at most MAX_CONNECTIONS open connections (fewer when the process may open few files).
  A connection beyond it closes the oldest one whose request has not all arrived (its head, or its body); only when
  every open connection carries a whole request is the newcomer refused, with a 503 ``too_many_connections`` once
  its head arrives. So neither heads nor bodies sent slowly can keep others out.
- **Files**: the soft limit on open files is raised to the hard limit at start, and the cap is sized below it, so
  that the cap, not EMFILE, governs. asyncio's accept loop logs every failed accept with a traceback (thousands a
  second when files run out); ``OncePerInterval`` lets one line through per interval, with the count.

uvicorn's own h11 protocol does the HTTP (``GatedH11`` adds the bookkeeping), passed as uvicorn's ``http=`` class.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import socket
import time
from collections import OrderedDict
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .schema import error_body
from .security import send_error

MAX_CONNECTIONS = 1024
BACKLOG = 2048  # uvicorn's default: both the listen queue and the most connections accepted in one turn of the loop
FILE_RESERVE = 64  # files the process keeps besides its connections (the model, the logs, the listening socket)
LOG_INTERVAL_S = 10.0

log = logging.getLogger("clover_cpp.serve")


def raise_file_limit() -> int:
    """Raise the soft limit on open files to the hard one (unlimited: to what the cap needs); the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, MAX_CONNECTIONS + 2 * BACKLOG + FILE_RESERVE)
    if want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            pass  # the limit stays, and the cap fits under it
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


class Gate:
    """The open connections of one server: the cap, and those whose request has not all arrived (``waiting``: for
    its head or the rest of its body), oldest first.

    ``files``: the soft limit on open files. asyncio accepts up to ``backlog`` connections in one turn of its loop
    before any is looked at, and a connection closed in one turn frees its file in the next, which may accept
    another ``backlog``: the cap leaves room for twice that, and FILE_RESERVE."""

    def __init__(self, timeout_s: float, files: int) -> None:
        self.timeout_s = timeout_s
        self.backlog = max(16, min(BACKLOG, files // 8))
        self.cap = max(16, min(MAX_CONNECTIONS, files - 2 * self.backlog - FILE_RESERVE))
        self.open: set[GatedH11] = set()
        self.waiting: OrderedDict[GatedH11, None] = OrderedDict()
        self.throttle = Throttle()

    def opened(self, conn: GatedH11) -> None:
        """A new connection: beyond the cap, the oldest one whose request has not all arrived is closed; if none
        waits, the newcomer is refused (it then waits for its head, to be answered with a 503, or to be closed in
        turn)."""
        self.open.add(conn)
        while len(self.open) > self.cap and self.waiting:
            self.drop(next(iter(self.waiting)))
            self._log("closed the oldest connection whose request had not all arrived")
        if len(self.open) > self.cap:
            conn.refuse()
            self._log("refused a connection with a 503: every open connection carries a request")
        self.await_head(conn)

    def _log(self, what: str) -> None:
        held = self.throttle.due(what)
        if held is not None:
            log.warning("clover-cpp serve: %s: %d open connections are the cap (docs/serve.md, \"Limits\")%s",
                        what, self.cap, _more(held, self.throttle.interval_s))

    def await_head(self, conn: GatedH11) -> None:
        self.waiting[conn] = None
        conn.arm(self.timeout_s)

    def arrived(self, conn: GatedH11) -> None:
        """``conn``'s request has all arrived: answering it takes as long as it takes."""
        self.waiting.pop(conn, None)
        conn.disarm()

    def drop(self, conn: GatedH11) -> None:
        """Close ``conn`` now and stop counting it (its ``connection_lost`` comes later)."""
        self.closed(conn)
        conn.transport.close()

    def closed(self, conn: GatedH11) -> None:
        self.open.discard(conn)
        self.arrived(conn)


class GatedH11(H11Protocol):
    """uvicorn's h11 protocol under a ``Gate`` (``protocol_class`` binds one)."""

    gate: Gate

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.gate.opened(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.gate.closed(self)
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        state = self.conn.their_state
        if state is h11.IDLE:  # waiting for a head: its deadline stands, whatever part of it arrives
            if self not in self.gate.waiting and self.conn.our_state is h11.IDLE and not self.transport.is_closing():
                # the next cycle began here: an answer sent before its request's body had all arrived (a 401, a
                # 404), and that body's end now came; the next head has a deadline too
                self.gate.await_head(self)
            return
        if state is h11.SEND_BODY:  # the body: at most timeout_s of silence between its pieces, and evictable
            self.gate.waiting.setdefault(self, None)
            self.arm(self.gate.timeout_s)
        else:
            self.gate.arrived(self)

    def on_response_complete(self) -> None:
        if not self.transport.is_closing() and self.conn.their_state is h11.DONE:  # kept alive: the next
            self.gate.await_head(self)  # request's head has a deadline too (a body still coming keeps its own)
        super().on_response_complete()  # may handle a pipelined request at once (handle_events)

    def arm(self, timeout_s: float) -> None:
        self.disarm()
        if timeout_s > 0:
            self._timer = self.loop.call_later(timeout_s, self._expired)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if self not in self.gate.waiting:
            return
        if self.conn.their_state is h11.SEND_BODY and self.flow.read_paused:  # the app has not taken the last
            self.arm(self.gate.timeout_s)  # piece yet: not the client's fault
        else:
            self.gate.drop(self)

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (a malformed request line, header or chunk, a head over 16 KiB): uvicorn's
        400, with the OpenAI error body every other error has, then the connection closes. When an answer has
        begun already (the bad bytes came after an early answer), the connection only closes."""
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            self.transport.close()
            return
        body = json.dumps(error_body(f"{msg.rstrip('.')}: it is not HTTP/1.1 this server can read (a malformed "
                                     "request line, header or chunk, or a head larger than 16 KiB).",
                                     "invalid_request_error", None, "invalid_http")).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def refuse(self) -> None:
        """Answer this connection's request, once its head arrives, with a 503 instead of the app."""
        self.app = _too_many_connections(self.gate.cap)


def _too_many_connections(cap: int) -> Any:
    body = error_body(f"The server has {cap} open connections, each carrying a request (its limit). Retry later.",
                      "unavailable_error", None, "too_many_connections")

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send_error(send, 503, body, [(b"retry-after", b"1"), (b"connection", b"close")])
    return app


def protocol_class(gate: Gate) -> type[GatedH11]:
    """uvicorn's ``http=``: GatedH11 bound to ``gate``."""
    return type("GatedH11", (GatedH11,), {"gate": gate})


class Throttle:
    """At most one message per kind and LOG_INTERVAL_S: the others of that kind are counted meanwhile."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.held: dict[str, int] = {}
        self.logged: dict[str, float] = {}

    def due(self, kind: str) -> int | None:
        """None: hold this message back; else log it, with the number held back since the last one of its kind."""
        now = time.monotonic()
        last = self.logged.get(kind)
        if last is not None and now - last < self.interval_s:
            self.held[kind] = self.held.get(kind, 0) + 1
            return None
        self.logged[kind] = now
        return self.held.pop(kind, 0)


def _more(held: int, interval_s: float) -> str:
    return f" ({held} more in the last {interval_s:g} s)" if held else ""


class OncePerInterval(logging.Filter):
    """A Throttle on the messages a client can make the server log once per connection or per failed accept:
    asyncio's "socket.accept() out of system resource" (with a traceback, up to ``backlog`` times per turn of the
    loop while files run out), uvicorn's warnings about a malformed request. What it lets through is one line."""

    PREFIXES = ("socket.accept() out of system resource", "Invalid HTTP request received",
                "Unsupported upgrade request", "No supported WebSocket library detected")

    def __init__(self) -> None:
        super().__init__()
        self.throttle = Throttle()

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        kind = next((p for p in self.PREFIXES if text.startswith(p)), None)
        if kind is None:
            return True
        held = self.throttle.due(kind)
        if held is None:
            return False
        exc = record.exc_info[1] if record.exc_info else None
        record.msg = kind + (f": {exc}" if exc is not None else "") + _more(held, self.throttle.interval_s)
        record.args, record.exc_info, record.exc_text = (), None, None
        return True


def serve(app: Any, sock: socket.socket, timeout_s: float, **config: Any) -> None:
    """Run ``app`` on the bound socket ``sock`` under a Gate (``timeout_s``: --timeout); ``config``: uvicorn.Config's
    other arguments."""
    gate = Gate(timeout_s, raise_file_limit())
    settings = uvicorn.Config(app, http=protocol_class(gate), ws="none", backlog=gate.backlog, **config)
    throttle = OncePerInterval()  # after uvicorn.Config, which sets its loggers up
    for name in ("asyncio", "uvicorn.error"):
        logging.getLogger(name).addFilter(throttle)
    uvicorn.Server(settings).run(sockets=[sock])
