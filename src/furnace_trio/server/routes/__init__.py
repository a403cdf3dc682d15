"""The routes, one module per API family, each with a ``register(app, state)``.

- :mod:`.service`: ``/health``, ``/metrics``, ``/openapi.json``, ``/v1/models``
- :mod:`.chat`: ``/v1/chat/completions`` (session turns included)
- :mod:`.completions`: ``/v1/completions``
- :mod:`.sessions`: ``/v1/sessions/<id>``
- :mod:`.responses`: ``/v1/responses`` and ``/v1/responses/<id>`` (``input_items`` too)
- :mod:`.tokenizer`: ``/tokenize``, ``/detokenize``, ``/tokenizer_info``
- :mod:`.status`: ``/status``
- :mod:`.admin`: ``/admin/reload``
- :mod:`.page`: ``/``, the chat page, and its files under ``/static/``
- :mod:`.docs`: ``/docs``, the API reference rendered from ``/openapi.json``

Everything under ``/v1`` and the tokenizer paths is behind the API key, when the server has
one; ``/status`` and ``/admin/...`` behind the admin key (else the API keys); ``/health``,
``/metrics``, ``/openapi.json``, ``/docs`` and the chat page are open.
"""

from __future__ import annotations

from quart import request
from quart_trio import QuartTrio

from furnace_trio.server.auth import check_admin_key, check_api_key
from furnace_trio.server.routes import (
    admin,
    chat,
    completions,
    docs,
    page,
    responses,
    service,
    sessions,
    status,
    tokenizer,
)
from furnace_trio.server.routes.admin import ADMIN_PREFIX
from furnace_trio.server.routes.status import STATUS_PATH
from furnace_trio.server.routes.tokenizer import TOKENIZER_PATHS
from furnace_trio.server.state import ServerState


def register_routes(app: QuartTrio, state: ServerState) -> None:
    """Check the API key before every protected route, then register every family."""

    @app.before_request
    async def authenticate() -> None:
        if request.path.startswith("/v1") or request.path in TOKENIZER_PATHS:
            check_api_key(state)
        elif request.path == STATUS_PATH or request.path.startswith(ADMIN_PREFIX):
            check_admin_key(state)

    families = (
        service,
        chat,
        completions,
        responses,
        sessions,
        tokenizer,
        status,
        admin,
        page,
        docs,
    )
    for family in families:
        family.register(app, state)
