"""``POST /admin/reload``: read the configuration again (see :mod:`furnace_trio.server.reload`).

Behind the admin key, or the API keys when there is no admin key (the check is in
:func:`furnace_trio.server.routes.register_routes`). It answers what changed, what needs a
restart and the new ``config_generation``; an invalid configuration is a 400 with OpenAI's
error object (``code`` ``invalid_config``) saying why, logged too, and nothing changes.
"""

from __future__ import annotations

import logging

from quart import Response
from quart_trio import QuartTrio

from furnace_trio.server.config import ConfigError
from furnace_trio.server.errors import APIError
from furnace_trio.server.reload import reload_config
from furnace_trio.server.sse import dumps
from furnace_trio.server.state import ServerState

ADMIN_PREFIX = "/admin/"
RELOAD_PATH = "/admin/reload"

logger = logging.getLogger(__name__)


def register(app: QuartTrio, state: ServerState) -> None:
    @app.post(RELOAD_PATH)
    async def reload() -> Response:
        try:
            result = await reload_config(app, state)
        except ConfigError as exc:
            logger.error("POST %s: the configuration was not reloaded: %s", RELOAD_PATH, exc)
            raise APIError(
                400,
                f"The configuration was not reloaded, nothing changed: {exc}",
                code="invalid_config",
            ) from None
        return Response(dumps(result.as_dict()), mimetype="application/json")
