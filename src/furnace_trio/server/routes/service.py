"""What the server says about itself: ``/health``, ``/metrics``, ``/openapi.json`` and the
model list (``/v1/models``).

``/health`` answers 503 while the engine is down or the server drains, so a load balancer
stops routing here; ``/metrics`` answers whatever the engine's state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from quart import Response
from quart_trio import QuartTrio

from furnace_trio.server.api_keys import accepted_keys, render_key_metrics
from furnace_trio.server.errors import APIError
from furnace_trio.server.metrics import render_config_generation, render_metrics
from furnace_trio.server.openapi import openapi_document
from furnace_trio.server.routes.common import check_model, config_of
from furnace_trio.server.sse import dumps
from furnace_trio.server.state import ServerState
from furnace_trio.server.tool_stream import render_fallback_metrics

if TYPE_CHECKING:
    from furnace_trio.server.backend import Backend


def register(app: QuartTrio, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> tuple[dict[str, Any], int]:
        try:
            backend = state.serving_backend()
        except APIError as error:
            return {"status": "unavailable", "error": error.message}, 503
        return {"status": "ok", "model": backend.model_name}, 200

    @app.get("/metrics")
    async def metrics() -> Response:
        backend = state.backend
        stats = backend.engine.statistics() if backend is not None else None
        text = render_metrics(stats, state.http_responses, engine_up=state.engine_running)
        text += render_fallback_metrics(state.tool_call_fallbacks)
        cfg = config_of(state)
        names = (key.name for key in accepted_keys(cfg.api_key, cfg.api_keys))
        text += render_key_metrics(state.api_keys, names)
        text += render_config_generation(state.config_generation)
        return Response(text, mimetype="text/plain; version=0.0.4")

    openapi_body = dumps(openapi_document())  # built from the validator's own field tables

    @app.get("/openapi.json")
    async def openapi() -> Response:
        return Response(openapi_body, mimetype="application/json")

    def model_card(backend: Backend) -> dict[str, Any]:
        return {
            "id": backend.model_name,
            "object": "model",
            "created": state.started,
            "owned_by": "furnace-trio",
            "max_model_len": backend.max_context,
            # What a request that leaves these unset gets (docs/api-guide.md, output length).
            "max_output_tokens": config_of(state).max_output_tokens,
            "generation_defaults": backend.generation.as_dict(),
        }

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        backend = state.serving_backend()
        return {"object": "list", "data": [model_card(backend)]}

    @app.get("/v1/models/<path:model_id>")
    async def get_model(model_id: str) -> dict[str, Any]:
        backend = state.serving_backend()
        check_model(backend, model_id)
        return model_card(backend)
