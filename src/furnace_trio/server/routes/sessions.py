"""``/v1/sessions/<id>``: read and end a server-side session.

A session is a conversation the server keeps (its messages and its pinned KV blocks)
between chat turns; the turns themselves go through the chat route. Only the owner that
opened a session (:func:`~furnace_trio.server.auth.session_owner`) sees it.
"""

from __future__ import annotations

from quart import Response
from quart_trio import QuartTrio

from furnace_trio.engine.sessions import SessionBusy, SessionNotFound
from furnace_trio.server.auth import session_owner
from furnace_trio.server.errors import APIError
from furnace_trio.server.sse import dumps
from furnace_trio.server.state import ServerState


def session_not_found(session_id: str) -> APIError:
    return APIError(
        404, f"The session {session_id!r} does not exist.", param="session_id", code="not_found"
    )


def session_busy(exc: Exception) -> APIError:
    return APIError(
        409,
        f"{exc}; send the next turn once it has finished.",
        param="session_id",
        code="session_busy",
        headers={"x-should-retry": "false"},
    )


def register(app: QuartTrio, state: ServerState) -> None:
    @app.get("/v1/sessions/<session_id>")
    async def get_session(session_id: str) -> Response:
        backend = state.serving_backend()
        try:
            if state.shared is not None:  # the latest turn may have run on another replica
                await state.shared.sync(backend.engine, session_id, session_owner())
            session = backend.engine.get_session(session_id, session_owner())
        except SessionNotFound:
            raise session_not_found(session_id) from None
        body = {
            "id": session.session_id,
            "object": "session",
            "turns": session.turns,
            "messages": [dict(m) for m in session.messages],
            "cached_tokens": len(session.token_ids),
        }
        return Response(dumps(body), mimetype="application/json")

    @app.delete("/v1/sessions/<session_id>")
    async def delete_session(session_id: str) -> Response:
        backend = state.serving_backend()
        try:
            if state.shared is not None:
                await state.shared.delete(backend.engine, session_id, session_owner())
            else:
                backend.engine.delete_session(session_id, session_owner())
        except SessionNotFound:
            raise session_not_found(session_id) from None
        except SessionBusy as exc:
            raise session_busy(exc) from None
        body = {"id": session_id, "object": "session.deleted", "deleted": True}
        return Response(dumps(body), mimetype="application/json")
