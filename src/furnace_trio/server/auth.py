"""Who the client is: the API key check, and the session owner its bearer token names.

A request presents one of the server's keys (:mod:`~furnace_trio.server.api_keys`: the
``FURNACE_API_KEY`` one and the config file's named ones), compared in constant time, and
is served under that key's name from then on (:func:`~furnace_trio.server.asgi.set_caller`),
within the key's ``max_concurrent``. The keys checked are those of the configuration the
request arrived under (:func:`~furnace_trio.server.asgi.request_config`). A session belongs
to the digest of the bearer token that opened it, even when the server checks no key, so
clients with different keys never see each other's sessions.
"""

from __future__ import annotations

from quart import request

from furnace_trio.engine.sessions import owner_of
from furnace_trio.server.api_keys import APIKey, accepted_keys, match_key
from furnace_trio.server.asgi import request_config, set_caller
from furnace_trio.server.errors import APIError
from furnace_trio.server.state import ServerState


def check_api_key(state: ServerState) -> None:
    """Refuse (401) a request without one of the server's keys, when it has any; serve it
    under the key's name (429 past the key's ``max_concurrent``)."""
    cfg = request_config(state)
    keys = accepted_keys(cfg.api_key, cfg.api_keys)
    if keys:
        set_caller(state, _check_bearer(keys))


def check_admin_key(state: ServerState) -> None:
    """The operator's routes (``/status``, ``/admin/...``): the admin key when the server
    has one, else any API key, else open like every other route."""
    cfg = request_config(state)
    if cfg.admin_key is not None:
        _check_bearer((APIKey("admin", cfg.admin_key),))
        return
    keys = accepted_keys(cfg.api_key, cfg.api_keys)
    if keys:
        _check_bearer(keys)


def _bearer() -> str:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _check_bearer(keys: tuple[APIKey, ...]) -> APIKey:
    found = match_key(keys, _bearer())
    if found is None:
        raise APIError(
            401,
            "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return found


def session_owner() -> str:
    """The session owner: the bearer token presented (digested), even when the server
    checks no key, so that clients with different keys never see each other's sessions."""
    token = _bearer()
    return owner_of(token or None)
