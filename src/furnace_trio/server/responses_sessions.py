"""The Responses API on the engine's sessions; the only module of it that calls the
sessions API.

A stored response's conversation is a session (:mod:`~furnace_trio.engine.sessions`):
history, pinned KV and sampler state, owned by the API key that created it, one turn at a
time, expiring when idle. The first stored response of a conversation opens a session
named after itself; a response that continues the latest response of a session
(``previous_response_id``) is that session's next turn, so only its new input computes,
and a second continuation while one runs is a 409. Continuing an older response (a branch)
starts a new session from the conversation up to it; its prefix is still found in the
prefix cache when the blocks are. ``store: false`` runs no turn and keeps nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from furnace_trio.engine.sessions import SessionBusy, SessionNotFound, Turn, TurnState
from furnace_trio.server.errors import APIError, invalid_request
from furnace_trio.server.responses_store import StoredResponse

if TYPE_CHECKING:
    from furnace_trio.engine import Engine


@dataclass(frozen=True, slots=True)
class Conversation:
    """What a response renders (the conversation before it, then its input) and the
    session turn it runs as (``None``: nothing is kept)."""

    messages: tuple[Mapping[str, Any], ...]
    turn: Turn | None


@dataclass(frozen=True, slots=True)
class Position:
    """Where a committed response stands in its session: after ``turns`` turns and
    ``messages`` messages."""

    session_id: str
    turns: int
    messages: int


def open_conversation(
    engine: Engine,
    owner: str,
    previous: StoredResponse | None,
    new_messages: tuple[Mapping[str, Any], ...],
    *,
    store: bool,
    session_id: str,
) -> Conversation:
    """The conversation of a new response; ``session_id`` names a session it opens.
    The caller must :func:`close` a returned turn (the request stream does, once it exists).
    """
    history: tuple[Mapping[str, Any], ...] = ()
    if previous is not None:
        if previous.session_id is None:
            raise invalid_request(
                f"The response {previous.response_id!r} did not complete; it cannot be continued.",
                "previous_response_id",
            )
        try:
            session = engine.get_session(previous.session_id, owner)
        except SessionNotFound:
            raise _expired(previous.response_id) from None
        if store and session.turns == previous.turns:
            return _begin(engine, previous.session_id, owner, new_messages)
        history = tuple(session.messages[: previous.messages])
    if not store:
        return Conversation((*history, *new_messages), None)
    return _begin(engine, session_id, owner, (*history, *new_messages))


def settle(turn: Turn) -> Position | None:
    """The turn's request finished: say where the session stands. The generation path
    committed the reply when its sample finished (``response_body.commit_turn``, the
    reply as the client received it); ``None`` when nothing was committed (a failure)."""
    if turn.state is not TurnState.COMMITTED:
        return None
    session = turn.session
    return Position(session.session_id, session.turns, len(session.messages))


def close(engine: Engine, turn: Turn) -> None:
    """End a turn that no request stream owns (idempotent)."""
    engine.end_turn(turn)


def release(engine: Engine, session_id: str, owner: str) -> None:
    """Forget a session no stored response refers to any more (its KV is unpinned). One
    with a turn in flight stays: that turn's response will refer to it."""
    with contextlib.suppress(SessionNotFound, SessionBusy):
        engine.delete_session(session_id, owner)


def _begin(
    engine: Engine, session_id: str, owner: str, messages: tuple[Mapping[str, Any], ...]
) -> Conversation:
    try:
        turn = engine.begin_turn(session_id, owner, messages)
    except SessionBusy:
        raise conversation_busy() from None
    except SessionNotFound:  # another owner's session of that name
        raise _expired(session_id) from None
    return Conversation(tuple(turn.prompt_messages), turn)


def conversation_busy() -> APIError:
    return APIError(
        409,
        "Another response continuing this conversation is still being generated; "
        "continue from it once it has finished.",
        param="previous_response_id",
        code="conversation_busy",
        headers={"x-should-retry": "false"},
    )


def _expired(response_id: str) -> APIError:
    return APIError(
        404,
        f"The conversation of response {response_id!r} has expired or was deleted.",
        param="previous_response_id",
        code="not_found",
    )
