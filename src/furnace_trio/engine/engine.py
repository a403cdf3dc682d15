"""The engine task: continuous batching over a :class:`~furnace_trio.core.plan.StepRunner`.

One Trio task (:meth:`Engine.run`, started with ``nursery.start``) owns the scheduler and
the KV block pool; nothing else touches them except the synchronous :meth:`Engine.submit`
and :meth:`Engine.abort`, which run on the same Trio thread, so there are no locks::

    loop: schedule()  ->  await model_thread.run(runner.step, plan)  ->  update()  ->  send_nowait
          (idle: sleep on a trio.Event that submit() sets)

- Aborts take effect at once (blocks freed synchronously); a request submitted while a
  step runs joins the next step (continuous batching).
- Tokens go out through the :class:`~furnace_trio.engine.delivery.Outbox`, with
  ``send_nowait`` on each request's unbounded channel, so the engine never waits on a
  slow client; a closed channel means the client left, and the request is aborted. What
  a stream has not taken yet is its backlog: past ``max_response_bytes`` the request
  pauses (keeps its KV, takes no steps) until its client reads again
  (:mod:`~furnace_trio.engine.backlog`).
- Text work runs in the consumer's task (:mod:`~furnace_trio.engine.stream`), which
  reaches the engine only through :class:`~furnace_trio.engine.stream.StreamOwner`.
- Each step runs and is settled by the :class:`~furnace_trio.engine.stepper.Stepper`:
  when ``runner.step`` raises, only the requests that make it raise fail
  (:mod:`~furnace_trio.engine.isolation`). If the engine task itself dies (a bug, or a
  step past the ``step_timeout_s`` watchdog), every stream gets
  :class:`~furnace_trio.engine.events.Failed`, :attr:`Engine.alive` turns false and
  :meth:`Engine.submit` raises :class:`EngineUnavailable`: no request ever hangs.
  :meth:`Engine.run` then returns instead of raising, because an exception escaping
  quart-trio's lifespan nursery is only logged while the server goes on. Every
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

import dataclasses
import enum
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import trio

from furnace_trio.core.plan import StepRunner
from furnace_trio.engine.backlog import Backlog
from furnace_trio.engine.block_pool import BlockPool
from furnace_trio.engine.config import EngineConfig, fixed_changes
from furnace_trio.engine.delivery import Outbox
from furnace_trio.engine.errors import (
    EngineBusy,
    EngineError,
    EngineUnavailable,
    check_request,
    check_room,
)
from furnace_trio.engine.events import FailureCause, GenerationRequest
from furnace_trio.engine.isolation import StepAbandoned
from furnace_trio.engine.kv_cache_manager import KVCacheManager
from furnace_trio.engine.model_thread import ModelThread
from furnace_trio.engine.pacing import StepPacer
from furnace_trio.engine.scheduler import FinishReason, Scheduler
from furnace_trio.engine.session_turns import SessionTurns
from furnace_trio.engine.sessions import (
    Session,
    SessionReply,
    SessionStore,
    SharedHistory,
    Turn,
)
from furnace_trio.engine.snapshots import Snapshots
from furnace_trio.engine.stats import EngineMetrics, EngineStatistics
from furnace_trio.engine.status import EngineStatus, StepRate
from furnace_trio.engine.stepper import Stepper
from furnace_trio.engine.stream import RequestStream, TokenText

logger = logging.getLogger(__name__)


_DEFAULT_CONFIG = EngineConfig()  # frozen, so one default is safe to share


class _State(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    SHUTTING_DOWN = "shutting down"
    DRAINING = "draining"
    STOPPED = "stopped"
    DEAD = "dead"


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
        pacer: StepPacer | None = None,
    ) -> None:
        # Steps run on one thread for the engine's life (see model_thread.py); a backend
        # passes the thread that loaded the model.
        self._model_thread = model_thread if model_thread is not None else ModelThread()
        self._text = TokenText(decode, decode_table, token_bytes)
        self.config = config
        self.max_context = min(config.max_context or runner.max_context, runner.max_context)
        self._pool = BlockPool(runner.num_blocks, runner.block_size, caching=config.prefix_cache)
        self._kv = KVCacheManager(self._pool)
        self._scheduler = scheduler = Scheduler(
            self._kv,
            max_running=config.max_running,
            max_step_tokens=config.max_step_tokens,
            max_context=self.max_context,
            eos_token_ids=eos_token_ids,
            speculation=config.speculation,
        )
        max_blocks = config.session_max_blocks
        self.sessions = SessionStore(
            ttl_s=config.session_ttl_s,
            max_blocks=runner.num_blocks // 2 if max_blocks is None else max_blocks,
            max_sessions=config.max_sessions,
            release=self._kv.unpin,
        )
        self._turns = SessionTurns(
            self.sessions, self._kv, self._scheduler.pop_kept, self._text.decode
        )
        self._scheduler.reclaim = self._turns.reclaim
        if pacer is None and config.target_itl_ms is not None:  # a test passes its own
            pacer = StepPacer(config.target_itl_ms / 1000)
        scheduler.pacer = pacer
        self._next_expiry = 0.0
        self._wake = trio.Event()
        self._state = _State.NEW
        self._failure: str | None = None
        self._metrics = metrics = EngineMetrics()
        steps = StepRate()
        # Tasks in wait_statistics, woken after every change that statistics() shows.
        self._changed = trio.lowlevel.ParkingLot()
        self._outbox = outbox = Outbox(
            self._metrics,
            config.stream_interval,
            on_closed=self.abort,
            on_finished=self._turns.finished,
            on_backlogged=self._pause,
        )
        timeout = config.step_timeout_s
        self._stepper = Stepper(
            runner, self._model_thread, scheduler, outbox, metrics, steps, pacer, timeout
        )
        self._snapshots = Snapshots(
            runner, scheduler, self._kv, self.sessions, self._turns, outbox, metrics, steps, pacer
        )

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
            self._changed.unpark_all()
        if self._state in (_State.SHUTTING_DOWN, _State.DRAINING):
            self._state = _State.STOPPED
            self._changed.unpark_all()

    def submit(self, request: GenerationRequest) -> RequestStream:
        """Queue a request; its stream yields its events. Raises the :class:`EngineError`\\ s."""
        try:
            return self._submit(request)
        except EngineError:
            self._metrics.count("rejected")
            raise
        finally:
            self._changed.unpark_all()

    def check_room(self, num_sequences: int) -> None:
        """Raise :class:`EngineBusy` unless the queue can take ``num_sequences`` more.

        The queue (``max_waiting``) counts sequences: a request of ``n`` samples takes ``n``
        places, so one request cannot queue sixteen times its share. :meth:`submit` checks
        each request; a caller about to submit several checks their sum first, so that a
        batch is refused whole before any of it is queued.
        """
        try:
            check_room(
                self._scheduler.num_waiting_sequences, self.config.max_waiting, num_sequences
            )
        except EngineBusy:
            self._metrics.count("rejected")
            raise

    def abort(self, request_id: str) -> None:
        """Drop a request in any state, freeing its KV blocks now; end its session turn
        uncommitted if it has one. Idempotent."""
        if self._outbox.close(request_id):
            if self._scheduler.is_waiting(request_id):
                self._metrics.cancelled_before_admission += 1
            self._scheduler.abort(request_id)
            self._metrics.count("aborted")
        self._turns.end_for(request_id)
        self._changed.unpark_all()

    def resume(self, request_id: str) -> None:
        """Let a request that its backlog paused take steps again (its stream caught up).
        Never awaits."""
        if request_id in self._outbox:
            self._scheduler.resume(request_id)
            self._wake.set()
            self._changed.unpark_all()

    def stop_sample(self, request_id: str, index: int) -> None:
        """End one sample as 'stop' (a stop string matched in its stream). Never awaits."""
        if not self._outbox.sample_open(request_id, index):
            return
        self._scheduler.abort_sample(request_id, index)
        self._outbox.finish_sample(request_id, index, FinishReason.STOP)
        self._changed.unpark_all()

    # -- sessions -------------------------------------------------------------------------

    def begin_turn(
        self, session_id: str, owner: str, new_messages: Sequence[Mapping[str, Any]]
    ) -> Turn:
        """Start a session turn (creating the session); raises ``SessionBusy``,
        ``SessionNotFound`` or ``ValueError``. The caller must :meth:`end_turn` it."""
        return self._turns.begin(session_id, owner, new_messages)

    def commit_turn(self, turn: Turn, reply: SessionReply) -> bool:
        """Append the finished turn and its ``reply`` to the session, with the KV its
        request pinned. ``False`` (nothing changed) unless its request finished."""
        committed = self._turns.commit(turn, reply)
        self._changed.unpark_all()
        return committed

    def end_turn(self, turn: Turn) -> None:
        """Free the session for its next turn; uncommitted pins are dropped. Idempotent,
        never awaits (safe in ``finally`` and under cancellation)."""
        self._turns.end(turn)
        self._changed.unpark_all()

    def adopt_session(self, shared: SharedHistory) -> Session:
        """Make a session of a history another replica kept (see
        :meth:`SessionStore.adopt`); its next turn recomputes the KV."""
        return self.sessions.adopt(shared, trio.current_time())

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
            self._outbox.fail(
                group.request_id, "the server is shutting down", FailureCause.SHUTDOWN
            )
        self._wake.set()
        self._changed.unpark_all()

    def drain(self) -> None:
        """Stop admitting (:meth:`submit` raises :class:`EngineUnavailable`) but let every
        accepted request, queued ones included, finish; :meth:`run` returns once none is
        left. :meth:`cancel_all` ends a drain that takes too long."""
        if self._state is _State.RUNNING:
            self._state = _State.DRAINING
        self._wake.set()
        self._changed.unpark_all()

    def cancel_all(self, reason: str) -> int:
        """Fail every request now (cause :attr:`FailureCause.SHUTDOWN`), freeing its KV;
        return how many there were. Never awaits."""
        request_ids = list(self._outbox)
        for request_id in request_ids:
            self._scheduler.abort(request_id)
            self._outbox.fail(request_id, reason, FailureCause.SHUTDOWN)
        self._wake.set()
        self._changed.unpark_all()
        return len(request_ids)

    def reconfigure(self, config: EngineConfig) -> None:
        """Apply the settings of ``config`` that can change while serving (see
        :data:`~furnace_trio.engine.config.LIVE_FIELDS`): admission and step planning use
        them from the next step on, a request already accepted keeps its backlog limit, and
        session caps hold from the next session change. ``ValueError`` when another
        setting differs from the engine's (those need a new engine). Never awaits."""
        fixed = fixed_changes(self.config, config)
        if fixed:
            raise ValueError(f"cannot change while serving: {', '.join(fixed)}")
        self.config = config
        self._scheduler.max_running = config.max_running
        self._scheduler.max_step_tokens = config.max_step_tokens
        store = self.sessions
        store.ttl_s = config.session_ttl_s
        max_blocks = config.session_max_blocks
        store.max_blocks = self._pool.num_blocks // 2 if max_blocks is None else max_blocks
        store.max_sessions = config.max_sessions
        self._stepper.step_timeout_s = config.step_timeout_s
        self._next_expiry = 0.0  # a shorter TTL applies at the next loop turn
        self._wake.set()  # a larger max_running may admit queued requests now
        self._changed.unpark_all()

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` as this engine's streams decode it."""
        return self._text.decode(token_ids)

    @property
    def num_requests(self) -> int:
        """Requests accepted and not yet finished, failed or aborted."""
        return len(self._outbox)

    async def wait_statistics(
        self, condition: Callable[[EngineStatistics], object]
    ) -> EngineStatistics:
        """The first :meth:`statistics` snapshot for which ``condition`` holds.

        Checked now and after every change that the statistics show (a request submitted,
        admitted, stepped, finished, failed or aborted, a session turn ended, the engine
        stopped or died), so a caller on the Trio thread waits for a state instead of
        polling for it. The caller bounds the wait (``trio.fail_after``) where the state
        may never come."""
        while True:
            stats = self.statistics()
            if condition(stats):
                return stats
            await self._changed.park()

    def kv_blocks(self) -> tuple[int, int]:
        """KV blocks (in use, in the pool) now: the cheap part of :meth:`statistics`."""
        return self._pool.num_used, self._pool.num_blocks

    def status(self) -> EngineStatus:
        """Every request in flight (running ones in admission order, then the queue) with its
        phase and KV, and the engine's KV and step rate: a frozen snapshot of now, for an
        operator (``GET /status``). Never awaits."""
        return self._snapshots.status(self._state.value, self.alive)

    def statistics(self) -> EngineStatistics:
        return self._snapshots.statistics(self.alive)

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
            id_in_use=request.request_id in self._outbox or request.request_id in self._turns,
        )
        turn = request.turn
        check_room(self._scheduler.num_waiting_sequences, self.config.max_waiting, params.n)
        if turn is not None:
            seed = self._turns.start(turn, request.request_id, params.seed)
            params = dataclasses.replace(params, seed=seed)
        self._scheduler.add(request.request_id, prompt, params, keep_kv=turn is not None)
        backlog = Backlog(request.max_response_bytes or self.config.max_response_bytes)
        receive = self._outbox.open(request.request_id, len(prompt), params.n, backlog)
        self._wake.set()
        self._changed.unpark_all()
        return RequestStream(
            self, self._text, request.request_id, receive, params, turn, backlog=backlog
        )

    # -- the loop -------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            self._changed.unpark_all()  # the last step's results, failures, aborts
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
            self._outbox.admitted(step, trio.current_time())
            self._changed.unpark_all()
            try:
                await self._stepper.step(step)
            except StepAbandoned as exc:
                logger.error("%s; failing every request", exc)
                self._die(str(exc))
                return

    def _pause(self, request_id: str) -> None:
        """Its stream holds more than ``max_response_bytes`` unsent: no steps until
        :meth:`resume`."""
        if self._scheduler.pause(request_id):
            self._metrics.pauses_total += 1
            self._changed.unpark_all()

    def _die(self, reason: str) -> None:
        """Mark the engine dead and fail every request. Whatever breaks on the way, every
        channel ends up closed, so no stream waits forever (a closed channel without a
        :class:`Failed` reads as an aborted request)."""
        self._state = _State.DEAD
        self._changed.unpark_all()
        self._failure = reason
        try:
            self._scheduler.abort_all()
        except Exception:  # the scheduler may be what broke; the streams matter more
            logger.exception("Cleaning up the scheduler failed")
        for request_id in self._outbox:
            try:
                self._outbox.fail(request_id, reason, FailureCause.ENGINE)
            except Exception:
                logger.exception("Failing request %s failed", request_id)
        self._outbox.close_all()
