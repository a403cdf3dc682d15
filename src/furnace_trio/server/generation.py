"""One generation: from a validated request and its prompt token ids to a response.

:func:`start_generation` builds the engine requests (a batch of completions prompts
becomes one request per prompt, read together through a
:class:`~furnace_trio.server.stream_group.StreamGroup`) and submits them all or none;
:func:`generate` answers with the SSE body or the whole JSON object (the Responses API
shapes its own answer from the same start, with :func:`collect`). Engine refusals become HTTP errors
here: busy and draining are 503s with ``Retry-After``, a request that can never fit is a
503 the SDK does not retry, a rejected one is a 400.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio
from quart import Response, current_app

from furnace_trio.core.params import SamplingParams, TokenConstraint
from furnace_trio.engine import (
    EngineBusy,
    EngineUnavailable,
    GenerationRequest,
    LogprobEntry,
    RequestRejected,
    RequestStream,
    RequestTooLarge,
)
from furnace_trio.engine.sessions import Turn
from furnace_trio.server.asgi import register_abort, request_caller, request_config
from furnace_trio.server.chat_request import ChatRequest
from furnace_trio.server.completion_request import CompletionRequest
from furnace_trio.server.echo import Echo
from furnace_trio.server.errors import APIError, invalid_request
from furnace_trio.server.protocol import resolve_max_tokens
from furnace_trio.server.request_log import RequestTiming
from furnace_trio.server.response_body import (
    OnCommit,
    commit_turn,
    failure_error,
    fold_event,
    stream_body,
)
from furnace_trio.server.sse import SSE_HEADERS, Collector, Kind, dumps
from furnace_trio.server.state import BUSY_RETRY_AFTER_S, STATE_KEY, ServerState, shutting_down
from furnace_trio.server.stream_group import StreamGroup
from furnace_trio.server.tool_stream import ToolCallStream

if TYPE_CHECKING:
    from furnace_trio.server.backend import Backend

COMPLETIONS_DEFAULT_MAX_TOKENS = 16


@dataclass(slots=True)
class Started:
    """A submitted generation: its engine events, the collector its output folds into, its
    timing for the log line, and the translation (tool calls, echo) its events go through.

    Whoever holds it must read or close ``stream`` and log ``timing`` once it ends.
    """

    stream: RequestStream | StreamGroup
    collector: Collector
    timing: RequestTiming
    tools: ToolCallStream | Echo | None

    def translate(self, engine_event: object) -> list[object]:
        """The events one engine event stands for, tool calls parsed out of the text."""
        return self.tools.translate(engine_event) if self.tools is not None else [engine_event]


async def generate(
    backend: Backend,
    kind: Kind,
    parsed: ChatRequest | CompletionRequest,
    prompts: Sequence[tuple[int, ...]],
    prompt_param: str,
    tool_stream: Callable[[str, int], ToolCallStream] | None = None,
    constraint: TokenConstraint | None = None,
    *,
    turn: Turn | None = None,
    nursery: trio.Nursery | None = None,
    echo: Sequence[str] | None = None,
    on_commit: OnCommit | None = None,
) -> Response:
    """Generate for one prompt, or for a batch of completions prompts (each its own engine
    request, read together through a :class:`StreamGroup` whose tasks run in ``nursery``).
    ``echo`` holds each prompt's text where the choices begin with their prompt;
    ``on_commit`` is awaited once a session ``turn`` committed."""
    started = start_generation(
        backend,
        kind,
        parsed,
        prompts,
        prompt_param,
        tool_stream,
        constraint,
        turn=turn,
        nursery=nursery,
        echo=echo,
    )
    if parsed.stream:
        response = Response(
            stream_body(
                started.stream,
                started.collector,
                started.timing,
                parsed.include_usage,
                started.tools,
                on_commit,
            ),
            mimetype="text/event-stream",
            headers=SSE_HEADERS,
        )
        response.timeout = None  # RESPONSE_TIMEOUT would silently cut a long stream
        return response
    await collect(started)
    if on_commit is not None and turn is not None:
        await on_commit()
    return Response(dumps(started.collector.response()), mimetype="application/json")


def start_generation(
    backend: Backend,
    kind: Kind,
    parsed: ChatRequest | CompletionRequest,
    prompts: Sequence[tuple[int, ...]],
    prompt_param: str,
    tool_stream: Callable[[str, int], ToolCallStream] | None = None,
    constraint: TokenConstraint | None = None,
    *,
    turn: Turn | None = None,
    nursery: trio.Nursery | None = None,
    echo: Sequence[str] | None = None,
    request_id: str | None = None,
) -> Started:
    """Build the engine requests, submit them all or none, and set up what their events
    fold into; the caller shapes the response (see :func:`generate`)."""
    if request_id is None:
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    # The limits of the configuration this request arrived under (a reload changes them
    # for later requests only). The engine's backlog limit is the current configuration's,
    # so the request names its own only when a reload came after it arrived.
    state = _state()
    config = request_config(state)
    own_backlog = config.max_response_bytes if config is not state.config else None
    generations = [
        GenerationRequest(
            prompt_token_ids=prompt_ids,
            params=_params(
                backend,
                kind,
                parsed,
                prompt_ids,
                prompt_param,
                constraint,
                which,
                config.max_output_tokens,
            ),
            request_id=request_id if len(prompts) == 1 else f"{request_id}-{which}",
            turn=turn,
            max_response_bytes=own_backlog,
        )
        for which, prompt_ids in enumerate(prompts)
    ]
    params = generations[0].params
    collector = Collector(
        kind=kind,
        response_id=request_id,
        model=backend.model_name,
        created=int(time.time()),
        n=params.n * len(prompts),
        prompt_tokens=sum(len(prompt_ids) for prompt_ids in prompts),
        want_logprobs=params.logprobs is not None,
    )
    stream = _submit_all(backend, generations, prompt_param, nursery)
    timing = RequestTiming(
        request_id,
        longest_prompt=max(len(prompt_ids) for prompt_ids in prompts),
        max_context=backend.max_context,
        kv_blocks=backend.engine.kv_blocks,
        key_name=caller.name if (caller := request_caller()) is not None else None,
    )
    tools: ToolCallStream | Echo | None = None
    if tool_stream is not None:
        tools = tool_stream(request_id, collector.n)
    elif echo is not None:
        firsts = [
            LogprobEntry(backend.engine.decode(ids[:1]), ids[0], None, None, ()) for ids in prompts
        ]
        tools = Echo(
            echo,
            firsts,
            params.n,
            want_logprobs=collector.want_logprobs,
            generated=parsed.sampling.max_tokens != 0,
        )
    return Started(stream, collector, timing, tools)


async def collect(started: Started, on_event: Callable[[object], object] | None = None) -> None:
    """Read a started generation to its end into its collector, handing each event to
    ``on_event`` too once folded; a failure raises its HTTP error. The stream is closed and
    the request logged however this ends."""
    timing = started.timing
    try:
        async for engine_event in started.stream:
            timing.observe(engine_event)
            failure = None
            for event in started.translate(engine_event):
                failure = fold_event(event, started.collector, timing) or failure
                commit_turn(started.stream, event, started.collector)
                if on_event is not None and failure is None:
                    on_event(event)
            if failure is not None:
                error = failure_error(failure)
                timing.status = error.status
                raise error
    except BaseException:
        if timing.status == 200:
            timing.status = 499  # cancelled: the client went away
        raise
    finally:
        started.stream.close()
        timing.log(started.collector)


def _state() -> ServerState:
    return current_app.extensions[STATE_KEY]  # type: ignore[no-any-return]


def _params(
    backend: Backend,
    kind: Kind,
    parsed: ChatRequest | CompletionRequest,
    prompt_ids: tuple[int, ...],
    prompt_param: str,
    constraint: TokenConstraint | None,
    which: int,
    max_output_tokens: int | None,
) -> SamplingParams:
    """One prompt's sampling parameters (its ``max_tokens`` depends on its length); a
    prompt of a batch is named in the error."""
    try:
        if not prompt_ids:
            raise invalid_request("the prompt is empty after tokenization", prompt_param)
        max_tokens = resolve_max_tokens(
            parsed.sampling.max_tokens,
            prompt_tokens=len(prompt_ids),
            max_context=backend.max_context,
            default=None if kind == "chat" else COMPLETIONS_DEFAULT_MAX_TOKENS,
            limit=max_output_tokens,
            prompt_param=prompt_param,
            max_tokens_param=parsed.sampling.max_tokens_param,
        )
        try:
            # max_tokens 0 (echo alone): one token is computed, and the echo drops it.
            params = parsed.sampling.to_params(max(max_tokens, 1), backend.generation)
        except ValueError as exc:
            raise invalid_request(str(exc)) from None
    except APIError as exc:
        if not isinstance(parsed, CompletionRequest) or len(parsed.prompts) == 1:
            raise
        raise APIError(
            exc.status,
            f"prompt[{which}]: {exc.message}",
            param=exc.param,
            code=exc.code,
            error_type=exc.error_type,
            headers=exc.headers,
        ) from None
    if constraint is not None:
        params = dataclasses.replace(params, constraint=constraint)
    if isinstance(parsed, CompletionRequest) and parsed.echo and params.logprobs is not None:
        params = dataclasses.replace(params, prompt_logprobs=params.logprobs)
    return params


def _submit_all(
    backend: Backend,
    generations: Sequence[GenerationRequest],
    param: str,
    nursery: trio.Nursery | None,
) -> RequestStream | StreamGroup:
    """Submit every request, or none: the queue is asked for room for all their sequences
    first, and one that the engine refuses still closes (aborts) those already submitted."""
    if len(generations) == 1:
        return _submit(backend, generations[0], param)
    assert nursery is not None, "a batch of prompts is read in a nursery"
    with _engine_refusals(backend, param):
        backend.engine.check_room(sum(generation.params.n for generation in generations))
    streams: list[RequestStream] = []
    try:
        for generation in generations:
            streams.append(_submit(backend, generation, param))
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    return StreamGroup(
        streams,
        generations[0].params.n,
        [len(generation.prompt_token_ids) for generation in generations],
        nursery,
    )


def _submit(backend: Backend, generation: GenerationRequest, param: str) -> RequestStream:
    """Hand a request to the engine, register it for abort, map engine errors to HTTP."""
    with _engine_refusals(backend, param):
        stream = backend.engine.submit(generation)
    register_abort(stream.request_id)
    return stream


@contextmanager
def _engine_refusals(backend: Backend, param: str) -> Iterator[None]:
    """The engine's refusals as HTTP errors: busy and draining are 503s with
    ``Retry-After``, a request that can never fit a 503 the SDK does not retry, a rejected
    one a 400 naming ``param`` (or the engine's own)."""
    try:
        yield
    except EngineBusy as exc:
        raise APIError(
            503,
            f"The server is busy: {exc}. Retry shortly.",
            code="server_busy",
            headers={"Retry-After": str(BUSY_RETRY_AFTER_S)},
        ) from None
    except RequestTooLarge as exc:
        raise APIError(
            503,
            f"The request can never fit this server's memory: {exc}",
            code="request_too_large",
            headers={"x-should-retry": "false"},
        ) from None
    except RequestRejected as exc:
        raise invalid_request(str(exc), getattr(exc, "param", None) or param) from None
    except EngineUnavailable as exc:
        if backend.engine.alive:  # draining or shutting down: another replica can serve it
            raise shutting_down() from None
        raise APIError(
            503, f"The server cannot serve requests: {exc}", code="unavailable"
        ) from None
