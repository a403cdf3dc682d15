"""The engine's snapshots, read from its parts on the Trio thread.

:meth:`Snapshots.statistics` gives the :class:`~furnace_trio.engine.stats.EngineStatistics`
(counts and histograms, for ``/metrics``), :meth:`Snapshots.status` the
:class:`~furnace_trio.engine.status.EngineStatus` (every request in flight now, for
``/status``). Both read the scheduler, the KV cache manager, the session store, the
outbox and the step counters as they are at that instant, and never await.
"""

from __future__ import annotations

import trio

from furnace_trio.core.plan import StepRunner
from furnace_trio.engine.delivery import Outbox
from furnace_trio.engine.kv_cache_manager import KVCacheManager
from furnace_trio.engine.pacing import StepPacer
from furnace_trio.engine.scheduler import Scheduler
from furnace_trio.engine.session_turns import SessionTurns
from furnace_trio.engine.sessions import SessionStore
from furnace_trio.engine.stats import EngineMetrics, EngineStatistics
from furnace_trio.engine.status import EngineStatus, StepRate, engine_status

__all__ = ["Snapshots"]


class Snapshots:
    """Reads the engine's parts into its frozen snapshots."""

    def __init__(
        self,
        runner: StepRunner,
        scheduler: Scheduler,
        kv: KVCacheManager,
        sessions: SessionStore,
        turns: SessionTurns,
        outbox: Outbox,
        metrics: EngineMetrics,
        steps: StepRate,
        pacer: StepPacer | None,
    ) -> None:
        self._runner = runner
        self._scheduler = scheduler
        self._kv = kv
        self._sessions = sessions
        self._turns = turns
        self._outbox = outbox
        self._metrics = metrics
        self._steps = steps
        self._pacer = pacer

    def status(self, state: str, alive: bool) -> EngineStatus:
        return engine_status(
            state,
            alive,
            self._scheduler,
            self._kv,
            self._sessions,
            self._steps,
            trio.current_time(),
            submitted_at=self._outbox.submitted_at,
            session_of=self._turns.session_of,
            pacing=None if self._pacer is None else self._pacer.status(),
        )

    def statistics(self, alive: bool) -> EngineStatistics:
        pool = self._kv.pool
        return self._metrics.snapshot(
            running=self._scheduler.num_running,
            waiting=self._scheduler.num_waiting,
            kv_used=pool.num_used,
            kv_total=pool.num_blocks,
            alive=alive,
            prefix_queries=self._kv.prefix_queries,
            prefix_hits=self._kv.prefix_hits,
            sessions=len(self._sessions),
            session_pinned_blocks=self._sessions.pinned_blocks,
            kv_blocks_cached=pool.num_unreferenced_cached,
            kv_blocks_reserved=self._kv.num_reserved,
            kv_blocks_evicted=pool.evictions,
            kv_block_refs=pool.num_references,
            requests_in_flight=len(self._outbox),
            turns_open=len(self._turns),
            requests_paused=self._scheduler.num_paused,
            steps_total=self._steps.total,
            pacing=None if self._pacer is None else self._pacer.status(),
            expert_tokens=_expert_tokens(self._runner),
        )


def _expert_tokens(runner: StepRunner) -> tuple[tuple[int, ...], ...]:
    """The runner's tokens per expert where it counts them (an optional ``expert_tokens()``:
    the model runner of a mixture of experts; plain tuples of ints, read from the last
    step's host copy, so calling it here while a step runs is safe)."""
    counts = getattr(runner, "expert_tokens", None)
    return counts() if callable(counts) else ()
