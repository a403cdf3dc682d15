"""``POST /v1/chat/completions``: render the conversation, set up tool-call parsing and
any grammar, then generate; a session turn renders the session's history with it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import trio
from quart import Response, request
from quart_trio import QuartTrio

from furnace_trio.core.params import TokenConstraint
from furnace_trio.engine.sessions import SessionBusy, SessionNotFound, Turn
from furnace_trio.server.auth import session_owner
from furnace_trio.server.chat_prompt import render_chat
from furnace_trio.server.chat_request import ChatRequest, parse_chat_request
from furnace_trio.server.errors import invalid_request
from furnace_trio.server.generation import generate
from furnace_trio.server.response_body import OnCommit
from furnace_trio.server.routes.common import config_of, read_generation
from furnace_trio.server.routes.sessions import session_busy, session_not_found
from furnace_trio.server.sse import dumps
from furnace_trio.server.state import ServerState
from furnace_trio.server.tool_stream import ToolCallStream
from furnace_trio.tools.grammar import GrammarCompiler, GrammarError
from furnace_trio.tools.tool_prompt import tool_call_format

if TYPE_CHECKING:
    from furnace_trio.server.backend import Backend

logger = logging.getLogger(__name__)


def register(app: QuartTrio, state: ServerState) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        config = config_of(state)
        parse = partial(
            parse_chat_request,
            max_schema_nodes=config.max_schema_nodes,
            max_sequences=config.sequences_per_request,
        )
        backend, parsed = await read_generation(state, parse)
        session_id = _session_id(parsed)
        if session_id is not None:
            return await _session_chat(state, backend, parsed, session_id)
        return await _chat(state, backend, parsed)


def _session_id(parsed: ChatRequest) -> str | None:
    """``session_id`` from the body (``extra_body`` in the SDK; checked by the protocol) or
    the ``X-Session-Id`` header; when both are given they must agree."""
    header = request.headers.get("X-Session-Id")
    value = parsed.session_id
    if header is not None and not 1 <= len(header) <= 256:
        raise invalid_request("X-Session-Id must have 1 to 256 characters", "session_id")
    if value is not None and header is not None and value != header:
        raise invalid_request("session_id and X-Session-Id differ", "session_id")
    return value if value is not None else header


async def _chat(
    state: ServerState,
    backend: Backend,
    parsed: ChatRequest,
    turn: Turn | None = None,
    on_commit: OnCommit | None = None,
) -> Response:
    """Render, tokenize, set up tool parsing and any grammar, then generate."""
    prepared = await prepare_chat(state, backend, parsed, turn)
    return await generate(
        backend,
        "chat",
        parsed,
        (prepared.prompt_ids,),
        "messages",
        prepared.tool_stream,
        constraint=prepared.constraint,
        turn=turn,
        on_commit=on_commit,
    )


@dataclass(frozen=True, slots=True)
class PreparedChat:
    """A chat request made ready for the engine: its prompt, the grammar that constrains
    its output (if any), and how to parse its output for tool calls (None: plain text)."""

    prompt_ids: tuple[int, ...]
    constraint: TokenConstraint | None
    tool_stream: Callable[[str, int], ToolCallStream] | None


async def prepare_chat(
    state: ServerState, backend: Backend, parsed: ChatRequest, turn: Turn | None = None
) -> PreparedChat:
    """Render and tokenize the conversation (a session ``turn``'s history as its exact
    token ids), compile any grammar (both in worker threads), and choose the tool-call
    parser: what every chat-shaped endpoint does before it generates."""
    forced = _grammar_forces_calls(state, backend, parsed)
    prompt_ids = await trio.to_thread.run_sync(
        functools.partial(render_chat, backend, parsed, turn, instruct=not forced)
    )
    constraint = None
    calls_forced = parsed.tool_choice in ("required", "function")
    if parsed.response_format is not None or calls_forced:
        if state.grammar is None:
            state.grammar = backend.grammar or GrammarCompiler(backend.tokenizer)
        constraint = await state.off_loop.compile(
            partial(_constraint, state, backend, parsed),
            "tools" if calls_forced else "response_format",
        )
    return PreparedChat(prompt_ids, constraint, _tool_stream(state, backend, parsed))


async def _session_chat(
    state: ServerState, backend: Backend, parsed: ChatRequest, session_id: str
) -> Response:
    """A session turn: its history plus the new messages, rendered whole, the history as the
    model generated it; the prompt starts with the exact token ids the session's pinned
    blocks hold (:meth:`Turn.encode_prompt`), so only the new input computes. The response
    commits the turn's reply once it is complete, and the request stream ends the turn when
    closed; until the stream exists, ending it on the way out is ours."""
    engine = backend.engine
    shared = state.shared
    try:
        if shared is None:
            turn = engine.begin_turn(session_id, session_owner(), parsed.messages)
        else:  # another replica may have the latest history; its lock says who runs a turn
            turn = await shared.begin_turn(engine, session_id, session_owner(), parsed.messages)
    except SessionNotFound:
        raise session_not_found(session_id) from None
    except SessionBusy as exc:
        raise session_busy(exc) from None
    except ValueError as exc:
        raise invalid_request(str(exc), "session_id") from None
    try:
        full = dataclasses.replace(parsed, messages=tuple(turn.prompt_messages))
        on_commit = None if shared is None else functools.partial(shared.finish, turn)
        response = await _chat(state, backend, full, turn, on_commit)
    except BaseException:
        engine.end_turn(turn)
        raise
    response.headers["X-Session-Id"] = session_id
    if not parsed.stream:
        body = json.loads(await response.get_data(as_text=False))
        body["session_id"] = session_id
        response.set_data(dumps(body))
    return response


def _tool_stream(
    state: ServerState, backend: Backend, parsed: ChatRequest
) -> Callable[[str, int], ToolCallStream] | None:
    """How to parse this request's output for tool calls (None: plain content)."""
    if parsed.tool_choice == "none" or not parsed.tools:
        return None
    configured = config_of(state).tool_parser
    fmt = tool_call_format(configured, backend.tokenizer.chat_template)

    def make(request_id: str, n: int) -> ToolCallStream:
        return ToolCallStream(
            request_id,
            n,
            fmt,
            parsed.tool_schemas,
            parallel=parsed.parallel_tool_calls,
            fallbacks=state.tool_call_fallbacks,
            drop_repeats=parsed.tool_choice in ("required", "function"),
        )

    return make


def _grammar_forces_calls(state: ServerState, backend: Backend, parsed: ChatRequest) -> bool:
    """Whether a grammar enforces ``tool_choice`` required or named: only for calls in the
    Hermes format; other formats are left to the prompt's instruction."""
    if parsed.tool_choice not in ("required", "function"):
        return False
    configured = config_of(state).tool_parser
    return tool_call_format(configured, backend.tokenizer.chat_template).value == "hermes"


def _constraint(
    state: ServerState, backend: Backend, parsed: ChatRequest
) -> TokenConstraint | None:
    """The grammar that enforces ``tool_choice`` required/named or ``response_format``.

    Forced calls are generated in the Hermes format; with another configured parser they
    are left to the prompt (:func:`_grammar_forces_calls`). Runs in a worker thread under a
    time budget (see :mod:`~furnace_trio.server.off_loop`).
    """
    compiler = state.grammar
    assert compiler is not None  # set by the handler before this runs; not user input
    try:
        if parsed.tool_choice in ("required", "function"):
            if not _grammar_forces_calls(state, backend, parsed):
                logger.info("tool_choice %s left to the prompt", parsed.tool_choice)
                return None
            tools = parsed.tool_schemas
            if parsed.tool_function is not None:
                tools = {parsed.tool_function: tools[parsed.tool_function]}
            # a named function is one call; "required" may call several when allowed
            parallel = parsed.parallel_tool_calls and parsed.tool_function is None
            return compiler.tool_calls(tools, parallel=parallel)
        if parsed.response_format is not None:
            return compiler.json_schema(parsed.response_format.schema)
    except GrammarError as exc:
        raise invalid_request(f"cannot compile the grammar: {exc}", "response_format") from None
    return None
