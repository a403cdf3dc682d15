"""The engine task: continuous batching over a :class:`~furnace_trio.core.plan.StepRunner`.

One Trio task (:meth:`Engine.run`, started with ``nursery.start``) owns the scheduler and
the KV block pool; nothing else touches them except the synchronous :meth:`Engine.submit`
and :meth:`Engine.abort`, which run on the same Trio thread, so there are no locks::

    loop: schedule()  ->  await model_thread.run(runner.step, plan)  ->  update()  ->  send_nowait
          (idle: sleep on a trio.Event that submit() sets)

- Aborts take effect at once (blocks freed synchronously); a request submitted while a
  step runs joins the next step (continuous batching).
- Tokens go out with ``send_nowait`` on each request's unbounded channel (bounded in
  practice by ``max_tokens``), so the engine never waits on a slow client; a closed
  channel means the client left, and the request is aborted. With ``stream_interval``
  N > 1, a sample's first token goes out at once and the rest in groups of N (and at its
  end), each group one message and one :class:`Delta`: the consumer's task wakes, and the
  HTTP layer writes a chunk, once per group instead of once per token.
- Text work runs in the consumer's task (:mod:`~furnace_trio.engine.stream`), which
  reaches the engine only through :class:`~furnace_trio.engine.stream.StreamOwner`.
- Failure isolation: a raising ``runner.step`` fails only the requests of that plan. If the
  engine task itself dies (a bug), every stream gets :class:`Failed`, :attr:`Engine.alive`
  turns false and :meth:`Engine.submit` raises :class:`EngineUnavailable`: no request
  ever hangs. :meth:`Engine.run` then returns instead of raising, because an exception
  escaping quart-trio's lifespan nursery is only logged while the server goes on.
- Watchdog: a step that runs past ``step_timeout_s`` kills the engine the same way; its
  thread is abandoned (see :meth:`Engine._run_step`) and no other step ever starts. Every
  :class:`Failed` carries a :class:`FailureCause`, so the HTTP layer can tell "the model
  failed on this request" (500) from "the server cannot serve" (503).
- Drain: :meth:`Engine.drain` stops admitting but lets every accepted request (running or
  queued) finish; :meth:`Engine.cancel_all` then fails whatever is left, and :meth:`run`
  returns once nothing is left.
- Prefix cache and sessions: :class:`Admitted` reports the tokens reused from the cache
  (:mod:`~furnace_trio.engine.kv_cache_manager`). A request carrying a session turn pins its
  KV when it finishes; the handler commits the reply (:meth:`Engine.commit_turn`) and
  always ends the turn (:meth:`Engine.end_turn`; :meth:`Engine.abort` ends it too), see
  :mod:`~furnace_trio.engine.session_turns`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from furnace_trio.core.plan import SampledToken, StepRunner
from furnace_trio.engine.block_pool import BlockPool
from furnace_trio.engine.config import EngineConfig
from furnace_trio.engine.errors import (
    EngineBusy,
    EngineError,
    EngineUnavailable,
    RequestRejected,
    RequestTooLarge,
    check_request,
)
from furnace_trio.engine.events import (
    Admitted,
    Delta,
    Event,
    Failed,
    FailureCause,
    Finished,
    GenerationRequest,
    LogprobEntry,
    TopLogprob,
)
from furnace_trio.engine.kv_cache_manager import KVCacheManager
from furnace_trio.engine.messages import Finish, Message, PromptScores, Tokens
from furnace_trio.engine.model_thread import ModelThread
from furnace_trio.engine.scheduler import (
    FinishReason,
    SampleOutput,
    ScheduledStep,
    Scheduler,
    StepMismatch,
)
from furnace_trio.engine.session_turns import SessionTurns
from furnace_trio.engine.sessions import Session, SessionStore, Turn
from furnace_trio.engine.stats import EngineMetrics, EngineStatistics
from furnace_trio.engine.stream import RequestStream, TokenText

logger = logging.getLogger(__name__)

__all__ = [
    "Admitted",
    "Delta",
    "Engine",
    "EngineBusy",
    "EngineConfig",
    "EngineError",
    "EngineUnavailable",
    "Event",
    "Failed",
    "FailureCause",
    "Finished",
    "GenerationRequest",
    "LogprobEntry",
    "RequestRejected",
    "RequestStream",
    "RequestTooLarge",
    "TopLogprob",
]


_DEFAULT_CONFIG = EngineConfig()  # frozen, so one default is safe to share


class _State(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    SHUTTING_DOWN = "shutting down"
    DRAINING = "draining"
    STOPPED = "stopped"
    DEAD = "dead"


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
    first_token_at: float | None = None
    any_length: bool = False
    # per sample index, tokens held back for the next group (stream_interval > 1)
    held: dict[int, list[SampledToken]] = field(default_factory=dict)


class Engine:
    """Continuous batching over one runner. See the module docstring for the design."""

    def __init__(
        self,
        runner: StepRunner,
        *,
        decode: Callable[[Sequence[int]], str],
        eos_token_ids: frozenset[int],
        token_bytes: Callable[[int], bytes] | None = None,
        decode_table: Sequence[bytes] | None = None,
        config: EngineConfig = _DEFAULT_CONFIG,
        model_thread: ModelThread | None = None,
    ) -> None:
        self._runner = runner
        # Steps run on one thread for the engine's life (see model_thread.py); a backend
        # passes the thread that loaded the model.
        self._model_thread = model_thread if model_thread is not None else ModelThread()
        self._text = TokenText(decode, decode_table, token_bytes)
        self.config = config
        self.max_context = min(config.max_context or runner.max_context, runner.max_context)
        self._pool = BlockPool(runner.num_blocks, runner.block_size, caching=config.prefix_cache)
        self._kv = KVCacheManager(self._pool)
        self._scheduler = Scheduler(
            self._kv,
            max_running=config.max_running,
            max_step_tokens=config.max_step_tokens,
            max_context=self.max_context,
            eos_token_ids=eos_token_ids,
        )
        self._requests: dict[str, _Request] = {}
        max_blocks = config.session_max_blocks
        self.sessions = SessionStore(
            ttl_s=config.session_ttl_s,
            max_blocks=runner.num_blocks // 2 if max_blocks is None else max_blocks,
            max_sessions=config.max_sessions,
            release=self._kv.unpin,
        )
        self._turns = SessionTurns(self.sessions, self._kv, self._scheduler.pop_kept)
        self._scheduler.reclaim = self._turns.reclaim
        self._next_expiry = 0.0
        self._wake = trio.Event()
        self._state = _State.NEW
        self._failure: str | None = None
        self._metrics = EngineMetrics()

    # -- public surface -------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """Started and not dead (still true while draining after :meth:`shutdown`)."""
        return self._state in (_State.RUNNING, _State.SHUTTING_DOWN, _State.DRAINING)

    @property
    def failure(self) -> str | None:
        """Why the engine died, ``None`` while it has not."""
        return self._failure

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The engine task. Returns after :meth:`shutdown` once idle, or when it died."""
        if self._state is not _State.NEW:
            raise RuntimeError("Engine.run() can only be called once")
        self._state = _State.RUNNING
        task_status.started()
        try:
            await self._loop()
        except Exception as exc:
            logger.exception("The engine task died")
            self._die(f"the engine failed: {exc!r}")
            return
        except BaseException:
            self._die("the engine was stopped")
            raise
        finally:
            self._model_thread.close()  # an abandoned step still finishes first
        if self._state in (_State.SHUTTING_DOWN, _State.DRAINING):
            self._state = _State.STOPPED

    def submit(self, request: GenerationRequest) -> RequestStream:
        """Queue a request; its stream yields its events. Raises the :class:`EngineError`\\ s."""
        try:
            return self._submit(request)
        except EngineError:
            self._metrics.count("rejected")
            raise

    def check_room(self, num_sequences: int) -> None:
        """Raise :class:`EngineBusy` unless the queue can take ``num_sequences`` more.

        The queue (``max_waiting``) counts sequences: a request of ``n`` samples takes ``n``
        places, so one request cannot queue sixteen times its share. :meth:`submit` checks
        each request; a caller about to submit several checks their sum first, so that a
        batch is refused whole before any of it is queued.
        """
        try:
            self._check_room(num_sequences)
        except EngineBusy:
            self._metrics.count("rejected")
            raise

    def _check_room(self, num_sequences: int) -> None:
        waiting = self._scheduler.num_waiting_sequences
        if waiting + num_sequences > self.config.max_waiting:
            raise EngineBusy(
                f"{waiting} sequences are waiting, and the queue holds "
                f"{self.config.max_waiting}; this request needs {num_sequences}"
            )

    def abort(self, request_id: str) -> None:
        """Drop a request in any state, freeing its KV blocks now; end its session turn
        uncommitted if it has one. Idempotent."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            self._scheduler.abort(request_id)
            self._metrics.count("aborted")
            request.send.close()
        self._turns.end_for(request_id)

    def stop_sample(self, request_id: str, index: int) -> None:
        """End one sample as 'stop' (a stop string matched in its stream). Never awaits."""
        request = self._requests.get(request_id)
        if request is None or request.done[index]:
            return
        self._scheduler.abort_sample(request_id, index)
        self._finish_sample(request, index, FinishReason.STOP)

    # -- sessions -------------------------------------------------------------------------

    def begin_turn(
        self, session_id: str, owner: str, new_messages: Sequence[Mapping[str, Any]]
    ) -> Turn:
        """Start a session turn (creating the session); raises ``SessionBusy``,
        ``SessionNotFound`` or ``ValueError``. The caller must :meth:`end_turn` it."""
        return self._turns.begin(session_id, owner, new_messages)

    def commit_turn(self, turn: Turn, reply: Mapping[str, Any]) -> bool:
        """Append the finished turn and its ``reply`` to the session, with the KV its
        request pinned. ``False`` (nothing changed) unless its request finished."""
        return self._turns.commit(turn, reply)

    def end_turn(self, turn: Turn) -> None:
        """Free the session for its next turn; uncommitted pins are dropped. Idempotent,
        never awaits (safe in ``finally`` and under cancellation)."""
        self._turns.end(turn)

    def get_session(self, session_id: str, owner: str) -> Session:
        return self._turns.get(session_id, owner)

    def delete_session(self, session_id: str, owner: str) -> None:
        self._turns.delete(session_id, owner)

    def shutdown(self) -> None:
        """Stop admitting (submit raises :class:`EngineUnavailable`) and fail the waiting
        requests; running ones finish, then :meth:`run` returns."""
        if self._state in (_State.RUNNING, _State.DRAINING):
            self._state = _State.SHUTTING_DOWN
        for group in list(self._scheduler.waiting):
            self._scheduler.abort(group.request_id)
            self._fail_request(
                group.request_id, "the server is shutting down", FailureCause.SHUTDOWN
            )
        self._wake.set()

    def drain(self) -> None:
        """Stop admitting (:meth:`submit` raises :class:`EngineUnavailable`) but let every
        accepted request, queued ones included, finish; :meth:`run` returns once none is
        left. :meth:`cancel_all` ends a drain that takes too long."""
        if self._state is _State.RUNNING:
            self._state = _State.DRAINING
        self._wake.set()

    def cancel_all(self, reason: str) -> int:
        """Fail every request now (cause :attr:`FailureCause.SHUTDOWN`), freeing its KV;
        return how many there were. Never awaits."""
        request_ids = list(self._requests)
        for request_id in request_ids:
            self._scheduler.abort(request_id)
            self._fail_request(request_id, reason, FailureCause.SHUTDOWN)
        self._wake.set()
        return len(request_ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` as this engine's streams decode it."""
        return self._text.decode(token_ids)

    @property
    def num_requests(self) -> int:
        """Requests accepted and not yet finished, failed or aborted."""
        return len(self._requests)

    def statistics(self) -> EngineStatistics:
        pool = self._pool
        return self._metrics.snapshot(
            running=self._scheduler.num_running,
            waiting=self._scheduler.num_waiting,
            kv_used=pool.num_used,
            kv_total=pool.num_blocks,
            alive=self.alive,
            prefix_queries=self._kv.prefix_queries,
            prefix_hits=self._kv.prefix_hits,
            sessions=len(self.sessions),
            session_pinned_blocks=self.sessions.pinned_blocks,
            kv_blocks_cached=pool.num_unreferenced_cached,
            kv_blocks_evicted=pool.evictions,
            kv_block_refs=pool.num_references,
            requests_in_flight=len(self._requests),
            turns_open=len(self._turns),
        )

    # -- submission -----------------------------------------------------------------------

    def _submit(self, request: GenerationRequest) -> RequestStream:
        if self._state is not _State.RUNNING:
            raise EngineUnavailable(self._failure or f"the engine is {self._state.value}")
        prompt = request.prompt_token_ids
        params = request.params
        check_request(
            request,
            max_context=self.max_context,
            max_running=self.config.max_running,
            blocks_needed=self._scheduler.blocks_needed(len(prompt), params),
            num_blocks=self._pool.num_blocks,
            id_in_use=request.request_id in self._requests or request.request_id in self._turns,
        )
        turn = request.turn
        self._check_room(params.n)
        if turn is not None:
            seed = self._turns.start(turn, request.request_id, params.seed)
            params = dataclasses.replace(params, seed=seed)
        send, receive = trio.open_memory_channel[Message](math.inf)
        self._scheduler.add(request.request_id, prompt, params, keep_kv=turn is not None)
        self._requests[request.request_id] = _Request(
            request_id=request.request_id,
            num_prompt_tokens=len(prompt),
            send=send,
            submitted_at=trio.current_time(),
            done=[False] * params.n,
            live=params.n,
            last_token_at=[None] * params.n,
        )
        self._wake.set()
        return RequestStream(self, self._text, request.request_id, receive, params, turn)

    # -- the loop -------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            if self._state is _State.DEAD:
                return
            if self._state in (_State.SHUTTING_DOWN, _State.DRAINING) and not (
                self._scheduler.has_work
            ):
                return
            now = trio.current_time()
            if now >= self._next_expiry:
                self.sessions.expire(now)
                self._next_expiry = now + 1.0
            step = self._scheduler.schedule()
            if step is None:
                self._wake = trio.Event()
                await self._wake.wait()
                continue
            self._on_admitted(step)
            started = trio.current_time()
            try:
                sampled = await self._run_step(step)
            except _WatchdogFired as exc:
                logger.error("%s; failing every request", exc)
                self._die(str(exc))
                return
            except Exception as exc:
                logger.warning("A model step failed: %r", exc, exc_info=exc)
                self._fail_step(step, f"the model failed: {exc}")
                continue
            try:
                outputs = self._scheduler.update(step, sampled)
            except StepMismatch as exc:
                logger.error("Bad runner output: %s", exc)
                self._fail_step(step, f"the model failed: {exc}")
                continue
            now = trio.current_time()
            if step.num_prefill_tokens:
                self._metrics.prefill_step_time.observe(now - started)
            else:
                self._metrics.decode_step_time.observe(now - started)
            self._deliver(outputs, now)

    async def _run_step(self, step: ScheduledStep) -> list[SampledToken]:
        """Run the model step on the model thread under the watchdog.

        The scope is shielded, so only its own deadline (the watchdog) cancels it: an
        outer cancellation waits for the step, as ``abandon_on_cancel=False`` would. When
        the watchdog fires the thread is abandoned, not stopped; it finishes on its own.
        """
        timeout = self.config.step_timeout_s
        deadline = math.inf if timeout is None else trio.current_time() + timeout
        with trio.CancelScope(deadline=deadline, shield=True):
            return await self._model_thread.run(self._runner.step, step.plan)
        raise _WatchdogFired(f"a model step ran past the watchdog of {timeout} s")

    def _on_admitted(self, step: ScheduledStep) -> None:
        now = trio.current_time()
        for request_id, cached in zip(step.admitted, step.cached_tokens, strict=True):
            request = self._requests.get(request_id)
            if request is None:
                continue
            queue_time = now - request.submitted_at
            self._metrics.queue_time.observe(queue_time)
            self._metrics.prompt_tokens_total += request.num_prompt_tokens
            self._send(request, Admitted(request.num_prompt_tokens, cached, queue_time))

    def _deliver(self, outputs: list[SampleOutput], now: float) -> None:
        metrics = self._metrics
        for output in outputs:
            request = self._requests.get(output.request_id)
            if request is None:
                continue
            scores = output.prompt_logprobs
            if scores is not None and not self._send(request, PromptScores(output.index, scores)):
                continue
            if output.token is not None:
                metrics.generation_tokens_total += 1
                if request.first_token_at is None:
                    request.first_token_at = now
                    metrics.time_to_first_token.observe(now - request.submitted_at)
                last = request.last_token_at[output.index]
                if last is not None:
                    metrics.inter_token_latency.observe(now - last)
                request.last_token_at[output.index] = now
                if last is None or self.config.stream_interval == 1:
                    message = Tokens(output.index, (output.token,))
                else:
                    held = request.held.setdefault(output.index, [])
                    held.append(output.token)
                    if len(held) < self.config.stream_interval and output.finish is None:
                        continue
                    message = Tokens(output.index, tuple(held))
                    held.clear()
                if not self._send(request, message):
                    continue
            if output.finish is not None:
                self._finish_sample(request, output.index, output.finish)

    def _send(self, request: _Request, message: Message) -> bool:
        """Whether the message went out; a closed stream aborts the request."""
        try:
            request.send.send_nowait(message)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.abort(request.request_id)
            return False
        return True

    def _finish_sample(self, request: _Request, index: int, reason: FinishReason) -> None:
        if request.done[index]:
            return
        held = request.held.pop(index, None)
        if held and not self._send(request, Tokens(index, tuple(held))):
            return
        request.done[index] = True
        request.live -= 1
        request.any_length |= reason is FinishReason.LENGTH
        if not self._send(request, Finish(index, reason)):
            return
        if request.live == 0:
            del self._requests[request.request_id]
            self._turns.finished(request.request_id)
            self._metrics.count("finished_length" if request.any_length else "finished_stop")
            self._metrics.e2e_latency.observe(trio.current_time() - request.submitted_at)
            request.send.close()

    def _fail_step(self, step: ScheduledStep, message: str) -> None:
        for request_id in self._scheduler.fail(step):
            self._fail_request(request_id, message)

    def _fail_request(
        self, request_id: str, message: str, cause: FailureCause = FailureCause.MODEL
    ) -> None:
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        self._metrics.count("failed")
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            request.send.send_nowait(Failed(message, cause))
        request.send.close()

    def _die(self, reason: str) -> None:
        """Mark the engine dead and fail every request. Whatever breaks on the way, every
        channel ends up closed, so no stream waits forever (a closed channel without a
        :class:`Failed` reads as an aborted request)."""
        self._state = _State.DEAD
        self._failure = reason
        try:
            self._scheduler.abort_all()
        except Exception:  # the scheduler may be what broke; the streams matter more
            logger.exception("Cleaning up the scheduler failed")
        for request_id in list(self._requests):
            try:
                self._fail_request(request_id, reason, FailureCause.ENGINE)
            except Exception:
                logger.exception("Failing request %s failed", request_id)
        for request in self._requests.values():
            request.send.close()
        self._requests.clear()


class _WatchdogFired(Exception):
    """A model step ran past ``step_timeout_s``."""
