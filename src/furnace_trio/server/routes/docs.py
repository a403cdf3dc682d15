"""``/docs``: the HTTP API reference as a page, rendered on the server from the OpenAPI
document (:mod:`furnace_trio.server.api_page`) once, when the routes are registered.

Open like ``/openapi.json``: it describes the API, it serves none of it. Self-contained (no
script, nothing from another origin), so it works on a server without a network.
"""

from __future__ import annotations

from quart import Response
from quart_trio import QuartTrio

from furnace_trio.server.api_page import CONTENT_SECURITY_POLICY, render_api_page
from furnace_trio.server.openapi import openapi_document
from furnace_trio.server.state import ServerState

DOCS_PATH = "/docs"
HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def register(app: QuartTrio, state: ServerState) -> None:
    page = render_api_page(openapi_document()).encode()

    @app.get(DOCS_PATH)
    async def api_docs() -> Response:
        return Response(page, content_type="text/html; charset=utf-8", headers=HEADERS)
