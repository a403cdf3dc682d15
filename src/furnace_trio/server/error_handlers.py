"""The app's error handlers: every error leaves as an OpenAI error object.

:class:`~furnace_trio.server.errors.APIError` carries its status and headers; Quart's own
HTTP errors (404, 405 with its ``Allow`` header, 413) and unexpected exceptions (a 500 that
says nothing of the server's internals) are turned into one.
"""

from __future__ import annotations

import logging

from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from furnace_trio.server.errors import APIError
from furnace_trio.server.sse import dumps

logger = logging.getLogger(__name__)


def _error_response(error: APIError) -> Response:
    response = Response(dumps(error.body()), status=error.status, mimetype="application/json")
    for name, value in error.headers.items():
        response.headers[name] = value
    return response


def register_error_handlers(app: QuartTrio) -> None:
    @app.errorhandler(APIError)
    async def api_error(error: APIError) -> Response:
        logger.info("%s %s -> %d: %s", request.method, request.path, error.status, error.message)
        return _error_response(error)

    @app.errorhandler(HTTPException)
    async def http_error(error: HTTPException) -> Response:
        status = error.code or 500
        headers = {
            name: value
            for name, value in error.get_headers()
            if name.lower() not in ("content-type", "content-length")
        }
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(status)
        message = error.description or error.name
        if status == 413:
            message = "The request body is larger than the server accepts."
        return _error_response(APIError(status, message, code=code, headers=headers))

    @app.errorhandler(Exception)
    async def unexpected_error(error: Exception) -> Response:
        logger.exception("unexpected error in %s %s", request.method, request.path)
        return _error_response(APIError(500, "The server had an internal error.", code=None))
