"""``/``: the chat page, and the few files it loads from ``/static/``.

The page (``server/webui/``: HTML, CSS and JavaScript, package data, no build step) talks
to the API like any client: ``/v1/models``, ``/v1/chat/completions`` streamed, and
``/v1/sessions/{id}`` for the conversation the server keeps. The files are read once, when
the routes are registered, and served from memory with a Content-Security-Policy that
allows nothing but this origin: no inline script, no other site, no frame around it. The
page writes model output as text only; the policy is the second line of defence, should
markup ever reach the DOM.

The page and its files are open (no API key): it asks for the key when the API answers
401, and keeps it in the tab's ``sessionStorage``.
"""

from __future__ import annotations

from importlib import resources

from quart import Response
from quart_trio import QuartTrio

from furnace_trio.server.errors import APIError
from furnace_trio.server.state import ServerState

#: Only this origin, for everything; nothing may frame the page, post a form or set a base.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'; "
    "object-src 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidate: a new version of the server brings new files
}
#: The files under ``/static/``, with their content types.
STATIC_FILES = {
    "chat.js": "text/javascript; charset=utf-8",
    "chat.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}
HTML = "text/html; charset=utf-8"


def _read(name: str) -> bytes:
    return resources.files("furnace_trio.server").joinpath("webui", name).read_bytes()


def register(app: QuartTrio, state: ServerState) -> None:
    index = _read("index.html")
    files = {name: (_read(name), mimetype) for name, mimetype in STATIC_FILES.items()}

    @app.get("/")
    async def chat_page() -> Response:
        return Response(index, content_type=HTML, headers=PAGE_HEADERS)

    @app.get("/static/<name>")
    async def static_file(name: str) -> Response:
        if name not in files:
            raise APIError(404, f"There is no file {name!r} here.", code="not_found")
        body, content_type = files[name]
        return Response(body, content_type=content_type, headers=PAGE_HEADERS)
