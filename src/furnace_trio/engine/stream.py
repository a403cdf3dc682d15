"""The consumer's side of a request: :class:`RequestStream`, iterated in the handler's task.

The engine task only sends raw messages (:mod:`~furnace_trio.engine.messages`) with
``send_nowait``; all text work happens here, in :meth:`RequestStream.__anext__`:
incremental detokenization, stop strings, logprob entries. So a slow client or an
expensive decode costs the engine loop nothing, and a stop-string match ends its sample
through the same synchronous path as a disconnect.

A stream reaches its engine only through :class:`StreamOwner`, five synchronous calls
(abort, stop a sample, resume a request its backlog paused, commit or end a session turn),
and reads token text through the engine's shared :class:`TokenText`. Taking a message
takes its size off the request's :class:`~furnace_trio.engine.backlog.Backlog`.

A session turn is committed by the stream's consumer (:meth:`RequestStream.commit_turn`)
once sample 0 has finished: only the consumer knows the reply as the client received it
(tool calls parsed, with their ids). The stream adds the text the model generated, which
is what the next turn renders.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, Protocol

import trio

from furnace_trio.core.params import SamplingParams
from furnace_trio.core.plan import SampledToken
from furnace_trio.engine.backlog import Backlog, message_bytes
from furnace_trio.engine.events import Delta, Event, Failed, Finished, LogprobEntry, TopLogprob
from furnace_trio.engine.messages import Finish, Message, PromptScores, Tokens
from furnace_trio.engine.sessions import SessionReply, Turn
from furnace_trio.text.detokenizer import Detokenizer, make_detokenizer
from furnace_trio.text.stop_strings import StopStringMatcher

__all__ = ["RequestStream", "StreamOwner", "TokenText"]


class StreamOwner(Protocol):
    """What a stream may ask of the engine that feeds it; none of these awaits."""

    def abort(self, request_id: str) -> None: ...

    def stop_sample(self, request_id: str, index: int) -> None: ...

    def resume(self, request_id: str) -> None: ...

    def commit_turn(self, turn: Turn, reply: SessionReply) -> bool: ...

    def end_turn(self, turn: Turn) -> None: ...


@dataclass(frozen=True, slots=True)
class TokenText:
    """How streams turn token ids into text; one per engine, shared by its streams.

    ``decode_table`` holds each id's bytes in ``decode``'s output, where ``decode`` is
    their concatenation (``Tokenizer.decode_table``): streams then detokenize without
    calling ``decode``. ``token_bytes`` fills the ``bytes`` of logprob entries.
    """

    decode: Callable[[Sequence[int]], str]
    decode_table: Sequence[bytes] | None = None
    token_bytes: Callable[[int], bytes] | None = None

    def detokenizer(self) -> Detokenizer:
        return make_detokenizer(self.decode, self.decode_table)


@dataclass(slots=True, eq=False)
class _SampleText:
    """Text state of one sample: detokenizer, stop strings, tokens not yet in a delta."""

    detokenizer: Detokenizer
    stops: StopStringMatcher | None
    completion_tokens: int = 0
    drafted: int = 0  # speculative decoding: draft tokens run, and kept
    accepted: int = 0
    finished: bool = False
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobEntry] = field(default_factory=list)
    prompt_logprobs: tuple[LogprobEntry, ...] | None = None  # for the next delta


class RequestStream:
    """The events of one request, consumed in its handler's task.

    Yields :class:`Admitted`, then :class:`Delta`\\ s and one :class:`Finished` per sample
    index, or a :class:`Failed` that ends everything. Leaving it (``async with``, or
    :meth:`close`) aborts the request if it is unfinished; ``close`` never awaits, so it is
    safe in ``finally`` blocks and under cancellation.
    """

    def __init__(
        self,
        owner: StreamOwner,
        text: TokenText,
        request_id: str,
        receive: trio.MemoryReceiveChannel[Message],
        params: SamplingParams,
        turn: Turn | None = None,
        *,
        backlog: Backlog | None = None,
    ) -> None:
        self.request_id = request_id
        self._backlog = backlog
        self.turn = turn
        self._reply: list[str] = []  # sample 0's text, for the session's history
        self._owner = owner
        self._text = text
        self._receive = receive
        self._params = params
        self._want_logprobs = params.logprobs is not None
        self._samples = [
            _SampleText(
                text.detokenizer(),
                StopStringMatcher(params.stop) if params.stop else None,
            )
            for _ in range(params.n)
        ]
        self._live = params.n
        self._ready: deque[Event] = deque()
        self._done = False
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Event:
        while not self._ready:
            if self._done or self._closed:
                raise StopAsyncIteration
            try:
                message = await self._receive.receive()
            except trio.EndOfChannel:
                self._done = True
                self._ready.append(Failed("the request was aborted"))
                break
            except trio.ClosedResourceError:
                raise StopAsyncIteration from None
            backlog = self._backlog
            if backlog is not None and backlog.take(message_bytes(message)):
                self._owner.resume(self.request_id)
            self._handle(message)
        return self._ready.popleft()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def session_id(self) -> str | None:
        return self.turn.session_id if self.turn is not None else None

    def close(self) -> None:
        """Abort the request if unfinished, end its session turn, and stop listening.
        Idempotent, never awaits."""
        if self._closed:
            return
        self._closed = True
        if not self._done:
            self._owner.abort(self.request_id)
        if self.turn is not None:
            self._owner.end_turn(self.turn)
        self._receive.close()

    # -- text -----------------------------------------------------------------------------

    def _handle(self, message: Message) -> None:
        if isinstance(message, Tokens):
            sample = self._samples[message.index]
            if message.drafted and not sample.finished:
                sample.drafted += message.drafted
                sample.accepted += message.accepted
            if message.tokens:  # none: only the counts of a step that ended the sample
                self._on_tokens(message.index, message.tokens)
        elif isinstance(message, Finish):
            self._on_finish(message.index, message.reason.value)
        elif isinstance(message, PromptScores):
            sample = self._samples[message.index]
            sample.prompt_logprobs = tuple(self._logprob_entry(t) for t in message.scores)
        elif isinstance(message, Failed):
            self._done = True
            self._ready.append(message)
        else:
            self._ready.append(message)

    def _on_tokens(self, index: int, tokens: tuple[SampledToken, ...]) -> None:
        """One delta for the tokens of a message (unless they make no text yet)."""
        sample = self._samples[index]
        texts: list[str] = []
        for token in tokens:
            if sample.finished:
                return  # a stop string ended it; tokens in flight are dropped
            sample.completion_tokens += 1
            sample.token_ids.append(token.token_id)
            if self._want_logprobs:
                sample.logprobs.append(self._logprob_entry(token))
            text = sample.detokenizer.feed(token.token_id)
            if sample.stops is not None:
                text, matched = sample.stops.feed(text)
                if matched:
                    self._end_sample(index, "".join(texts) + text, "stop")
                    self._owner.stop_sample(self.request_id, index)
                    return
            texts.append(text)
        text = "".join(texts)
        if text or self._want_logprobs or sample.prompt_logprobs is not None:
            self._emit_delta(index, text)

    def _on_finish(self, index: int, reason: Literal["stop", "length"]) -> None:
        sample = self._samples[index]
        if sample.finished:
            return
        text = sample.detokenizer.flush()
        if sample.stops is not None:
            text, matched = sample.stops.feed(text)
            if matched:
                reason = "stop"
            else:
                text += sample.stops.flush()
        self._end_sample(index, text, reason)

    def commit_turn(self, message: Mapping[str, Any]) -> bool:
        """Sample 0 of a session turn finished: ``message``, the reply as the client received
        it, joins the session's history, with the text the model generated (stop strings
        removed) and the KV the request pinned. ``False`` (nothing changed) for a request
        without a turn, before sample 0 finished, or once the turn was committed or ended."""
        if self.turn is None or not self._samples[0].finished:
            return False
        reply = SessionReply(dict(message), "".join(self._reply))
        return self._owner.commit_turn(self.turn, reply)

    def _end_sample(self, index: int, text: str, reason: Literal["stop", "length"]) -> None:
        sample = self._samples[index]
        if text or sample.token_ids or sample.prompt_logprobs is not None:
            self._emit_delta(index, text)
        sample.finished = True
        self._ready.append(
            Finished(index, reason, sample.completion_tokens, sample.drafted, sample.accepted)
        )
        self._live -= 1
        if self._live == 0:
            self._done = True

    def _emit_delta(self, index: int, text: str) -> None:
        if self.turn is not None and index == 0:
            self._reply.append(text)
        sample = self._samples[index]
        self._ready.append(
            Delta(
                index,
                text,
                tuple(sample.token_ids),
                tuple(sample.logprobs),
                sample.prompt_logprobs,
            )
        )
        sample.token_ids.clear()
        sample.logprobs.clear()
        sample.prompt_logprobs = None

    def _logprob_entry(self, token: SampledToken) -> LogprobEntry:
        top = tuple(
            TopLogprob(self._piece(t.token_id), t.token_id, t.logprob, self._bytes(t.token_id))
            for t in token.top_logprobs
        )
        logprob = token.logprob if token.logprob is not None else math.nan
        return LogprobEntry(
            self._piece(token.token_id), token.token_id, logprob, self._bytes(token.token_id), top
        )

    def _piece(self, token_id: int) -> str:
        """A logprob entry's ``token``: the id decoded alone; a special token, which
        ``decode`` skips, is named by its text (``<|im_end|>``), as its ``bytes`` are."""
        text = self._text.decode((token_id,))
        token_bytes = self._text.token_bytes
        if text or token_bytes is None:
            return text
        return token_bytes(token_id).decode("utf-8", errors="replace")

    def _bytes(self, token_id: int) -> tuple[int, ...] | None:
        token_bytes = self._text.token_bytes
        return None if token_bytes is None else tuple(token_bytes(token_id))
