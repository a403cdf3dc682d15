"""The ASGI wrapper around the whole app: :class:`AbortOnExit`.

Each generation registers its request id in the ASGI scope (:func:`register_abort`). The
handler's ``finally`` aborts it (sync, idempotent); the wrapper aborts every registered id
again on the way out, which covers a client that leaves after the handler returned a
streaming response but before its body generator started (its ``finally`` then never
runs). The wrapper also counts responses by status for ``/metrics``, counts the HTTP
requests in flight for the drain, holds back a response that would start before its
request's body has arrived (:func:`_after_the_body`), and makes sure connections that must
close do close (below).

It also fixes each request's settings: the configuration in force when the request arrives
(:func:`request_config`) is the one every check of that request uses to its end, whatever a
reload (:mod:`~furnace_trio.server.reload`) changes meanwhile; and it keeps the per-key
account (:class:`~furnace_trio.server.api_keys.KeyUsage`) of the key the request was
served under (:func:`set_caller`). About connections:

- The last message of a response is sent shielded from cancellation. Hypercorn 0.18's
  Trio worker runs the end of a response (closing a ``Connection: close`` or HTTP/1.0
  connection, or starting the keep-alive idle timer) inside that send, in the request's
  task; quart-trio cancels that task as soon as hypercorn reports the response done, so
  without the shield the close and the idle timer never happen and the connection stays
  open for good.
- A request with both ``Content-Length`` and ``Transfer-Encoding`` (h11 frames it by
  ``Transfer-Encoding``) is answered with ``connection: close``: RFC 9112 section 6.3
  says to close after responding, since the two framings hint at request smuggling.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio
from quart import current_app, request

from furnace_trio.server.api_keys import APIKey
from furnace_trio.server.config import ServerConfig
from furnace_trio.server.state import STATE_KEY, ServerState

if TYPE_CHECKING:
    from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, HTTPScope, Scope

SCOPE_KEY = "furnace_trio.request_ids"
#: The request's configuration (see :func:`request_config`) and its API key.
SETTINGS_KEY = "furnace_trio.settings"
CALLER_KEY = "furnace_trio.api_key"
IN_FLIGHT_KEY = "furnace_trio.key_in_flight"  # counted in its key's requests in flight

#: How long a response that starts before its request's body waits for it (see
#: :func:`_after_the_body`); :attr:`AbortOnExit.body_wait_s` holds the app's own.
BODY_WAIT_S = 2.0


def _ambiguous_framing(scope: HTTPScope) -> bool:
    """Both ``Content-Length`` and ``Transfer-Encoding``: close after the response."""
    names = {name.lower() for name, _ in scope["headers"]}
    return b"content-length" in names and b"transfer-encoding" in names


def _with_close(message: Any) -> Any:
    headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
    return {**message, "headers": [*headers, (b"connection", b"close")]}


async def _after_the_body(
    message: Any, status: int, body_received: trio.Event, body_wait_s: float
) -> Any:
    """A response that starts before its request's body has arrived (a 404, 405 or 401
    answered from the headers alone, while the client is still sending the body): wait a
    moment for the body, then answer. A connection whose request body was still coming
    in when the response ended is left stuck by hypercorn 0.18's HTTP/1.1 protocol: the
    next request on it gets no answer. If the body does not arrive in ``body_wait_s``
    (or is refused as too large, 413), the response says ``connection: close`` instead,
    and the client opens a new connection for its next request."""
    if status != 413:
        with trio.move_on_after(body_wait_s):
            await body_received.wait()
    if body_received.is_set():
        return message
    return _with_close(message)


class AbortOnExit:
    """ASGI wrapper: count responses by status, start none before the request's body has
    arrived (:func:`_after_the_body`), let connections close (see the module docstring),
    and abort a request's sequences when it ends.

    Aborting is idempotent and synchronous, so doing it for every registered id after the
    inner app returns (normally, by cancellation or by an exception) is always safe.
    ``body_wait_s`` bounds the wait for a body that a response would start before.
    """

    def __init__(
        self, inner: Callable[..., Any], state: ServerState, *, body_wait_s: float = BODY_WAIT_S
    ) -> None:
        self.inner = inner
        self.state = state
        self.body_wait_s = body_wait_s

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] != "http":
            await self.inner(scope, receive, send)
            return
        request_ids: list[str] = []
        scope[SCOPE_KEY] = request_ids  # type: ignore[literal-required]
        body_received = trio.Event()
        must_close = _ambiguous_framing(scope)

        async def watching_receive() -> Any:
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                body_received.set()
            return message

        async def counting_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                status = int(message["status"])
                self.state.http_responses[status] += 1
                caller: APIKey | None = scope.get(CALLER_KEY)  # type: ignore[assignment]
                if caller is not None:
                    self.state.api_keys.responses[caller.name, status] += 1
                if must_close:
                    message = _with_close(message)
                if not body_received.is_set():
                    message = await _after_the_body(
                        message, status, body_received, self.body_wait_s
                    )
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                with trio.CancelScope(shield=True):  # see the module docstring
                    await send(message)
                return
            await send(message)

        state = self.state
        scope[SETTINGS_KEY] = state.config  # type: ignore[literal-required]
        if state.in_flight == 0:
            state.no_requests = trio.Event()
        state.in_flight += 1
        try:
            await self.inner(scope, watching_receive, counting_send)
        finally:
            state.in_flight -= 1
            if state.in_flight == 0:
                state.no_requests.set()
            counted: APIKey | None = scope.get(CALLER_KEY)  # type: ignore[assignment]
            if counted is not None and scope.get(IN_FLIGHT_KEY):
                state.api_keys.leave(counted.name)
            backend = self.state.backend
            for request_id in request_ids:
                state.api_keys.request_names.pop(request_id, None)
                if backend is not None:
                    backend.engine.abort(request_id)


def register_abort(request_id: str) -> None:
    """Have :class:`AbortOnExit` abort ``request_id`` when the current request ends (and
    note the key name it is served under until then, for ``/status``)."""
    request.scope[SCOPE_KEY].append(request_id)  # type: ignore[literal-required]
    caller = request_caller()
    if caller is not None:
        state: ServerState = current_app.extensions[STATE_KEY]
        state.api_keys.request_names[request_id] = caller.name


def request_config(state: ServerState) -> ServerConfig:
    """The configuration the current request arrived under (the defaults before startup)."""
    config: ServerConfig | None = request.scope.get(SETTINGS_KEY) or state.config  # type: ignore[assignment]
    return config if config is not None else ServerConfig()


def set_caller(state: ServerState, key: APIKey) -> None:
    """The current request is served under ``key``: count it in flight until it ends (or
    raise the 429 of the key's ``max_concurrent``)."""
    request.scope[CALLER_KEY] = key  # type: ignore[literal-required]
    state.api_keys.enter(key)
    request.scope[IN_FLIGHT_KEY] = True  # type: ignore[literal-required]


def request_caller() -> APIKey | None:
    """The API key the current request presented, ``None`` on a server without keys."""
    caller: APIKey | None = request.scope.get(CALLER_KEY)  # type: ignore[assignment]
    return caller
