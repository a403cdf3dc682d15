"""``GET /status``: what the server is doing now, request by request (see
:mod:`furnace_trio.server.status`). Behind the admin key, or the API key when there is no
admin key (the check is in :func:`furnace_trio.server.routes.register_routes`).

It answers while the engine is dead or draining too (the engine's state says so): an
operator asks exactly then.
"""

from __future__ import annotations

from quart import Response
from quart_trio import QuartTrio

from furnace_trio.server.errors import APIError
from furnace_trio.server.sse import dumps
from furnace_trio.server.state import ServerState
from furnace_trio.server.status import status_body

STATUS_PATH = "/status"


def register(app: QuartTrio, state: ServerState) -> None:
    @app.get(STATUS_PATH)
    async def status() -> Response:
        backend = state.backend
        if backend is None:
            raise APIError(503, "The model is still loading.", code="unavailable")
        body = status_body(
            backend.engine.status(),
            model=backend.model_name,
            http_in_flight=state.in_flight,
            config_generation=state.config_generation,
            key_names=state.api_keys.request_names,
        )
        return Response(dumps(body), mimetype="application/json")
