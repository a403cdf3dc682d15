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
- Text work runs in the consumer's task, in :meth:`RequestStream.__anext__`: incremental
  detokenization and stop strings cost the engine loop nothing, and a stop-string match
  ends its sample through the same synchronous abort path as a disconnect.
- Failure isolation: a raising ``runner.step`` fails only the requests of that plan. If the
  engine task itself dies (a bug), every stream gets :class:`Failed`, :attr:`Engine.alive`
  turns false and :meth:`Engine.submit` raises :class:`EngineUnavailable`: no request
  ever hangs. :meth:`Engine.run` then returns instead of raising, because an exception
  escaping quart-trio's lifespan nursery is only logged while the server goes on.
- Steps run on one :class:`~furnace_trio.engine.model_thread.ModelThread` for the engine's life
  (OpenMP thread teams are per thread; see that module).
- Watchdog: a step that runs past ``step_timeout_s`` kills the engine the same way. A
  thread cannot be killed, so the engine abandons the step (under a shielded scope whose
  own deadline is the watchdog: nothing else can cancel a step) and the thread finishes
  whenever it finishes; no other step ever starts, because the engine is dead. Every
  :class:`Failed` carries a :class:`FailureCause`, so the HTTP layer can tell "the model
  failed on this request" (500) from "the server cannot serve" (503).
- Drain: :meth:`Engine.drain` stops admitting but lets every accepted request (running or
  queued) finish; :meth:`Engine.cancel_all` then fails whatever is left, and :meth:`run`
  returns once nothing is left.
- Prefix cache and sessions: the block pool keeps finished requests' full blocks cached
  (see :mod:`~furnace_trio.engine.block_pool`); :class:`Admitted` reports the reused tokens. A
  request carrying a session :class:`~furnace_trio.engine.sessions.Turn` pins its KV when it
  finishes; the handler then commits the reply (:meth:`Engine.commit_turn`) and always ends
  the turn (:meth:`Engine.end_turn`; :meth:`Engine.abort` ends it too), so a turn that is
  cancelled or fails leaves its session exactly as it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import math
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal

import trio

from furnace_trio.core.params import SamplingParams
from furnace_trio.core.plan import SampledToken, StepRunner
from furnace_trio.engine.block_pool import BlockPool
from furnace_trio.engine.kv_cache_manager import KeptKV, KVCacheManager
from furnace_trio.engine.model_thread import ModelThread
from furnace_trio.engine.scheduler import (
    FinishReason,
    SampleOutput,
    ScheduledStep,
    Scheduler,
    StepMismatch,
)
from furnace_trio.engine.sessions import Session, SessionStore, Turn, TurnState
from furnace_trio.engine.stats import EngineMetrics, EngineStatistics
from furnace_trio.text.detokenizer import Detokenizer, make_detokenizer
from furnace_trio.text.stop_strings import StopStringMatcher

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


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_running: int = 16  # sequences decoding at once
    max_waiting: int = 256  # queued requests before EngineBusy
    max_step_tokens: int = 512  # tokens per step (decode tokens + prefill chunks)
    max_context: int | None = None  # default runner.max_context
    session_ttl_s: float = 1800.0  # idle sessions expire after this
    session_max_blocks: int | None = None  # pinned KV of all sessions; None: half the pool
    max_sessions: int = 1024
    prefix_cache: bool = True  # reuse cached KV of equal prompt prefixes
    step_timeout_s: float | None = None  # watchdog: a longer step kills the engine
    # A sample's tokens after its first reach its stream in groups of this many (and at its
    # end): fewer, larger deltas, less work per token above the model (vLLM's
    # --stream-interval). 1 streams every token.
    stream_interval: int = 1

    def __post_init__(self) -> None:
        if self.step_timeout_s is not None and not self.step_timeout_s > 0:
            raise ValueError("step_timeout_s must be > 0")
        if self.session_ttl_s <= 0:
            raise ValueError("session_ttl_s must be > 0")
        if self.session_max_blocks is not None and self.session_max_blocks < 0:
            raise ValueError("session_max_blocks must be >= 0")
        if self.max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        if self.max_running < 1:
            raise ValueError("max_running must be at least 1")
        if self.max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        if self.max_step_tokens < self.max_running:
            raise ValueError("max_step_tokens must be at least max_running")
        if self.max_context is not None and self.max_context < 2:
            raise ValueError("max_context must be at least 2")
        if self.stream_interval < 1:
            raise ValueError("stream_interval must be at least 1")


# -- errors ---------------------------------------------------------------------------------


class EngineError(Exception):
    """Base of the errors :meth:`Engine.submit` raises."""


class EngineBusy(EngineError):
    """The wait queue is full: HTTP 503 with ``Retry-After``."""


class RequestRejected(EngineError, ValueError):
    """Bad input (empty prompt, longer than the context): HTTP 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RequestTooLarge(EngineError):
    """The request could never fit the KV pool (or ``max_running``): HTTP 503, no retry."""


class EngineUnavailable(EngineError):
    """Not started, dead, or shutting down: HTTP 503."""


# -- events ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Admitted:
    """Once per request, when its prefill starts."""

    prompt_tokens: int
    cached_tokens: int
    queue_time: float


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token: str
    token_id: int
    logprob: float
    bytes: tuple[int, ...] | None


@dataclass(frozen=True, slots=True)
class LogprobEntry:
    token: str
    token_id: int
    logprob: float | None  # None: an echoed prompt's first token
    bytes: tuple[int, ...] | None
    top: tuple[TopLogprob, ...]


@dataclass(frozen=True, slots=True)
class Delta:
    """New text of sample ``index``, with every token id since the previous delta of it."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[LogprobEntry, ...]
    #: With ``prompt_logprobs``, on the sample's first delta: the prompt's tokens after
    #: the first, scored.
    prompt_logprobs: tuple[LogprobEntry, ...] | None = None


@dataclass(frozen=True, slots=True)
class Finished:
    """Once per sample index; ``completion_tokens`` excludes an EOS/stop token."""

    index: int
    reason: Literal["stop", "length"]
    completion_tokens: int


class FailureCause(enum.Enum):
    """Why a request failed: its own model step (the server goes on), the engine (dead or
    stuck: nothing more will be served), or a shutdown that outlasted the drain."""

    MODEL = "model"
    ENGINE = "engine"
    SHUTDOWN = "shutdown"


@dataclass(frozen=True, slots=True)
class Failed:
    """Terminal for the whole request."""

    message: str
    cause: FailureCause = FailureCause.MODEL


Event = Admitted | Delta | Finished | Failed


def _new_request_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    request_id: str = field(default_factory=_new_request_id)
    turn: Turn | None = None  # the session turn this request is (n == 1 only)


# -- engine -> stream messages ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Token:
    """Tokens of sample ``index``, in order: one, or up to ``stream_interval`` held back."""

    index: int
    tokens: tuple[SampledToken, ...]


@dataclass(frozen=True, slots=True)
class _Finish:
    index: int
    reason: FinishReason


@dataclass(frozen=True, slots=True)
class _PromptScores:
    """The scored prompt tokens of sample ``index`` (``prompt_logprobs``), before its first
    token."""

    index: int
    scores: tuple[SampledToken, ...]


_Message = Admitted | Failed | _Token | _Finish | _PromptScores


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
    send: trio.MemorySendChannel[_Message]
    submitted_at: float
    done: list[bool]
    live: int
    last_token_at: list[float | None]
    first_token_at: float | None = None
    any_length: bool = False
    # per sample index, tokens held back for the next group (stream_interval > 1)
    held: dict[int, list[SampledToken]] = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class _TurnRun:
    """A session turn's request: the seed it samples with and, once it finished, its pins."""

    turn: Turn
    seed: int | None
    kept: KeptKV | None = None


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
        config: EngineConfig = EngineConfig(),  # frozen, so one default is safe to share
        model_thread: ModelThread | None = None,
    ) -> None:
        self._runner = runner
        # Steps run on one thread for the engine's life (see model_thread.py); a backend
        # passes the thread that loaded the model.
        self._model_thread = model_thread if model_thread is not None else ModelThread()
        self._decode = decode
        # Each id's bytes in decode's output, where decode is their concatenation
        # (Tokenizer.decode_table): streams then detokenize without calling decode.
        self._decode_table = decode_table
        self._token_bytes = token_bytes
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
        self._turns: dict[str, _TurnRun] = {}  # by request id, until the turn ends
        max_blocks = config.session_max_blocks
        self.sessions = SessionStore(
            ttl_s=config.session_ttl_s,
            max_blocks=runner.num_blocks // 2 if max_blocks is None else max_blocks,
            max_sessions=config.max_sessions,
            release=self._kv.unpin,
        )
        self._scheduler.reclaim = self._reclaim
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

    def abort(self, request_id: str) -> None:
        """Drop a request in any state, freeing its KV blocks now; end its session turn
        uncommitted if it has one. Idempotent."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            self._scheduler.abort(request_id)
            self._metrics.count("aborted")
            request.send.close()
        run = self._turns.get(request_id)
        if run is not None:
            self.end_turn(run.turn)

    # -- sessions -------------------------------------------------------------------------

    def begin_turn(
        self, session_id: str, owner: str, new_messages: Sequence[Mapping[str, Any]]
    ) -> Turn:
        """Start a session turn (creating the session); raises ``SessionBusy``,
        ``SessionNotFound`` or ``ValueError``. The caller must :meth:`end_turn` it."""
        return self.sessions.begin_turn(session_id, owner, new_messages, trio.current_time())

    def commit_turn(self, turn: Turn, reply: Mapping[str, Any]) -> bool:
        """Append the finished turn and its ``reply`` to the session, with the KV its
        request pinned. ``False`` (nothing changed) unless its request finished."""
        run = self._turns.get(turn.request_id or "")
        if run is None or run.kept is None or turn.state is not TurnState.OPEN:
            return False
        kept, run.kept = run.kept, None
        self.sessions.commit(
            turn,
            reply,
            token_ids=kept.token_ids,
            blocks=kept.blocks,
            output_token_ids=kept.output_token_ids,
            seed=run.seed,
            now=trio.current_time(),
        )
        return True

    def end_turn(self, turn: Turn) -> None:
        """Free the session for its next turn; uncommitted pins are dropped. Idempotent,
        never awaits (safe in ``finally`` and under cancellation)."""
        run = self._turns.pop(turn.request_id or "", None)
        if run is not None:
            kept = run.kept or self._scheduler.pop_kept(turn.request_id or "")
            if kept is not None:
                self._kv.unpin(kept.blocks)
        self.sessions.end_turn(turn, trio.current_time())

    def get_session(self, session_id: str, owner: str) -> Session:
        return self.sessions.get(session_id, owner, trio.current_time())

    def delete_session(self, session_id: str, owner: str) -> None:
        self.sessions.delete(session_id, owner, trio.current_time())

    def _reclaim(self, num_blocks: int) -> None:
        self.sessions.expire(trio.current_time())
        self.sessions.reclaim(num_blocks)

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
        return self._decode(token_ids)

    @property
    def num_requests(self) -> int:
        """Requests accepted and not yet finished, failed or aborted."""
        return len(self._requests)

    def statistics(self) -> EngineStatistics:
        pool = self._pool
        return self._metrics.snapshot(
            running=self._scheduler.num_running,
            waiting=self._scheduler.num_waiting,
            kv_used=self._pool.num_used,
            kv_total=self._pool.num_blocks,
            alive=self.alive,
            prefix_queries=self._kv.prefix_queries,
            prefix_hits=self._kv.prefix_hits,
            sessions=len(self.sessions),
            session_pinned_blocks=self.sessions.pinned_blocks,
            kv_blocks_cached=pool.num_unreferenced_cached,
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
        if not prompt:
            raise RequestRejected("the prompt is empty", param="prompt")
        if len(prompt) >= self.max_context:
            raise RequestRejected(
                f"the prompt has {len(prompt)} tokens; the context holds {self.max_context}",
                param="prompt",
            )
        if len(prompt) + params.max_tokens > self.max_context:
            raise RequestRejected(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"the context of {self.max_context} tokens",
                param="max_tokens",
            )
        if params.n > self.config.max_running:
            raise RequestTooLarge(
                f"n={params.n} exceeds the {self.config.max_running} sequences this server runs"
            )
        needed = self._scheduler.blocks_needed(len(prompt), params)
        if needed > self._pool.num_blocks:
            raise RequestTooLarge(
                f"the request needs {needed} KV blocks; the server has {self._pool.num_blocks}"
            )
        if request.request_id in self._requests or request.request_id in self._turns:
            raise RequestRejected(f"request id {request.request_id!r} is in use", param=None)
        turn = request.turn
        if turn is not None:
            if params.n != 1:
                raise RequestRejected("a session turn samples one choice (n=1)", param="n")
            if turn.state is not TurnState.OPEN or turn.request_id is not None:
                raise RequestRejected("this session turn has a request already", param=None)
        if self._scheduler.num_waiting >= self.config.max_waiting:
            raise EngineBusy(f"{self._scheduler.num_waiting} requests are waiting")
        if turn is not None:
            seed = self.sessions.seed_for(turn, params.seed)
            params = dataclasses.replace(params, seed=seed)
            turn.request_id = request.request_id
            self._turns[request.request_id] = _TurnRun(turn, seed)
        send, receive = trio.open_memory_channel[_Message](math.inf)
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
        return RequestStream(self, request.request_id, receive, params, turn)

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
            if scores is not None and not self._send(request, _PromptScores(output.index, scores)):
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
                    message = _Token(output.index, (output.token,))
                else:
                    held = request.held.setdefault(output.index, [])
                    held.append(output.token)
                    if len(held) < self.config.stream_interval and output.finish is None:
                        continue
                    message = _Token(output.index, tuple(held))
                    held.clear()
                if not self._send(request, message):
                    continue
            if output.finish is not None:
                self._finish_sample(request, output.index, output.finish)

    def _send(self, request: _Request, message: _Message) -> bool:
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
        if held and not self._send(request, _Token(index, tuple(held))):
            return
        request.done[index] = True
        request.live -= 1
        request.any_length |= reason is FinishReason.LENGTH
        if not self._send(request, _Finish(index, reason)):
            return
        if request.live == 0:
            del self._requests[request.request_id]
            run = self._turns.get(request.request_id)
            if run is not None:
                run.kept = self._scheduler.pop_kept(request.request_id)
            self._metrics.count("finished_length" if request.any_length else "finished_stop")
            self._metrics.e2e_latency.observe(trio.current_time() - request.submitted_at)
            request.send.close()

    def _stop_sample(self, request_id: str, index: int) -> None:
        """A stop string matched in the stream: end that sample as 'stop'."""
        request = self._requests.get(request_id)
        if request is None or request.done[index]:
            return
        self._scheduler.abort_sample(request_id, index)
        self._finish_sample(request, index, FinishReason.STOP)

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


# -- the consumer's side ----------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class _SampleText:
    """Text state of one sample: detokenizer, stop strings, tokens not yet in a delta."""

    detokenizer: Detokenizer
    stops: StopStringMatcher | None
    completion_tokens: int = 0
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
        engine: Engine,
        request_id: str,
        receive: trio.MemoryReceiveChannel[_Message],
        params: SamplingParams,
        turn: Turn | None = None,
    ) -> None:
        self.request_id = request_id
        self.turn = turn
        self._reply: list[str] = []  # sample 0's text, for the session's history
        self._engine = engine
        self._receive = receive
        self._params = params
        self._want_logprobs = params.logprobs is not None
        self._samples = [
            _SampleText(
                make_detokenizer(engine._decode, engine._decode_table),
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
            self._engine.abort(self.request_id)
        if self.turn is not None:
            self._engine.end_turn(self.turn)
        self._receive.close()

    # -- text -----------------------------------------------------------------------------

    def _handle(self, message: _Message) -> None:
        if isinstance(message, _Token):
            self._on_tokens(message.index, message.tokens)
        elif isinstance(message, _Finish):
            self._on_finish(message.index, message.reason.value)
        elif isinstance(message, _PromptScores):
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
                    self._engine._stop_sample(self.request_id, index)
                    self._commit_turn(index)
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
        self._commit_turn(index)

    def _commit_turn(self, index: int) -> None:
        """A session turn's only sample finished: its text (what the client got, stop
        strings removed) joins the history, with the KV the request pinned."""
        if self.turn is not None and index == 0:
            reply = {"role": "assistant", "content": "".join(self._reply)}
            self._engine.commit_turn(self.turn, reply)

    def _end_sample(self, index: int, text: str, reason: Literal["stop", "length"]) -> None:
        sample = self._samples[index]
        if text or sample.token_ids or sample.prompt_logprobs is not None:
            self._emit_delta(index, text)
        sample.finished = True
        self._ready.append(Finished(index, reason, sample.completion_tokens))
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
        return self._engine._decode((token_id,))

    def _bytes(self, token_id: int) -> tuple[int, ...] | None:
        token_bytes = self._engine._token_bytes
        return None if token_bytes is None else tuple(token_bytes(token_id))
