"""``/v1/responses``: OpenAI's Responses API over the chat path and the sessions.

``POST`` validates the body (:mod:`~furnace_trio.server.responses_request`), finds the
conversation it continues (:mod:`~furnace_trio.server.responses_sessions`), renders it as a
chat request and generates through the chat path (tools, grammars, sessions, aborts);
:mod:`~furnace_trio.server.responses_events` shapes the output. A stored response is kept
in a :class:`~furnace_trio.server.responses_store.ResponseStore`, which ``GET``,
``DELETE`` and ``input_items`` read.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio
from quart import Response, request
from quart_trio import QuartTrio

from furnace_trio.engine import Failed, Finished
from furnace_trio.engine.sessions import SessionBusy, SessionNotFound
from furnace_trio.server.auth import session_owner
from furnace_trio.server.errors import APIError, invalid_request
from furnace_trio.server.generation import Started, collect, start_generation
from furnace_trio.server.response_body import failure_error, fold_event
from furnace_trio.server.responses_events import Event, ResponseEvents, sse_frame
from furnace_trio.server.responses_object import ResponseObject, new_response_id
from furnace_trio.server.responses_request import ResponsesRequest, parse_responses_request
from furnace_trio.server.responses_schemas import MAX_LIST_LIMIT
from furnace_trio.server.responses_sessions import (
    Conversation,
    Position,
    close,
    conversation_busy,
    open_conversation,
)
from furnace_trio.server.responses_sessions import release as release_session
from furnace_trio.server.responses_sessions import settle as settle_turn
from furnace_trio.server.responses_store import ResponseNotFound, ResponseStore, StoredResponse
from furnace_trio.server.routes.chat import prepare_chat
from furnace_trio.server.routes.common import read_generation
from furnace_trio.server.sse import SSE_HEADERS, dumps
from furnace_trio.server.state import ServerState

if TYPE_CHECKING:
    from furnace_trio.engine.sessions import Turn
    from furnace_trio.server.backend import Backend
    from furnace_trio.server.shared_sessions import SharedSessions

logger = logging.getLogger(__name__)


def register(app: QuartTrio, state: ServerState) -> None:
    stores = _Stores()

    @app.post("/v1/responses")
    async def create_response() -> Response:
        backend, parsed = await read_generation(state, parse_responses_request)
        run = await _start(state, backend, stores.get(backend), parsed)
        if parsed.stream:
            response = Response(_stream(run), mimetype="text/event-stream", headers=SSE_HEADERS)
            response.timeout = None  # RESPONSE_TIMEOUT would silently cut a long stream
        else:
            await collect(run.started, run.feed)
            run.finish()
            await run.share()
            response = _json(run.response.body())
        if run.turn is not None:  # the routing key a proxy's session affinity hashes on
            response.headers["X-Session-Id"] = run.turn.session_id
        return response

    @app.get("/v1/responses/<response_id>")
    async def get_response(response_id: str) -> Response:
        backend = state.serving_backend()
        return _json(dict((await _find(state, stores.get(backend), response_id)).body))

    @app.delete("/v1/responses/<response_id>")
    async def delete_response(response_id: str) -> Response:
        backend = state.serving_backend()
        store = stores.get(backend)
        owner = session_owner()
        await _find(state, store, response_id)  # from the shared store if not here
        record = store.delete(response_id, owner, trio.current_time())
        if state.shared is not None:
            await state.shared.delete_response(response_id)
        if record.session_id is not None and not store.references(record.session_id):
            release_session(backend.engine, record.session_id, owner)
        return _json({"id": response_id, "object": "response.deleted", "deleted": True})

    @app.get("/v1/responses/<response_id>/input_items")
    async def list_input_items(response_id: str) -> Response:
        backend = state.serving_backend()
        items = list((await _find(state, stores.get(backend), response_id)).input_items)
        return _json(_item_page(items))


@dataclass(slots=True)
class _Stores:
    """The app's response store, made once the backend is known (its sessions' TTL and
    count bound the records too)."""

    store: ResponseStore | None = None

    def get(self, backend: Backend) -> ResponseStore:
        if self.store is None:
            sessions = backend.engine.sessions
            self.store = ResponseStore(ttl_s=sessions.ttl_s, max_records=sessions.max_sessions)
        return self.store


@dataclass(slots=True)
class _Run:
    """One response being generated: its engine request, its output, and what to keep of
    it once it finishes."""

    backend: Backend
    store: ResponseStore
    owner: str
    parsed: ResponsesRequest
    started: Started
    events: ResponseEvents
    turn: Turn | None
    calls: frozenset[str]
    shared: SharedSessions | None = None
    position: Position | None = None
    kept: StoredResponse | None = None

    @property
    def response(self) -> ResponseObject:
        return self.events.response

    def feed(self, event: object) -> list[Event]:
        """One generation event (folded into the collector already) as stream events; its
        ``Finished`` settles the session turn."""
        out = self.events.feed(event)
        if isinstance(event, Finished) and self.turn is not None:
            self.position = settle_turn(self.turn)
        return out

    def finish(self) -> list[Event]:
        out = self.events.finish(self.started.collector)
        self._keep()
        return out

    def fail(self, error: APIError) -> list[Event]:
        out = self.events.fail(error.code or "server_error", error.message)
        self.position = None
        self._keep()
        return out

    def _keep(self) -> None:
        if not self.parsed.store:
            return
        position = self.position
        record = StoredResponse(
            response_id=self.response.id,
            owner=self.owner,
            body=self.response.body(),
            input_items=self.parsed.input.items,
            session_id=position.session_id if position is not None else None,
            turns=position.turns if position is not None else 0,
            messages=position.messages if position is not None else 0,
            calls=self.calls | self.response.call_ids(),
            last_used=0.0,
        )
        self.store.put(record, trio.current_time())
        self.kept = record

    async def share(self) -> None:
        """With a shared store: save the session's history and the stored response there
        before the client sees the end, so the next turn may go to any replica."""
        if self.shared is None:
            return
        if self.turn is not None:
            await self.shared.finish(self.turn)
        if self.kept is not None:
            await self.shared.put_response(self.kept)


async def _start(
    state: ServerState, backend: Backend, store: ResponseStore, parsed: ResponsesRequest
) -> _Run:
    """Find the conversation, render it, submit it. Until the request stream exists, a
    session turn begun here is ended here on the way out."""
    owner = session_owner()
    previous = None
    if parsed.previous_response_id is not None:
        previous = await _find(state, store, parsed.previous_response_id, "previous_response_id")
    calls = parsed.input.calls | (previous.calls if previous is not None else frozenset())
    for index, call_id in parsed.input.outputs:
        if call_id not in calls:
            raise invalid_request(
                f"No function call with call_id {call_id!r} precedes this function_call_output.",
                f"input[{index}].call_id",
            )
    response_id = new_response_id()
    shared = state.shared
    if shared is None:
        conversation = open_conversation(
            backend.engine,
            owner,
            previous,
            parsed.input.messages,
            store=parsed.store,
            session_id=response_id,
        )
    else:
        conversation = await _open_shared(shared, backend, owner, previous, parsed, response_id)
    turn = conversation.turn
    try:
        chat = parsed.chat_request(conversation.messages)
        try:
            prepared = await prepare_chat(state, backend, chat, turn)
        except APIError as exc:
            raise _renamed(exc) from None
        started = start_generation(
            backend,
            "chat",
            chat,
            (prepared.prompt_ids,),
            "input",
            prepared.tool_stream,
            prepared.constraint,
            turn=turn,
            request_id=response_id,
        )
    except BaseException:
        if turn is not None:
            close(backend.engine, turn)
        raise
    events = ResponseEvents(ResponseObject(response_id, backend.model_name, parsed))
    return _Run(backend, store, owner, parsed, started, events, turn, calls, shared)


async def _open_shared(
    shared: SharedSessions,
    backend: Backend,
    owner: str,
    previous: StoredResponse | None,
    parsed: ResponsesRequest,
    response_id: str,
) -> Conversation:
    """:func:`open_conversation` with the conversation's session locked and synced from
    the shared store (its latest turn may have run on another replica)."""
    engine = backend.engine
    token = None
    locked = previous.session_id if previous is not None else None
    try:
        if locked is not None:
            try:
                token = await shared.lock(locked)
            except SessionBusy:
                raise conversation_busy() from None
            with contextlib.suppress(SessionNotFound):  # open_conversation says 404
                await shared.sync(engine, locked, owner)
        conversation = open_conversation(
            engine,
            owner,
            previous,
            parsed.input.messages,
            store=parsed.store,
            session_id=response_id,
        )
    except BaseException:
        if locked is not None and token is not None:
            with trio.CancelScope(shield=True):
                await shared.unlock(locked, token)
        raise
    turn = conversation.turn
    if locked is not None and token is not None and (turn is None or turn.session_id != locked):
        await shared.unlock(locked, token)
        token = None
    if turn is not None:
        try:
            if token is None:  # a new session, named after this response: nobody else has it
                token = await shared.lock(turn.session_id)
        except BaseException:
            close(engine, turn)
            raise
        shared.hold(turn, token)
    return conversation


async def _stream(run: _Run) -> AsyncIterator[bytes]:
    """The SSE body; ``finally`` aborts (sync, idempotent) however the generator ends."""
    started = run.started
    timing, collector = started.timing, started.collector
    try:
        for event in run.events.start():
            yield sse_frame(event)
        async for engine_event in started.stream:
            timing.observe(engine_event)
            for translated in started.translate(engine_event):
                if isinstance(translated, Failed):
                    error = failure_error(translated)
                    timing.status = error.status
                    failed = run.fail(error)
                    await run.share()
                    for event in failed:
                        yield sse_frame(event)
                    return
                fold_event(translated, collector, timing)
                for event in run.feed(translated):
                    yield sse_frame(event)
        finished = run.finish()
        await run.share()
        for event in finished:
            yield sse_frame(event)
    except Exception as exc:
        timing.status = 500
        logger.exception("response %s failed", run.response.id)
        yield sse_frame(run.events.error("server_error", f"The stream failed: {exc}"))
    except BaseException:
        if timing.status == 200:
            timing.status = 499  # cancelled: the client went away
        raise
    finally:
        started.stream.close()
        timing.log(collector)


def _renamed(exc: APIError) -> APIError:
    """A chat-path error naming the chat field that the Responses field became."""
    param = {"messages": "input", "response_format": "text.format"}.get(exc.param or "")
    if param is None:
        return exc
    return APIError(
        exc.status,
        exc.message,
        param=param,
        code=exc.code,
        error_type=exc.error_type,
        headers=exc.headers,
    )


async def _find(
    state: ServerState, store: ResponseStore, response_id: str, param: str = "response_id"
) -> StoredResponse:
    """The stored response, from this replica's store or else the shared one."""
    owner = session_owner()
    try:
        return store.get(response_id, owner, trio.current_time())
    except ResponseNotFound:
        if state.shared is None:
            raise _not_found(response_id, param) from None
    record = await state.shared.get_response(response_id)
    if record is None or record.owner != owner:
        raise _not_found(response_id, param)
    store.put(record, trio.current_time())
    return record


def _not_found(response_id: str, param: str = "response_id") -> APIError:
    return APIError(
        404, f"No response with id {response_id!r} is stored here.", param=param, code="not_found"
    )


def _item_page(items: list[Any]) -> dict[str, Any]:
    """One page of ``input_items`` by the ``limit``, ``order`` and ``after`` query."""
    args = request.args
    limit_text = args.get("limit", "20")
    if not limit_text.isdigit() or not 1 <= int(limit_text) <= MAX_LIST_LIMIT:
        raise invalid_request(f"limit must be an integer from 1 to {MAX_LIST_LIMIT}", "limit")
    order = args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid_request("order must be 'asc' or 'desc'", "order")
    if order == "desc":
        items.reverse()
    after = args.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise invalid_request(f"after names no input item of this response: {after!r}", "after")
        items = items[ids.index(after) + 1 :]
    page = items[: int(limit_text)]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > len(page),
    }


def _json(body: dict[str, Any]) -> Response:
    return Response(dumps(body), mimetype="application/json")
