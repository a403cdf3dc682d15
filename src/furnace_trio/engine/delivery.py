"""The engine's open requests and what it sends their streams: the per-step hot path.

:class:`Outbox` holds each accepted request's memory channel and timings, sends the
messages of :mod:`~furnace_trio.engine.messages` with ``send_nowait`` (never waiting on a
slow consumer), groups tokens by ``stream_interval``, and records the latency metrics. It
touches neither the scheduler nor the sessions: the engine hands it the callbacks for a
request whose stream closed (abort it), for one whose stream holds more than its
:class:`~furnace_trio.engine.backlog.Backlog` allows (pause it), and for one that finished
(its session turn).

With ``stream_interval`` N > 1, a sample's first token goes out at once and the rest in
groups of N (and at its end), each group one message and one
:class:`~furnace_trio.engine.events.Delta`: the consumer's task wakes, and the HTTP layer
writes a chunk, once per group instead of once per token.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import trio

from furnace_trio.core.plan import SampledToken
from furnace_trio.engine.backlog import Backlog, message_bytes
from furnace_trio.engine.events import Admitted, Failed, FailureCause
from furnace_trio.engine.messages import Finish, Message, PromptScores, Tokens
from furnace_trio.engine.scheduler import FinishReason, SampleOutput, ScheduledStep
from furnace_trio.engine.stats import EngineMetrics

__all__ = ["Outbox"]


@dataclass(slots=True, eq=False)
class _Request:
    """The engine's side of a request: its channel, timings, and samples still going."""

    request_id: str
    num_prompt_tokens: int
    send: trio.MemorySendChannel[Message]
    submitted_at: float
    done: list[bool]
    live: int
    last_token_at: list[float | None]
    backlog: Backlog
    first_token_at: float | None = None
    any_length: bool = False
    # per sample index, tokens held back for the next group (stream_interval > 1)
    held: dict[int, list[SampledToken]] = field(default_factory=dict)
    # speculative decoding, per sample index: (drafted, accepted) not yet sent
    drafts: dict[int, tuple[int, int]] = field(default_factory=dict)
    drafted: int = 0  # the request's drafts in all, and of those accepted
    accepted: int = 0


class Outbox:
    """Every request the engine accepted and has not yet finished, failed or aborted.

    ``on_closed(request_id)`` runs when a send finds the stream closed (the client left);
    the engine aborts the request there, which calls :meth:`close`. ``on_backlogged`` runs
    when a send takes a request's backlog past its limit (the engine pauses it).
    ``on_finished`` runs when a request's last sample ended. None of them awaits.
    """

    def __init__(
        self,
        metrics: EngineMetrics,
        stream_interval: int,
        *,
        on_closed: Callable[[str], None],
        on_finished: Callable[[str], None],
        on_backlogged: Callable[[str], None],
    ) -> None:
        self._metrics = metrics
        self._stream_interval = stream_interval
        self._on_closed = on_closed
        self._on_finished = on_finished
        self._on_backlogged = on_backlogged
        self._requests: dict[str, _Request] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._requests))

    def open(
        self, request_id: str, num_prompt_tokens: int, n: int, backlog: Backlog
    ) -> trio.MemoryReceiveChannel[Message]:
        """Accept a request of ``n`` samples; its stream reads the returned channel and
        takes what it reads off ``backlog``.

        The channel is unbounded, so the engine never waits on a slow client; what it
        holds is bounded by the backlog's limit (past it, ``on_backlogged``)."""
        send, receive = trio.open_memory_channel[Message](math.inf)
        self._requests[request_id] = _Request(
            request_id=request_id,
            num_prompt_tokens=num_prompt_tokens,
            send=send,
            submitted_at=trio.current_time(),
            done=[False] * n,
            live=n,
            last_token_at=[None] * n,
            backlog=backlog,
        )
        return receive

    def close(self, request_id: str) -> bool:
        """Forget a request and close its channel (an abort); whether it was open."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        request.send.close()
        return True

    def admitted(self, step: ScheduledStep, now: float) -> None:
        """Send :class:`Admitted` to the requests ``step`` admitted."""
        for request_id, cached in zip(step.admitted, step.cached_tokens, strict=True):
            request = self._requests.get(request_id)
            if request is None:
                continue
            queue_time = now - request.submitted_at
            self._metrics.queue_time.observe(queue_time)
            self._metrics.prompt_tokens_total += request.num_prompt_tokens
            self._send(request, Admitted(request.num_prompt_tokens, cached, queue_time))

    def deliver(self, outputs: list[SampleOutput], now: float) -> None:
        """Send a step's sampled tokens, prompt scores and sample ends."""
        metrics = self._metrics
        interval = self._stream_interval
        for output in outputs:
            request = self._requests.get(output.request_id)
            if request is None:
                continue
            scores = output.prompt_logprobs
            if scores is not None and not self._send(request, PromptScores(output.index, scores)):
                continue
            if output.drafted:
                self._count_drafts(request, output)
            if output.token is not None:
                metrics.generation_tokens_total += 1
                if request.first_token_at is None:
                    request.first_token_at = now
                    metrics.time_to_first_token.observe(now - request.submitted_at)
                last = request.last_token_at[output.index]
                if last is not None:
                    metrics.inter_token_latency.observe(now - last)
                request.last_token_at[output.index] = now
                if last is None or interval == 1:
                    message = self._tokens(request, output.index, (output.token,))
                else:
                    held = request.held.setdefault(output.index, [])
                    held.append(output.token)
                    if len(held) < interval and output.finish is None:
                        continue
                    message = self._tokens(request, output.index, tuple(held))
                    held.clear()
                if not self._send(request, message):
                    continue
            if output.finish is not None:
                self._finish(request, output.index, output.finish)

    def submitted_at(self, request_id: str) -> float | None:
        """When an open request was accepted (``trio.current_time()``)."""
        request = self._requests.get(request_id)
        return None if request is None else request.submitted_at

    def sample_open(self, request_id: str, index: int) -> bool:
        """Whether sample ``index`` of ``request_id`` is still going."""
        request = self._requests.get(request_id)
        return request is not None and not request.done[index]

    def finish_sample(self, request_id: str, index: int, reason: FinishReason) -> None:
        """End one sample of an open request (its held-back tokens go out first)."""
        request = self._requests.get(request_id)
        if request is not None:
            self._finish(request, index, reason)

    def fail(self, request_id: str, message: str, cause: FailureCause) -> None:
        """Send :class:`Failed` and close the request's channel."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        self._metrics.count("failed")
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            request.send.send_nowait(Failed(message, cause))
        request.send.close()

    def close_all(self) -> None:
        """Close every channel that is still open (after failing them, whatever broke)."""
        for request in self._requests.values():
            request.send.close()
        self._requests.clear()

    def _count_drafts(self, request: _Request, output: SampleOutput) -> None:
        """Speculative decoding's figures of one drafted step of a sample."""
        metrics = self._metrics
        metrics.spec_drafted_tokens_total += output.drafted
        metrics.spec_accepted_tokens_total += output.accepted
        metrics.spec_tokens_per_step.observe(output.accepted + 1)
        request.drafted += output.drafted
        request.accepted += output.accepted
        drafted, accepted = request.drafts.get(output.index, (0, 0))
        request.drafts[output.index] = (drafted + output.drafted, accepted + output.accepted)

    @staticmethod
    def _tokens(request: _Request, index: int, tokens: tuple[SampledToken, ...]) -> Tokens:
        """A :class:`Tokens` message, with the sample's draft counts since its last one."""
        drafted, accepted = request.drafts.pop(index, (0, 0))
        return Tokens(index, tokens, drafted, accepted)

    def _send(self, request: _Request, message: Message) -> bool:
        """Whether the message went out; a closed stream aborts the request, and one that
        holds too much unsent pauses it."""
        try:
            request.send.send_nowait(message)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._on_closed(request.request_id)
            return False
        if request.backlog.add(message_bytes(message)):
            self._on_backlogged(request.request_id)
        return True

    def _finish(self, request: _Request, index: int, reason: FinishReason) -> None:
        if request.done[index]:
            return
        held = request.held.pop(index, None)
        if (held or index in request.drafts) and not self._send(
            request, self._tokens(request, index, tuple(held or ()))
        ):
            return
        request.done[index] = True
        request.live -= 1
        request.any_length |= reason is FinishReason.LENGTH
        if not self._send(request, Finish(index, reason)):
            return
        if request.live == 0:
            del self._requests[request.request_id]
            self._on_finished(request.request_id)
            self._metrics.count("finished_length" if request.any_length else "finished_stop")
            self._metrics.e2e_latency.observe(trio.current_time() - request.submitted_at)
            if request.drafted:
                self._metrics.spec_acceptance.observe(request.accepted / request.drafted)
            request.send.close()
