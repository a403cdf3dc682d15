"""The quart-trio HTTP API: OpenAI-compatible endpoints over one engine.

:func:`create_app` puts the app together; each part is its own module:

- :mod:`~furnace_trio.server.state`: what the app knows about its backend
  (:class:`ServerState`), and whether it serves;
- :mod:`~furnace_trio.server.lifecycle`: loading the backend before serving, the engine's
  supervision, the drain and the stop;
- :mod:`~furnace_trio.server.asgi`: the ASGI wrapper that aborts a request's sequences
  when it ends and counts responses by status;
- :mod:`~furnace_trio.server.error_handlers`: every error as an OpenAI error object;
- :mod:`~furnace_trio.server.routes`: the routes, one module per API family, which hand
  requests to :mod:`~furnace_trio.server.generation`.

Importing this module loads nothing: the model loads when the app starts serving.
"""

from __future__ import annotations

from quart_trio import QuartTrio

from furnace_trio.server.asgi import AbortOnExit
from furnace_trio.server.config import ServerConfig
from furnace_trio.server.error_handlers import register_error_handlers
from furnace_trio.server.lifecycle import drain, drain_then, start_backend, stop_backend
from furnace_trio.server.request_guard import register as register_request_guard
from furnace_trio.server.routes import register_routes
from furnace_trio.server.state import STATE_KEY, BackendFactory, ServerState

__all__ = ["STATE_KEY", "ServerState", "app", "create_app", "drain", "drain_then"]


def create_app(
    config: ServerConfig | None = None, *, backend_factory: BackendFactory | None = None
) -> QuartTrio:
    """Build the app; nothing is loaded until it starts serving.

    ``config is None`` reads ``FURNACE_*`` variables when serving starts;
    ``backend_factory is None`` uses :func:`furnace_trio.server.backend.load_backend`.
    """
    app = QuartTrio(__name__)
    app.config["RESPONSE_TIMEOUT"] = 60
    state = ServerState(config=config, backend_factory=backend_factory)
    app.extensions[STATE_KEY] = state
    if config is not None:
        app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes
    app.asgi_app = AbortOnExit(app.asgi_app, state)  # type: ignore[method-assign]

    @app.before_serving
    async def start() -> None:
        await start_backend(app, state)

    @app.after_serving
    async def stop() -> None:
        await stop_backend(state)

    register_error_handlers(app)
    register_request_guard(app, state)  # before the routes' own checks (the API key)
    register_routes(app, state)
    return app


#: Served by ``hypercorn -c hypercorn.toml furnace_trio.app:app``; loads nothing at import.
app = create_app()
