"""How a generation's engine events become its response: folded into one JSON object, or
written as server-sent events.

The SSE body (:func:`stream_body`) is an async generator whose ``finally`` closes (aborts)
the request stream however it ends: it must not await there, and closing twice is
harmless. A failure after the stream has started is sent as an SSE error event, then the
stream ends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

from furnace_trio.engine import (
    Admitted,
    Delta,
    Failed,
    FailureCause,
    Finished,
    RequestStream,
)
from furnace_trio.server.echo import Echo
from furnace_trio.server.errors import APIError
from furnace_trio.server.request_log import RequestTiming
from furnace_trio.server.sse import DONE, Collector, sse_event
from furnace_trio.server.stream_group import StreamGroup
from furnace_trio.server.tool_stream import ToolCallReady, ToolCallStream

logger = logging.getLogger(__name__)


def failure_error(failed: Failed) -> APIError:
    """The error for a failed request: 500 when the model failed on it (the server goes
    on), 503 when the engine is gone or the server is shutting down."""
    if failed.cause is FailureCause.MODEL:
        return APIError(500, f"The model failed on this request: {failed.message}")
    if failed.cause is FailureCause.SHUTDOWN:
        return APIError(503, f"The request was cancelled: {failed.message}", code="shutting_down")
    return APIError(503, f"The server cannot serve requests: {failed.message}", code="unavailable")


def fold_event(event: object, collector: Collector, timing: RequestTiming) -> Failed | None:
    """Fold one engine event into the collector; return a ``Failed``."""
    if isinstance(event, Delta):
        if timing.first_token is None:
            timing.first_token = time.monotonic()
        collector.add_delta(event.index, event.text, event.logprobs)
    elif isinstance(event, Finished):
        collector.finish(event.index, event.reason, event.completion_tokens)
    elif isinstance(event, Admitted):
        _admit(event, collector, timing)
    elif isinstance(event, ToolCallReady):
        collector.add_tool_call(event.index, event.call)
    elif isinstance(event, Failed):
        return event
    return None


def commit_turn(stream: RequestStream | StreamGroup, event: object, collector: Collector) -> bool:
    """Once a session turn's reply is complete (its ``Finished``, which follows the choice's
    last text and tool calls), it joins the session as the client received it; whether
    it did."""
    if (
        isinstance(event, Finished)
        and event.index == 0
        and isinstance(stream, RequestStream)
        and stream.turn is not None
    ):
        return stream.commit_turn(collector.message(0))
    return False


#: Awaited once a session turn committed, before the client sees the reply's end (the
#: shared session store saves the history there: the next turn may go to another replica).
OnCommit = Callable[[], Awaitable[None]]


def _admit(event: Admitted, collector: Collector, timing: RequestTiming) -> None:
    timing.admitted = time.monotonic()
    timing.queue_time = event.queue_time
    collector.prompt_tokens = event.prompt_tokens
    collector.cached_tokens = event.cached_tokens


async def stream_body(
    stream: RequestStream | StreamGroup,
    collector: Collector,
    timing: RequestTiming,
    include_usage: bool,
    tools: ToolCallStream | Echo | None = None,
    on_commit: OnCommit | None = None,
) -> AsyncIterator[bytes]:
    """SSE body; ``finally`` aborts (sync, idempotent) however the generator ends."""
    try:
        if collector.kind == "chat":
            for index in range(collector.n):
                first = collector.chunk(index, role=True, include_usage=include_usage)
                if stream.session_id is not None:
                    first["session_id"] = stream.session_id
                yield sse_event(first)
        async for engine_event in stream:
            timing.observe(engine_event)
            events = tools.translate(engine_event) if tools is not None else [engine_event]
            for event in events:
                # before its chunk: the client may leave
                if commit_turn(stream, event, collector) and on_commit is not None:
                    await on_commit()
                for chunk in _stream_chunks(event, collector, timing, include_usage):
                    yield chunk
            if isinstance(engine_event, Failed):
                error = failure_error(engine_event)
                timing.status = error.status
                yield sse_event(error.body())
                return
        if include_usage:
            yield sse_event(collector.usage_chunk())
        yield DONE
    except Exception as exc:
        timing.status = 500
        logger.exception("stream %s failed", collector.response_id)
        yield sse_event(APIError(500, f"The stream failed: {exc}").body())
    except BaseException:
        if timing.status == 200:
            timing.status = 499
        raise
    finally:
        stream.close()
        timing.log(collector)


def _stream_chunks(
    event: object, collector: Collector, timing: RequestTiming, include_usage: bool
) -> Iterable[bytes]:
    if isinstance(event, Delta):
        if timing.first_token is None:
            timing.first_token = time.monotonic()
        if collector.want_logprobs and event.logprobs:
            yield sse_event(
                collector.chunk(
                    event.index,
                    text=event.text,
                    logprobs=event.logprobs,
                    include_usage=include_usage,
                )
            )
        elif event.text:
            yield collector.content_event(event.index, event.text, include_usage=include_usage)
    elif isinstance(event, Finished):
        collector.finish(event.index, event.reason, event.completion_tokens)
        reason = collector.choices[event.index].finish_reason
        yield sse_event(
            collector.chunk(event.index, finish_reason=reason, include_usage=include_usage)
        )
    elif isinstance(event, ToolCallReady):
        for body in collector.tool_call_chunks(
            event.index, event.call, include_usage=include_usage
        ):
            yield sse_event(body)
    elif isinstance(event, Admitted):
        _admit(event, collector, timing)
