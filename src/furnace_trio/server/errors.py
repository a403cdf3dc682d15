"""OpenAI error objects: ``{"error": {"message", "type", "param", "code"}}``.

Every error the HTTP layer returns goes through :class:`APIError`, so clients (the official
SDK included) see one shape whatever went wrong, and the status and headers (``Retry-After``,
``x-should-retry``, ``Allow``) travel with it. Plain data; no Quart import.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

_ERROR_TYPES: Mapping[int, str] = MappingProxyType(
    {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        405: "invalid_request_error",
        408: "timeout_error",
        409: "conflict_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        499: "cancelled_error",
        500: "server_error",
        503: "service_unavailable_error",
    }
)


def error_type_for(status: int) -> str:
    """The OpenAI ``type`` for an HTTP status (400 -> ``invalid_request_error``)."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "server_error" if status >= 500 else "invalid_request_error"


class APIError(Exception):
    """An error to send to the client as an OpenAI error object with ``status``.

    ``param`` names the offending request field (dotted path such as ``messages[1].role``)
    when one is to blame; ``headers`` are added to the response as they are.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or error_type_for(status)
        self.headers: Mapping[str, str] = MappingProxyType(dict(headers or {}))

    def body(self) -> dict[str, Any]:
        """The JSON body (also the payload of an SSE error event)."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.message!r}, param={self.param!r})"


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 ``invalid_request_error`` naming ``param``."""
    return APIError(400, message, param=param, code=code)
