"""Several engine requests read as one response's events: a batch of completions prompts.

OpenAI's ``/v1/completions`` takes a list of prompts. Each becomes its own engine request
(its own prefill and samples, batched with everything else by the scheduler), and the
response numbers sample ``j`` of prompt ``i`` as choice ``i * n + j``. :class:`StreamGroup`
reads the requests' streams at once, one small task per stream, and hands their events on
in the order they arrive, renumbered, so each prompt's tokens go out as the model makes
them, whatever the other prompts are doing.

The tasks run in a nursery the caller owns (the app's): a response body is an async
generator, which cannot keep a nursery open across a ``yield``. A task ends when its
stream does, and every stream ends when the group is closed or its request is aborted,
so no task outlives its response for long. The tasks hand events over a channel without a
buffer: while the response is not being written (its client does not read), they stop
taking their streams' events, and each request's backlog pauses it in the engine. It has
the surface of a :class:`~furnace_trio.engine.RequestStream` that response code reads:
iteration,
:meth:`close` and :attr:`session_id`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Sequence

import trio

from furnace_trio.engine import Admitted, Delta, Event, Failed, Finished, RequestStream

logger = logging.getLogger(__name__)


class StreamGroup:
    """The events of ``streams`` (each with ``n`` samples) as one stream of ``len(streams)
    * n`` choices; ``prompt_tokens[i]`` is stream ``i``'s prompt length."""

    def __init__(
        self,
        streams: Sequence[RequestStream],
        n: int,
        prompt_tokens: Sequence[int],
        nursery: trio.Nursery,
    ) -> None:
        self._streams = tuple(streams)
        self._n = n
        self._prompt_tokens = list(prompt_tokens)
        self._cached_tokens = [0] * len(self._streams)
        send, self._receive = trio.open_memory_channel[tuple[int, Event]](0)
        with send:
            for index, stream in enumerate(self._streams):
                nursery.start_soon(self._pump, index, stream, send.clone())

    session_id: str | None = None  # completions have no sessions

    def __aiter__(self) -> StreamGroup:
        return self

    async def __anext__(self) -> Event:
        try:
            index, event = await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise StopAsyncIteration from None
        if isinstance(event, Delta | Finished):
            return dataclasses.replace(event, index=index * self._n + event.index)
        if isinstance(event, Admitted):
            # The response's usage counts every prompt: the totals so far.
            self._prompt_tokens[index] = event.prompt_tokens
            self._cached_tokens[index] = event.cached_tokens
            return Admitted(sum(self._prompt_tokens), sum(self._cached_tokens), event.queue_time)
        return event

    def close(self) -> None:
        """Close every stream (aborting what is unfinished) and stop listening. Idempotent,
        never awaits."""
        for stream in self._streams:
            stream.close()
        self._receive.close()

    async def _pump(
        self, index: int, stream: RequestStream, send: trio.MemorySendChannel[tuple[int, Event]]
    ) -> None:
        """Forward one stream's events. Nothing escapes but cancellation: the nursery is
        the app's, where an exception would end more than this response."""
        with send:
            try:
                async for event in stream:
                    await send.send((index, event))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the group was closed
            except Exception as exc:
                logger.exception("stream %s of a group failed", stream.request_id)
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await send.send((index, Failed(f"the stream failed: {exc}")))
