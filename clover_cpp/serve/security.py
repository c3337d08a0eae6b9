"""The server's front door (docs/serve.md, "Security" and "Limits"): what a request may cost, who may send it, and
the ASGI middleware that checks the Host header, the API keys and the body size before any route runs."""

from __future__ import annotations

import hmac
import ipaddress
import json
from dataclasses import dataclass
from typing import Any, Callable

from .schema import error_body


@dataclass(frozen=True)
class Endpoints:
    """llama-server's switches for its monitoring endpoints (serve/monitor.py): ``--slots``/``--no-slots``,
    ``--metrics``, ``--props``."""

    slots: bool = True
    metrics: bool = False
    props: bool = False


@dataclass(frozen=True)
class Limits:
    """What one request may cost before the engine sees it (docs/serve.md, "Limits"); 0 = no limit."""

    max_body_bytes: int = 8 * 2**20      # --max-body-bytes: 413
    max_messages: int = 1024             # --max-messages: 400
    max_prompt_chars: int = 0            # --max-prompt-chars (0: 64 x n_ctx): 400, checked before tokenizing
    max_queue: int = 64                  # --max-queue: waiting jobs; 429 beyond
    template_timeout_s: float = 10.0     # --template-timeout: rendering + tokenizing one request
    prepare_threads: int = 2             # requests rendered/tokenized at once (more wait for a turn)


@dataclass(frozen=True)
class Security:
    """--api-key/--api-key-file, and the Host names a loopback-bound server answers (DNS rebinding)."""

    api_keys: tuple[str, ...] = ()
    allowed_hosts: frozenset[str] | None = None  # None: any Host header (not bound to loopback)
    open_paths: frozenset[str] = frozenset({"/health"})  # answered without a key (and the web chat's files)


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def loopback_hosts(host: str, port: int) -> frozenset[str] | None:
    """The Host headers a server bound to loopback answers: its names with the port (and without it on port
    80). A page on another site that rebinds its DNS name to 127.0.0.1 still sends its own name, and gets a 403.
    None (any Host) when the server is not bound to loopback."""
    if not is_loopback(host):
        return None
    names = set(LOOPBACK_NAMES) | {host.lower() if ":" not in host else f"[{host.strip('[]')}]"}
    return frozenset({f"{n}:{port}" for n in names} | (names if port == 80 else set()))


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


async def send_error(send: Callable[..., Any], status: int, body: dict[str, Any],
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """An error answer straight on the ASGI ``send`` (before or instead of the app): the JSON ``body``, with
    ``headers`` after the content type and length."""
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": data})


class Guard:
    """ASGI middleware in front of every route: the Host check (loopback binds), the API keys (every path
    but ``open_paths``: /health and the web chat's files), and the body size limit (413), before FastAPI reads or
    parses anything."""

    def __init__(self, app: Any, security: Security, max_body_bytes: int) -> None:
        self.app = app
        self.security = security
        self.max_body_bytes = max_body_bytes
        self._keys = [k.encode() for k in security.api_keys]

    def _key_ok(self, scope: dict[str, Any]) -> bool:
        auth = _header(scope, b"authorization") or ""
        scheme, _, token = auth.partition(" ")
        given = token.strip() if scheme.lower() == "bearer" else (_header(scope, b"x-api-key") or "")
        given_b = given.encode("latin-1", "replace")
        ok = False
        for key in self._keys:  # every key is compared, in constant time
            ok |= hmac.compare_digest(given_b, key)
        return ok

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        allowed = self.security.allowed_hosts
        host = _header(scope, b"host")
        if allowed is not None and host is not None and host.lower() not in allowed:
            await send_error(send, 403, error_body(
                f"Host '{host}' is not this server's: a server bound to loopback answers only "
                f"{', '.join(sorted(h for h in allowed if ':' in h))} (a DNS rebinding guard; bind another "
                "--host to serve other names)", "invalid_request_error", None, "forbidden_host"))
            return
        path = scope.get("path", "")
        if self._keys and path not in self.security.open_paths and not self._key_ok(scope):  # /v1/... and the rest
            await send_error(send, 401, error_body(
                "Invalid or missing API key: send 'Authorization: Bearer KEY' with one of the server's "
                "--api-key keys.", "invalid_request_error", None, "invalid_api_key"),
                [(b"www-authenticate", b'Bearer realm="clover-cpp"')])
            return
        limit = self.max_body_bytes
        if limit and scope.get("method") in ("POST", "PUT", "PATCH"):
            too_large = error_body(f"The request body exceeds {limit} bytes (the limit; start the server with "
                                   "--max-body-bytes to change it).", "invalid_request_error", None,
                                   "request_too_large")
            length = _header(scope, b"content-length")
            if length is not None and length.strip().isdigit() and int(length) > limit:
                await send_error(send, 413, too_large)
                return
            chunks, size = [], 0
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    break
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                if size > limit:
                    await send_error(send, 413, too_large)
                    return
                if not message.get("more_body", False):
                    break
            body = b"".join(chunks)
            replayed = False

            async def replay() -> dict[str, Any]:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            await self.app(scope, replay, send)
            return
        await self.app(scope, receive, send)
