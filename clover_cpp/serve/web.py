"""The web chat at ``GET /`` (docs/serve.md, "Web chat"), as llama-server serves its web UI there: a static page
(clover_cpp/serve/webui/: index.html, app.js, style.css; no build step, no CDN) that talks to the server's own
streaming ``/v1/chat/completions``. The page loads without an API key, as llama-server's does (``OPEN_PATHS``,
security.Guard); its API calls send one. ``--no-webui`` leaves these routes out: ``/`` is a 404 then."""

from __future__ import annotations

from importlib import resources
from typing import Any, Callable

from fastapi import FastAPI
from fastapi.responses import Response

# path -> (file in webui/, content type)
FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/webui/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/webui/style.css": ("style.css", "text/css; charset=utf-8"),
}
OPEN_PATHS = frozenset(FILES)

# The page runs only its own script and style and talks only to this server; the model's text is shown as text
HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
}


def read(name: str) -> bytes:
    """One of the page's files, from the installed package (a wheel carries them as package data)."""
    return (resources.files(__package__) / "webui" / name).read_bytes()


def add_routes(app: FastAPI) -> None:
    for path, (name, media_type) in FILES.items():
        app.add_api_route(path, _handler(read(name), media_type), methods=["GET"], include_in_schema=False)


def _handler(data: bytes, media_type: str) -> Callable[[], Any]:
    async def serve_file() -> Response:
        return Response(data, media_type=media_type, headers=HEADERS)
    return serve_file
