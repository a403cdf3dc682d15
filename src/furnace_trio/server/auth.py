"""Who the client is: the API key check, and the session owner its bearer token names.

The key is compared in constant time. A session belongs to the digest of the bearer token
that opened it, even when the server checks no key, so clients with different keys never
see each other's sessions.
"""

from __future__ import annotations

import hmac

from quart import request

from furnace_trio.engine.sessions import owner_of
from furnace_trio.server.errors import APIError
from furnace_trio.server.state import ServerState


def check_api_key(state: ServerState) -> None:
    cfg = state.config
    if cfg is not None and cfg.api_key is not None:
        _check_bearer(cfg.api_key)


def check_admin_key(state: ServerState) -> None:
    """The operator's routes (``/status``): the admin key when the server has one, else
    the API key, else open like every other route."""
    cfg = state.config
    key = None if cfg is None else cfg.admin_key or cfg.api_key
    if key is not None:
        _check_bearer(key)


def _check_bearer(key: str) -> None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    given = token.strip() if scheme.lower() == "bearer" else ""
    if not hmac.compare_digest(given.encode(), key.encode()):
        raise APIError(
            401,
            "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


def session_owner() -> str:
    """The session owner: the bearer token presented (digested), even when the server
    checks no key, so that clients with different keys never see each other's sessions."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    token = token.strip()
    return owner_of(token if scheme.lower() == "bearer" and token else None)
