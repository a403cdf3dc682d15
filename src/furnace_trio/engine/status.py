"""What the engine is doing now, request by request: the frozen :class:`EngineStatus`
that :meth:`furnace_trio.engine.Engine.status` returns (the server's ``GET /status``).

:class:`EngineStatistics <furnace_trio.engine.stats.EngineStatistics>` counts (totals and
histograms, for ``/metrics``); this is a picture of the moment for an operator: every
request in flight with its phase and its KV, and the step rate. It is built from the
scheduler's own records on the Trio thread, so it is consistent: the requests' blocks are
the blocks the scheduler holds at that instant.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from furnace_trio.engine.pacing import PacingStatus
from furnace_trio.engine.sequence import Group, SeqStatus

if TYPE_CHECKING:
    from furnace_trio.engine.kv_cache_manager import KVCacheManager
    from furnace_trio.engine.scheduler import Scheduler
    from furnace_trio.engine.sessions import SessionStore

__all__ = ["EngineStatus", "RequestPhase", "RequestStatus", "StepRate"]


class RequestPhase(enum.StrEnum):
    """Where a request is: waiting for admission, computing its prompt, or generating."""

    QUEUED = "queued"
    PREFILL = "prefill"
    DECODING = "decoding"


@dataclass(frozen=True, slots=True)
class RequestStatus:
    """One request in flight.

    ``prefilled_tokens`` of ``prompt_tokens`` are in the KV cache (``cached_tokens`` of
    them found in the prefix cache at admission). ``generated_tokens`` counts every
    sample's output. ``kv_blocks_used`` blocks hold its KV now; ``kv_blocks_reserved`` is
    what it holds plus what admission set aside for it to grow into (its worst case
    minus what it no longer needs): a queued request holds and reserves nothing.
    """

    request_id: str
    phase: RequestPhase
    prompt_tokens: int
    prefilled_tokens: int
    cached_tokens: int
    generated_tokens: int
    samples: int
    kv_blocks_used: int
    kv_blocks_reserved: int
    age_s: float
    session_id: str | None


@dataclass(frozen=True, slots=True)
class EngineStatus:
    """The engine at one instant.

    ``running`` counts sequences (``n`` per request), ``waiting`` queued requests. Of the
    ``kv_blocks_total`` blocks, ``kv_blocks_used`` are referenced (running sequences,
    session pins), ``kv_blocks_free`` are not (``kv_blocks_cached`` of those still hold
    prefix-cache KV and are reused or evicted on demand); ``kv_blocks_reserved`` more are
    set aside for admitted requests to grow into and ``kv_blocks_pinned`` are held by
    sessions. ``step_rate`` is model steps per second over the last few seconds.
    ``pacing`` is what the prefill pacer learned (``None`` without a target ITL).
    """

    state: str
    alive: bool
    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_reserved: int
    kv_blocks_pinned: int
    kv_blocks_cached: int
    sessions: int
    steps_total: int
    step_rate: float
    requests: tuple[RequestStatus, ...]
    pacing: PacingStatus | None = None


def request_status(
    group: Group, *, submitted_at: float | None, now: float, session_id: str | None
) -> RequestStatus:
    """A request's status from its scheduler record (see :mod:`~furnace_trio.engine.sequence`)."""
    prompt = len(group.prompt)
    prefill = group.prefill
    prefilled = prompt if prefill is None else min(prefill.num_computed_tokens, prompt)
    if group.status is SeqStatus.WAITING:
        phase = RequestPhase.QUEUED
        prefilled = 0
    elif prefilled < prompt:
        phase = RequestPhase.PREFILL
    else:
        phase = RequestPhase.DECODING
    seqs = list(group.samples)
    if prefill is not None and prefill not in seqs:
        seqs.append(prefill)
    blocks = {block for seq in seqs for block in seq.kv.block_table}
    reserved = sum(seq.kv.reserved for seq in seqs)
    return RequestStatus(
        request_id=group.request_id,
        phase=phase,
        prompt_tokens=prompt,
        prefilled_tokens=prefilled,
        cached_tokens=group.cached_tokens,
        generated_tokens=sum(seq.num_output_tokens for seq in group.samples),
        samples=group.params.n,
        kv_blocks_used=len(blocks),
        kv_blocks_reserved=len(blocks) + reserved,
        age_s=0.0 if submitted_at is None else max(now - submitted_at, 0.0),
        session_id=session_id,
    )


class StepRate:
    """Model steps per second over the last ``window_s`` seconds (0 when idle)."""

    __slots__ = ("_times", "total", "window_s")

    def __init__(self, window_s: float = 5.0, most: int = 1024) -> None:
        self.window_s = window_s
        self.total = 0
        self._times: deque[float] = deque(maxlen=most)

    def record(self, now: float) -> None:
        self.total += 1
        self._times.append(now)

    def rate(self, now: float) -> float:
        times = self._times
        while times and times[0] < now - self.window_s:
            times.popleft()
        if len(times) < 2:
            return 0.0
        # steps since the oldest one in the window, over the time since it
        return (len(times) - 1) / max(now - times[0], 1e-9)


def engine_status(
    state: str,
    alive: bool,
    scheduler: Scheduler,
    kv: KVCacheManager,
    sessions: SessionStore,
    steps: StepRate,
    now: float,
    *,
    submitted_at: Callable[[str], float | None],
    session_of: Callable[[str], str | None],
    pacing: PacingStatus | None = None,
) -> EngineStatus:
    """The engine's snapshot from its parts: every request in flight (running ones in
    admission order, then the queue), with when it was submitted and its session."""
    requests = tuple(
        request_status(
            group,
            submitted_at=submitted_at(group.request_id),
            now=now,
            session_id=session_of(group.request_id),
        )
        for group in (*scheduler.running.values(), *scheduler.waiting)
    )
    pool = kv.pool
    return EngineStatus(
        state=state,
        alive=alive,
        running=scheduler.num_running,
        waiting=scheduler.num_waiting,
        kv_blocks_total=pool.num_blocks,
        kv_blocks_used=pool.num_used,
        kv_blocks_free=pool.num_free,
        kv_blocks_reserved=kv.num_reserved,
        kv_blocks_pinned=sessions.pinned_blocks,
        kv_blocks_cached=pool.num_unreferenced_cached,
        sessions=len(sessions),
        steps_total=steps.total,
        step_rate=steps.rate(now),
        requests=requests,
        pacing=pacing,
    )
